"""Model summaries: parameter counts, measured activation memory, per-module output shapes."""

import torch
from torch import nn

from tk.core.engine.summary import ActivationMeter, format_shapes, module_output_shapes
from tk.core.run.runlog import count_parameters, format_bytes


def test_count_parameters_counts_shared_weights_once_and_frozen_ones_apart():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    model = nn.Sequential(emb, nn.Linear(4, 4), head)
    model[1].bias.requires_grad_(False)
    assert count_parameters(model) == (40 + 16 + 4, 40 + 16)


def test_activation_meter_counts_saved_tensors_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with ActivationMeter(model) as meter:
        model(x).sum().backward()
    # Linear 1 saves its input x (5x8), ReLU its output (5x16), which Linear 2 saves
    # again (same storage, counted once); weights are parameters, not activations.
    assert meter.bytes == 4 * (5 * 8 + 5 * 16)


def test_module_output_shapes_in_definition_order_and_table():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    rows = module_output_shapes(model, lambda: model(torch.randn(5, 8)))
    assert [(r["name"], r["shape"], r["params"]) for r in rows] == [
        ("(Sequential)", "(5, 4)", 0), ("0", "(5, 16)", 144), ("1", "(5, 16)", 0), ("2", "(5, 4)", 0),
        ("2.0", "(5, 4)", 68)]
    table = format_shapes(rows).splitlines()
    assert table[0].split() == ["module", "type", "params", "output", "shape"]
    assert table[-1].split() == ["2.0", "Linear", "68", "(5,", "4)"] and table[-1].startswith("    2.0")


def test_shapes_of_tuple_and_dict_outputs_and_byte_formatting():
    class Two(nn.Module):
        def forward(self, x):
            return x, {"logits": x[:, :2]}

    model = Two()
    rows = module_output_shapes(model, lambda: model(torch.zeros(3, 5)))
    assert rows[0]["shape"] == "((3, 5), {logits: (3, 2)})"
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB" and format_bytes(3 * 2**30) == "3.0 GiB"
