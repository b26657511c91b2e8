"""tk.core.nn.packing: packed rows compute what padded rows compute (issue #36 item 4)."""

from __future__ import annotations

import pytest
import torch

from tk.core.nn.config import TransformerConfig
from tk.core.nn.packing import pack_sequences, pool_segments, segment_attention_mask, segment_positions
from tk.core.nn.text_encoder import TextEncoder, pool

SEQS = [[5, 6, 7], [8, 9], [3] * 6, [4], [2, 2, 2, 2]]


def test_pack_layout_positions_and_mask():
    p = pack_sequences(SEQS, row_len=6, pad_id=0, types=[[0] * min(2, len(s)) + [1] * max(0, len(s) - 2) for s in SEQS])
    assert p.ids.tolist() == [[5, 6, 7, 8, 9, 0], [3, 3, 3, 3, 3, 3], [4, 2, 2, 2, 2, 0]]
    assert p.segments.tolist() == [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1], [1, 2, 2, 2, 2, 0]]
    assert p.types.tolist()[0] == [0, 0, 1, 0, 0, 0] and p.num_sequences == 5
    assert segment_positions(p.segments).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 3, 0]]
    mask = segment_attention_mask(p.segments)
    assert not mask[0, 3, 4] and mask[0, 3, 2] and mask[0, 0, 5]  # within / across sequences / no padding
    assert mask[0, 5].tolist() == [True] * 5 + [False]  # padding sees only itself (no all-masked row)
    with pytest.raises(ValueError, match="sequence 1 has 7 tokens"):
        pack_sequences([[1], [1] * 7], row_len=6, pad_id=0)


@pytest.mark.parametrize("how", ["cls", "mean", "max"])
def test_pool_segments_equals_pool_of_each_padded_sequence(how):
    torch.manual_seed(0)
    p = pack_sequences(SEQS, row_len=6, pad_id=0)
    hidden = torch.randn(*p.ids.shape, 4)
    pooled = pool_segments(hidden, p.segments, how)
    assert pooled.shape == (5, 4)
    n = 0
    for r in range(p.ids.shape[0]):
        for k in range(1, int(p.segments[r].max()) + 1):
            part = hidden[r][p.segments[r] == k].unsqueeze(0)
            torch.testing.assert_close(pooled[n], pool(part, None, how)[0])
            n += 1


@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "rotary", "none"])
def test_a_packed_batch_gives_each_sequence_its_padded_states(pos):
    torch.manual_seed(0)
    enc = TextEncoder(TransformerConfig(dim=32, depth=2, num_heads=4, dropout=0.0, max_len=16, pos_encoding=pos),
                      50, type_vocab_size=2, pad_id=0).eval()
    seqs = [torch.randint(1, 50, (n,)).tolist() for n in (5, 9, 3, 12, 7, 1, 16)]
    types = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in seqs]
    p = pack_sequences(seqs, 16, 0, types=types)
    assert p.ids.shape[0] < len(seqs)
    packed = enc(p.ids, p.types, segments=p.segments)
    n = 0
    for r in range(p.ids.shape[0]):
        for k in range(1, int(p.segments[r].max()) + 1):
            alone = enc(torch.tensor([seqs[n]]), torch.tensor([types[n]]))[0]
            torch.testing.assert_close(packed[r][p.segments[r] == k], alone, atol=1e-5, rtol=1e-5)
            n += 1


# ----------------------------------------------------------------------------- packed decoder rows
@pytest.mark.parametrize("options", [
    {"pos_encoding": "rotary", "num_kv_heads": 2, "activation": "swiglu", "norm": "rmsnorm"},
    {"pos_encoding": "learned"},
    {"pos_encoding": "rotary", "sliding_window": 4},
])
def test_a_packed_decoder_row_gives_each_document_its_logits_alone(options):
    """Block-causal mask + positions restarting: no document sees another (TRL's packing under SDPA
    lets them attend to each other), and learned/rotary positions are those of the document alone."""
    from tk.core.nn.lm import DecoderOnlyLM

    torch.manual_seed(0)
    model = DecoderOnlyLM(TransformerConfig(dim=32, depth=2, num_heads=4, max_len=32, **options), 50).eval()
    docs = [torch.randint(1, 50, (n,)) for n in (5, 9, 3)]
    row = torch.cat([*docs, torch.zeros(4, dtype=torch.long)])[None]  # 17 tokens + 4 of padding
    segments = torch.cat([torch.full((len(d),), k) for k, d in enumerate(docs, 1)] + [torch.zeros(4)]).long()[None]
    with torch.no_grad():
        packed = model(row, segments=segments)[0, :17]
        alone = torch.cat([model(d[None])[0] for d in docs])
        unmasked = model(row)[0, :17]
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    assert (unmasked - alone).abs().max() > 1e-2  # without segments the documents do see each other


def test_segment_attention_mask_causal_is_block_causal():
    segments = torch.tensor([[1, 1, 2, 2, 0]])
    allowed = ~segment_attention_mask(segments, causal=True)[0]
    assert allowed.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]
