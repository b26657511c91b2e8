"""``tk export``: a finished run's model as safetensors, a transformers or timm model, a
``torch.export`` program or ONNX, with a model card (see docs/export.md)."""

from __future__ import annotations

import json

import click

from tk.core.cli.group import debug_option

FORMATS = ("hf", "peft", "timm", "safetensors", "torch-export", "onnx")  # == tk.core.engine.export_run.FORMATS (not imported: torch)


@click.command("export")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--format", "fmt", required=True, type=click.Choice(FORMATS),
              help="hf: a transformers folder; peft: a LoRA run's adapters as a PEFT folder; timm: weights timm.create_model loads; safetensors: the state "
                   "dict + task files; torch-export: a .pt2 program; onnx: an ONNX graph.")
@click.option("-o", "--output", default=None, type=click.Path(), help="The folder to write  [default: RUN_DIR/export/FORMAT].")
@click.option("--checkpoint", default="best", show_default=True, help="best, last, or a checkpoint path.")
@click.option("--ema/--raw", "ema", default=None,
              help="The EMA or the raw weights  [default: the ones the run selected: EMA when best_metric is val_ema/*]")
@click.option("--overwrite", is_flag=True, help="Replace an existing, non-empty output folder.")
@click.option("--license", "license_", default=None, metavar="ID",
              help="The model card's license (a hub license id such as apache-2.0, mit, cc-by-4.0, other).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@debug_option
def export_cmd(run_dir: str, overrides: tuple[str, ...], fmt: str, output: str | None, checkpoint: str,
               ema: bool | None, overwrite: bool, license_: str | None, as_json: bool) -> None:
    """Export a run's model (the checkpoint and weights `tk eval` would use) with a README.md
    model card: task, data, recipe, metrics of the checkpoint, how to load it.

    \b
    tk export runs/textcls_synthetic --format hf
    tk export runs/quickstart --format timm -o vit_timm
    tk export runs/lm_synthetic --format onnx --checkpoint last
    """
    from tk.core.engine.export_run import export_run

    result = export_run(run_dir, fmt, output, checkpoint, ema, overwrite, list(overrides), license_)
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"wrote {result['output']} ({fmt}: {', '.join(result['files'])}) from "
               f"{result['checkpoint']} (step {result['step']}, {'EMA' if result['ema'] else 'raw'} weights)"
               + (f"; note: {result['note']}" if result.get("note") else ""))
