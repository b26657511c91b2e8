"""Tests for tk.core.nn.generation: cached == uncached decoding (greedy and beam, both stacks),
beam_size=1 == greedy, beam beats greedy on a hand-set LM, beam scores == recomputed
log-probs, PAD after EOS, max_len/min_len, sampling filters and reproducibility, padded
prompts/sources == unpadded ones, and input errors."""

import math

import pytest
import torch

from tk.core.config import build_dataclass
from tk.core.errors import TkError
from tk.core.nn.config import TransformerConfig
from tk.core.nn.generation.decoding import sample_next, top_k_filter, top_p_filter
from tk.core.nn.generation import GenerationConfig, beam_search, generate, greedy_decode, sample
from tk.core.nn.transformer import DecoderOnlyLM, EncoderDecoder

PAD, BOS, EOS, V = 0, 1, 2, 24


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models step by step: intra-op threads only add overhead (seconds per call on a
    busy machine instead of milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lm_cfg(dim: int, depth: int, num_heads: int, **kw) -> TransformerConfig:
    """A GPT-style model (pre-norm, GELU, learned positions) without dropout."""
    args = dict(dim=dim, depth=depth, num_heads=num_heads, dropout=0.0, activation="gelu", norm_first=True,
                pos_encoding="learned")
    return TransformerConfig(**{**args, **kw})


def make_lm(pos_encoding: str = "learned") -> DecoderOnlyLM:
    torch.manual_seed(0)
    lm = DecoderOnlyLM(lm_cfg(32, 2, 4, pos_encoding=pos_encoding, tie_embeddings=False, max_len=64), V, pad_id=PAD)
    with torch.no_grad():  # peaky, well-separated logits: no near-ties between the two paths
        lm.lm_head.weight.normal_(0.0, 0.4)
    return lm.eval()


def make_seq2seq() -> EncoderDecoder:
    torch.manual_seed(0)
    options = TransformerConfig(
        dim=32, depth=2, num_heads=4, hidden_dim=64, dropout=0.0, activation="relu", norm_first=False,
        pos_encoding="sinusoidal", tie_embeddings=False, max_len=64,
    )
    model = EncoderDecoder(options, V, V, pad_id=PAD)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.4)
    return model.eval()


def lm_prompts() -> tuple[torch.Tensor, list[list[int]]]:
    """Right-padded prompts of lengths 3, 6, 1, 4 and the unpadded rows."""
    rows = [[5, 9, 3], [7, 8, 12, 4, 4, 20], [BOS], [11, 13, 6, 17]]
    batch = torch.full((len(rows), 6), PAD)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = torch.tensor(r)
    return batch, rows


def sources() -> tuple[torch.Tensor, list[list[int]]]:
    rows = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 3, 16, 4, 21]]
    batch = torch.full((len(rows), 5), PAD)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = torch.tensor(r)
    return batch, rows


def model_and_inputs(kind: str):
    if kind == "lm":
        return make_lm(), lm_prompts()[0]
    return make_seq2seq(), sources()[0]


def cfg(**kw) -> GenerationConfig:
    base = dict(max_len=10, eos_id=EOS, bos_id=BOS, beam_size=3, length_penalty=1.0)
    return GenerationConfig(**{**base, **kw})


def sequence_log_probs(model, inputs: torch.Tensor, row: int, tokens: list[int], prompt: list[int]) -> float:
    """Sum of the model's log-probs of ``tokens`` after ``prompt`` (LM) or BOS (seq2seq), by a
    full forward pass: the independent reference for returned scores."""
    with torch.no_grad():
        if isinstance(model, EncoderDecoder):
            src = inputs[row : row + 1]
            tgt = torch.tensor([[BOS] + tokens[:-1]])
            logp = model(src, tgt).log_softmax(-1)[0]  # (T, V)
            return float(sum(logp[t, tok] for t, tok in enumerate(tokens)))
        seq = torch.tensor([prompt + tokens])
        logp = model(seq).log_softmax(-1)[0]
        return float(sum(logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(tokens)))


def unpad(tokens: torch.Tensor) -> list[int]:
    """Tokens up to and including the first EOS."""
    out = []
    for t in tokens.tolist():
        out.append(t)
        if t == EOS:
            break
    return out


# ----------------------------------------------------------------------------- cache equivalence


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_cached_equals_uncached(kind, strategy):
    model, inputs = model_and_inputs(kind)
    fast = generate(model, inputs, cfg(strategy=strategy, use_cache=True))
    slow = generate(model, inputs, cfg(strategy=strategy, use_cache=False))
    assert torch.equal(fast.tokens, slow.tokens)
    assert torch.equal(fast.lengths, slow.lengths)
    assert torch.allclose(fast.scores, slow.scores, atol=1e-5)
    if strategy == "beam":
        assert torch.equal(fast.beam_tokens, slow.beam_tokens)
        assert torch.allclose(fast.beam_scores, slow.beam_scores, atol=1e-5)


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_seq2seq_encodes_once_and_projects_memory_once(strategy):
    model, src = model_and_inputs("seq2seq")
    calls = {"encode": 0, "k_proj": 0}
    encode = model.encode

    def counting_encode(*args, **kwargs):
        calls["encode"] += 1
        return encode(*args, **kwargs)

    def count_k_proj(module, args, output):
        calls["k_proj"] += 1

    model.encode = counting_encode
    model.decoder.layers[0].cross_attn.k_proj.register_forward_hook(count_k_proj)
    out = generate(model, src, cfg(strategy=strategy, eos_id=None))
    assert out.tokens.shape[1] == 10  # ten decoder steps ...
    assert calls == {"encode": 1, "k_proj": 1}  # ... one encoder pass, one cross-attention k/v projection


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_sampling_cached_equals_uncached(kind):
    model, inputs = model_and_inputs(kind)
    fast = generate(model, inputs, cfg(strategy="sample", seed=7, top_k=5, use_cache=True))
    slow = generate(model, inputs, cfg(strategy="sample", seed=7, top_k=5, use_cache=False))
    assert torch.equal(fast.tokens, slow.tokens)


# ----------------------------------------------------------------------------- beam search


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_beam_size_one_equals_greedy(kind):
    model, inputs = model_and_inputs(kind)
    greedy = greedy_decode(model, inputs, max_len=10, eos_id=EOS, bos_id=BOS, length_penalty=0.0)
    beam = beam_search(model, inputs, beam_size=1, length_penalty=0.0, max_len=10, eos_id=EOS, bos_id=BOS)
    assert torch.equal(beam.tokens, greedy.tokens)
    assert torch.allclose(beam.scores, greedy.scores, atol=1e-5)


def bigram_lm(probs: torch.Tensor) -> DecoderOnlyLM:
    """A real DecoderOnlyLM whose next-token distribution depends only on the current token:
    ``probs[i]`` after token i. Attention and MLP branches are zeroed (residual stream = the
    token embedding; rotary positions add nothing to it) and ``lm_head`` is solved so that
    ``lm_head(norm(embedding_i)) = log(probs[i])``."""
    n = probs.shape[0]
    lm = DecoderOnlyLM(lm_cfg(4 * n, 1, 2, pos_encoding="rotary", tie_embeddings=False), n, pad_id=PAD).eval()
    with torch.no_grad():
        for p in lm.decoder.layers.parameters():
            p.zero_()
        lm.tok_embed.weight.copy_(torch.eye(n, 4 * n))
        h = lm.decoder.norm(lm.tok_embed.weight)  # (n, D), rank n
        lm.lm_head.weight.copy_((torch.linalg.pinv(h) @ probs.log()).T)
    return lm


def hand_probs() -> torch.Tensor:
    """Tokens: 0 PAD, 1 BOS, 2 EOS, 3 A, 4 B, 5 C, 6 D, 7 E. Greedy takes A (0.5) but every
    continuation of A is unlikely (<= 0.32); B (0.4) is followed by EOS with 0.9."""
    p = torch.full((8, 8), 1e-3)
    p[BOS, 3], p[BOS, 4] = 0.5, 0.4
    p[3, 5], p[3, 6], p[3, 7] = 0.32, 0.3, 0.28
    p[4, EOS] = p[5, EOS] = p[6, EOS] = p[7, EOS] = 0.9
    return p / p.sum(dim=1, keepdim=True)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_beats_greedy_on_hand_set_lm(alpha, use_cache):
    probs = hand_probs()
    lm = bigram_lm(probs)
    prompt = torch.tensor([[BOS]])
    logits = lm(torch.tensor([[BOS, 3, 4, 5]]))[0]
    assert torch.allclose(logits.log_softmax(-1), probs[[BOS, 3, 4, 5]].log(), atol=1e-4)  # the hand model works

    opts = dict(max_len=6, eos_id=EOS, pad_id=PAD, length_penalty=alpha, use_cache=use_cache)
    greedy = greedy_decode(lm, prompt, **opts)
    beam = beam_search(lm, prompt, beam_size=2, **opts)
    assert greedy.tokens.tolist() == [[3, 5, EOS]]
    assert beam.tokens.tolist() == [[4, EOS, PAD]]
    lp = probs.log()
    greedy_expected = float(lp[BOS, 3] + lp[3, 5] + lp[5, EOS]) / 3**alpha
    beam_expected = float(lp[BOS, 4] + lp[4, EOS]) / 2**alpha
    assert math.isclose(float(greedy.scores[0]), greedy_expected, abs_tol=1e-4)
    assert math.isclose(float(beam.scores[0]), beam_expected, abs_tol=1e-4)
    assert float(beam.scores[0]) > float(greedy.scores[0])
    assert beam.beam_tokens[0, 1].tolist() == [3, 5, EOS]  # the runner-up is greedy's answer


def test_length_penalty_and_exact_stopping_rule():
    """Tokens: 0 PAD, 1 BOS, 2 EOS, 3 A, 4 B, 5 C, 6 D, 7 F, 8 G. Finished early: [B, EOS]
    (log 0.36) and [A, D, EOS] (log 0.18). The open beam A C F (log 0.173) is already worse
    per token than both, but with alpha = 1 its near-certain continuation to [A, C, F, G, EOS]
    scores best: the search must not stop when K hypotheses are finished."""
    p = torch.full((9, 9), 1e-4)
    p[BOS, 3], p[BOS, 4] = 0.5, 0.4
    p[3, 6], p[3, 5] = 0.4, 0.35
    p[4, EOS] = p[6, EOS] = 0.9
    p[5, 7] = p[7, 8] = p[8, EOS] = 0.99
    probs = p / p.sum(dim=1, keepdim=True)
    lm, prompt = bigram_lm(probs), torch.tensor([[BOS]])
    opts = dict(max_len=8, eos_id=EOS, pad_id=PAD)
    assert greedy_decode(lm, prompt, **opts).tokens.tolist() == [[3, 6, EOS]]
    short = beam_search(lm, prompt, beam_size=2, length_penalty=0.0, **opts)
    assert unpad(short.tokens[0]) == [4, EOS]
    long = beam_search(lm, prompt, beam_size=2, length_penalty=1.0, **opts)
    assert unpad(long.tokens[0]) == [3, 5, 7, 8, EOS] and unpad(long.beam_tokens[0, 1]) == [4, EOS]
    lp = probs.log()
    expected = float(lp[BOS, 3] + lp[3, 5] + lp[5, 7] + lp[7, 8] + lp[8, EOS]) / 5
    assert math.isclose(float(long.scores[0]), expected, abs_tol=1e-4)


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_scores_equal_recomputed_log_probs(kind, alpha):
    model, inputs = model_and_inputs(kind)
    prompts = lm_prompts()[1]
    out = beam_search(model, inputs, beam_size=3, length_penalty=alpha, max_len=8, eos_id=EOS, bos_id=BOS)
    scores = out.beam_scores.tolist()
    assert all(a >= b for row in scores for a, b in zip(row, row[1:]))  # best first
    for b in range(inputs.shape[0]):
        for k in range(3):
            toks = unpad(out.beam_tokens[b, k])
            expected = sequence_log_probs(model, inputs, b, toks, prompts[b]) / len(toks) ** alpha
            assert math.isclose(scores[b][k], expected, abs_tol=1e-4), (b, k)


# ----------------------------------------------------------------------------- EOS, PAD, lengths


@pytest.mark.parametrize("strategy", ["greedy", "beam", "sample"])
@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_pad_after_eos_and_max_len(strategy, kind):
    model, inputs = model_and_inputs(kind)
    with torch.no_grad():  # make EOS likely, so some rows end early and others run to max_len
        model.lm_head.weight[EOS] *= 2.0 if kind == "lm" else 2.5
    out = generate(model, inputs, cfg(strategy=strategy, max_len=7, seed=0))
    assert out.tokens.shape[1] <= 7
    ended = 0
    for row, length in zip(out.tokens.tolist(), out.lengths.tolist()):
        if EOS in row:
            ended += 1
            assert length == row.index(EOS) + 1
        else:
            assert length == 7
        assert PAD not in row[:length] and all(t == PAD for t in row[length:])
    assert 0 < ended < len(out.tokens)  # both cases were exercised


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_min_len_and_no_eos(strategy):
    model, inputs = model_and_inputs("lm")
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 3.0
    out = generate(model, inputs, cfg(strategy=strategy, max_len=7, min_len=5))
    assert all(EOS not in row[:4] for row in out.tokens.tolist())
    assert bool((out.lengths >= 5).all())
    out = generate(model, inputs, cfg(strategy=strategy, max_len=7, eos_id=None))
    assert out.tokens.shape == (4, 7) and bool((out.lengths == 7).all())


# ----------------------------------------------------------------------------- sampling


def test_top_p_filter_hand_distribution():
    probs = torch.tensor([0.125, 0.5, 0.05, 0.25, 0.075])  # sorted: 0.5, 0.25, 0.125, 0.075, 0.05
    logits = probs.log()
    kept = lambda p: set(torch.isfinite(top_p_filter(logits, p)).nonzero().flatten().tolist())  # noqa: E731
    assert kept(0.3) == {1}  # 0.5 already >= 0.3
    assert kept(0.5) == {1}
    assert kept(0.74) == {1, 3}  # 0.75 >= 0.74
    assert kept(0.76) == {1, 3, 0}  # 0.875 >= 0.76
    assert kept(0.94) == {1, 3, 0, 4}  # 0.95 >= 0.94
    assert kept(0.96) == {1, 3, 0, 4, 2}
    assert kept(1.0) == set(range(5))
    kept_logits = top_p_filter(logits, 0.74)
    assert torch.equal(kept_logits[[1, 3]], logits[[1, 3]])  # survivors unchanged


def test_top_k_filter():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0], [5.0, 4.0, 3.0, 2.0]])
    out = top_k_filter(logits, 2)
    assert torch.isfinite(out).tolist() == [[False, True, False, True], [True, True, False, False]]
    assert torch.equal(top_k_filter(logits, 0), logits)


def test_sample_next_distribution_and_temperature():
    gen = torch.Generator().manual_seed(0)
    logp = torch.tensor([[0.6, 0.3, 0.1]]).log().expand(20000, 3)
    freq = torch.bincount(sample_next(logp, generator=gen), minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.015)
    freq = torch.bincount(sample_next(logp, top_p=0.8, generator=gen), minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([2 / 3, 1 / 3, 0.0]), atol=0.015)  # renormalised nucleus
    assert bool((sample_next(logp, temperature=0.0) == 0).all())  # temperature 0 = argmax
    assert bool((sample_next(logp, temperature=1e-3, generator=gen) == 0).all())  # its limit


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_sampling_limits_equal_greedy(kind):
    model, inputs = model_and_inputs(kind)
    greedy = greedy_decode(model, inputs, max_len=10, eos_id=EOS, bos_id=BOS)
    for opts in (dict(top_k=1, temperature=1.5), dict(temperature=0.0), dict(temperature=1e-4)):
        out = sample(model, inputs, max_len=10, eos_id=EOS, bos_id=BOS, seed=3, **opts)
        assert torch.equal(out.tokens, greedy.tokens), opts


def test_sampling_reproducible():
    model, inputs = model_and_inputs("lm")
    opts = dict(max_len=12, eos_id=EOS, temperature=1.5)
    a = sample(model, inputs, seed=3, **opts)
    b = sample(model, inputs, generator=torch.Generator().manual_seed(3), **opts)
    c = sample(model, inputs, seed=4, **opts)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)
    torch.manual_seed(5)
    d = sample(model, inputs, **opts)  # no seed: torch's global RNG
    torch.manual_seed(5)
    assert torch.equal(d.tokens, sample(model, inputs, **opts).tokens)


# ----------------------------------------------------------------------------- padding


@pytest.mark.parametrize("pos_encoding", ["learned", "rotary"])
@pytest.mark.parametrize("strategy", ["greedy", "beam"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_padded_prompts_equal_unpadded(pos_encoding, strategy, use_cache):
    lm = make_lm(pos_encoding)
    batch, rows = lm_prompts()
    opts = cfg(strategy=strategy, use_cache=use_cache)
    out = generate(lm, batch, opts)
    for i, row in enumerate(rows):
        alone = generate(lm, torch.tensor([row]), opts)
        assert unpad(out.tokens[i]) == unpad(alone.tokens[0]), i
        assert math.isclose(float(out.scores[i]), float(alone.scores[0]), abs_tol=1e-5)
    # explicit lengths give the same result whatever the padding holds
    junk = batch.masked_fill(batch.eq(PAD), 9)
    lengths = torch.tensor([len(r) for r in rows])
    assert torch.equal(generate(lm, junk, opts, prompt_lengths=lengths).tokens, out.tokens)


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_padded_sources_equal_unpadded(strategy):
    model = make_seq2seq()
    batch, rows = sources()
    out = generate(model, batch, cfg(strategy=strategy))
    for i, row in enumerate(rows):
        alone = generate(model, torch.tensor([row]), cfg(strategy=strategy))
        assert unpad(out.tokens[i]) == unpad(alone.tokens[0]), i
        assert math.isclose(float(out.scores[i]), float(alone.scores[0]), abs_tol=1e-5)


# ----------------------------------------------------------------------------- config and errors


def test_config_from_recipe_section():
    errors: list[str] = []
    parsed = build_dataclass(GenerationConfig, {"strategy": "beam", "beam_size": 5, "eos_id": 2}, "generate", errors)
    assert errors == [] and parsed.strategy == "beam" and parsed.beam_size == 5 and parsed.top_p == 1.0
    build_dataclass(GenerationConfig, {"strategy": "nucleus"}, "generate", errors)
    assert errors and "strategy" in errors[0]


def test_errors():
    lm, prompts = model_and_inputs("lm")
    with pytest.raises(TkError, match=r"generate.top_p \(1.5\) must be in \(0, 1\]"):
        generate(lm, prompts, cfg(top_p=1.5))
    with pytest.raises(TkError, match=r"min_len \(9\) must be in \[0, max_len \(4\)\]"):
        generate(lm, prompts, cfg(max_len=4, min_len=9))
    with pytest.raises(ValueError, match="right-padded"):
        generate(lm, torch.tensor([[PAD, 5, 6]]), cfg())
    with pytest.raises(ValueError, match="at least one token"):
        generate(lm, torch.tensor([[PAD, PAD]]), cfg())
    with pytest.raises(ValueError, match="eval mode"):
        generate(lm.train(), prompts, cfg())
    lm_no_pad = DecoderOnlyLM(lm_cfg(16, 1, 2), V).eval()
    with pytest.raises(TkError, match="needs a pad_id"):
        generate(lm_no_pad, prompts, cfg(pad_id=None))
    with pytest.raises(TkError, match="bos_id"):
        generate(make_seq2seq(), sources()[0], cfg(bos_id=None))
    with pytest.raises(TypeError, match="cannot generate"):
        generate(torch.nn.Linear(2, 2).eval(), prompts, cfg())


@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal", "rotary"])
def test_left_padded_prompt_continues_like_the_unpadded_one(pos_encoding):
    """With a key_padding_mask, absolute positions count real tokens only: a left-padded row
    (prefill and later cached steps) gives the logits of the row alone, in a batch with an
    unpadded row, and the uncached forward agrees."""
    lm = make_lm(pos_encoding)
    short, full = [5, 6, 7], [9, 8, 7, 6, 5]
    batch = torch.tensor([[PAD, PAD] + short, full])
    mask = batch.eq(PAD)
    steps = torch.tensor([[11, 12], [13, 14]])  # two later tokens per row
    with torch.no_grad():
        cache = lm.init_cache(2, 8)
        got = [lm.decode_step(batch, cache, key_padding_mask=mask)[:, -1]]
        for t in range(2):
            mask = torch.cat([mask, torch.zeros(2, 1, dtype=torch.bool)], dim=1)
            got.append(lm.decode_step(steps[:, t : t + 1], cache, key_padding_mask=mask)[:, -1])
        whole = lm(torch.cat([batch, steps], dim=1), mask)[:, -3:]  # uncached, same mask
        for row, prompt in enumerate((short, full)):
            alone = lm(torch.tensor([prompt + steps[row].tolist()]))[0, -3:]  # no padding at all
            for t in range(3):
                assert torch.allclose(got[t][row], alone[t], atol=1e-5), (pos_encoding, row, t)
            assert torch.allclose(whole[row], alone, atol=1e-5)


def test_explicit_pos_offset_overrides_the_mask():
    lm = make_lm("learned")
    tokens, no_pad = torch.tensor([[5, 6]]), torch.zeros(1, 2, dtype=torch.bool)
    with torch.no_grad():
        at3 = lm.decode_step(tokens, lm.init_cache(1, 4), pos_offset=3)
        at3_masked = lm.decode_step(tokens, lm.init_cache(1, 4), pos_offset=3, key_padding_mask=no_pad)
        derived = lm.decode_step(tokens, lm.init_cache(1, 4), key_padding_mask=no_pad)  # positions 0, 1
    assert torch.allclose(at3, at3_masked, atol=1e-6)
    assert not torch.allclose(at3, derived, atol=1e-3)


@pytest.mark.slow
def test_compiled_decode_step_gives_the_same_tokens():
    import shutil

    if not torch._dynamo.is_dynamo_supported() or shutil.which("g++") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile is not available here (dynamo unsupported or no C++ compiler)")
    model, inputs = model_and_inputs("lm")
    eager = generate(model, inputs, cfg(max_len=8))
    try:
        compiled = generate(model, inputs, cfg(max_len=8, compile=True))
    except Exception as e:  # a broken toolchain is an environment problem, not a tk bug
        if "compile" in type(e).__module__ or "Inductor" in type(e).__name__ or "Backend" in type(e).__name__:
            pytest.skip(f"torch.compile failed here: {type(e).__name__}")
        raise
    assert torch.equal(eager.tokens, compiled.tokens)
    assert torch.equal(eager.lengths, compiled.lengths)
    torch.testing.assert_close(eager.scores, compiled.scores, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_outputs_and_grown_rotary_tables_train_afterwards(strategy):
    """generate() runs under inference_mode, whose tensors cannot be saved for backward: its
    outputs, and the rotary tables it grew past anything seen in training, must still train."""
    model = make_lm("rotary")
    rotary = model.decoder.layers[0].self_attn.rotary
    assert rotary._cos.shape[0] == 0  # nothing run yet: generation grows the tables
    out = generate(model, torch.tensor([[5, 9, 3]]), cfg(strategy=strategy, max_len=40, eos_id=None, pad_id=PAD))
    assert rotary._cos.shape[0] >= 43 and not rotary._cos.is_inference()
    assert not any(t.is_inference() for t in (out.tokens, out.scores, out.log_probs, out.lengths))
    model.train()
    loss = model(out.tokens).float().logsumexp(-1).mean() + out.scores.sum() * 0  # the tokens feed training
    loss.backward()
    assert model.tok_embed.weight.grad is not None


@pytest.mark.parametrize("strategy", ["greedy", "beam", "sample"])
@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_int32_inputs_give_the_long_input_tokens(kind, strategy):
    model, inputs = model_and_inputs(kind)
    options = cfg(strategy=strategy, seed=3, max_len=6)
    assert torch.equal(generate(model, inputs.int(), options).tokens, generate(model, inputs, options).tokens)


def test_on_step_gets_ordinary_tensors_it_may_keep():
    model, inputs = model_and_inputs("lm")
    kept = []
    out = generate(model, inputs[:1, :3], cfg(max_len=5, eos_id=None), on_step=lambda i, t: kept.append(t))
    assert not any(t.is_inference() for t in kept)
    kept[0].add_(1)  # changing a kept tensor afterwards is allowed (and does not touch the output)
    assert torch.equal(torch.stack(kept[1:], 1), out.tokens[:, 1:])
