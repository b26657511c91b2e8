"""Chat templates against transformers' ``apply_chat_template`` on real template shapes (ChatML /
Qwen / SmolLM2 with and without ``{% generation %}``, Llama 3 with ``{{ bos_token }}``, Gemma without a
system role): the same ids, the same assistant mask where transformers has one, and the
prefix-derived mask of an untagged template equal to the tagged one's."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from tk.core.errors import TkError  # noqa: E402
from tk.core.text import TextTokenizer  # noqa: E402
from tk.core.text.chat import ChatTemplate, encode_chat, read_chat_template  # noqa: E402
from tests.plugins.hf_tiny import tokenizer  # noqa: E402

CHATML_TAGGED = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# the same with the separator inside the block: what an untagged template's prefix difference covers
CHATML_TAGGED_NL = CHATML_TAGGED.replace("'<|im_end|>' }}{% endgeneration %}{{ '\\n' }}",
                                         "'<|im_end|>\\n' }}{% endgeneration %}")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '<|im_end|>\\n\\n' + "
          "message['content'] | trim + '<|endoftext|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant<|im_end|>\\n\\n' }}{% endif %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
         "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + "
         "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
         "{{'<start_of_turn>model\\n'}}{% endif %}")
CHAT = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "the quick brown fox?"},
        {"role": "assistant", "content": "jumps over the lazy dog."}, {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "a stitch in time saves nine. é 東京"}]


def setup(tmp_path, template, bos=False):
    fast = tokenizer(tmp_path, bos=bos)
    fast.chat_template = template
    fast.save_pretrained(tmp_path)
    source, specials = read_chat_template(tmp_path)
    assert source == template
    return fast, TextTokenizer.load(tmp_path / "tokenizer.json"), ChatTemplate(source, specials)


@pytest.mark.parametrize("name,template,bos", [("chatml_tagged", CHATML_TAGGED, False), ("chatml", CHATML, False),
                                               ("llama3", LLAMA3, True), ("gemma", GEMMA, True)])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_ids_equal_apply_chat_template(tmp_path, name, template, bos, generation_prompt):
    fast, tok, chat = setup(tmp_path, template, bos)
    messages = CHAT[1:] if name == "gemma" else CHAT
    if generation_prompt:
        messages = messages[:-1]
    want = fast.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=True)
    ids, _ = encode_chat(tok, chat, messages, mask="all", add_generation_prompt=generation_prompt)
    assert ids == want["input_ids"]
    if bos:  # the template writes {{ bos_token }} and the tokenizer's template adds one: exactly one
        assert ids.count(3) == 1 and ids[0] == 3


def test_the_assistant_mask_equals_transformers_where_the_template_has_markers(tmp_path):
    fast, tok, chat = setup(tmp_path, CHATML_TAGGED)
    want = fast.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = encode_chat(tok, chat, CHAT)
    assert ids == want["input_ids"] and mask == want["assistant_masks"]
    end = tok.token_id("<|im_end|>")
    assert [m for i, m in zip(ids, mask) if i == end].count(1) == 2  # each turn's end-of-turn token is a target


def test_an_untagged_template_finds_the_assistant_turns_from_its_prefixes(tmp_path):
    fast, tok, tagged = setup(tmp_path, CHATML_TAGGED_NL)
    want = fast.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = encode_chat(tok, ChatTemplate(CHATML), CHAT)
    assert ids == want["input_ids"] and mask == want["assistant_masks"]
    _, last = encode_chat(tok, ChatTemplate(CHATML), CHAT, mask="last")
    first_turn = [a - b for a, b in zip(mask, last)]
    assert sum(last) > 0 and sum(first_turn) > 0 and min(first_turn) == 0


def test_a_template_error_is_one_line(tmp_path):
    _, tok, chat = setup(tmp_path, GEMMA, bos=True)
    with pytest.raises(TkError, match="System role not supported"):
        encode_chat(tok, chat, CHAT)
    with pytest.raises(TkError, match="cannot compile"):
        ChatTemplate("{% for m in messages %}")
