"""Translation metrics: sacreBLEU corpus BLEU and chrF of detokenised output (perplexity is
:class:`tk.core.text.Perplexity`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import sacrebleu

from tk.core.media import Text
from tk.core.metrics import Metric
from tk.core.step import EvalContext, StepOutput


class CorpusBleu(Metric):
    """sacreBLEU corpus BLEU (13a tokenisation) and chrF of ``out.outputs["hyps"]``, a list of
    ``(example id, detokenised hypothesis)``, against ``refs[id]`` (the raw target lines).

    ``write`` saves the hypotheses in dataset order and the metric signatures; ``media``
    gives the first few (source, reference, hypothesis) triples to the run's loggers.
    """

    num_media: int = 5  # translations shown per evaluation in TensorBoard / W&B / media/

    def __init__(self, refs: list[str], sources: list[str]) -> None:
        super().__init__()
        self.refs, self.sources = refs, sources
        self.add_state("hyps", [], reduce="objects")
        self.signatures: dict[str, str] = {}  # the sacreBLEU signatures of the last compute

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        self.extend("hyps", out.outputs["hyps"])

    def keys(self) -> list[str]:
        return ["bleu", "chrf"]

    def compute(self) -> dict[str, float]:
        hyps, refs = [h for _, h in self.hyps], [[self.refs[i] for i, _ in self.hyps]]
        bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
        scores = {"bleu": bleu.corpus_score(hyps, refs).score, "chrf": chrf.corpus_score(hyps, refs).score}
        self.signatures = {"bleu": str(bleu.get_signature()), "chrf": str(chrf.get_signature())}
        return scores

    def media(self, ctx: EvalContext) -> list[Text]:
        """The first ``num_media`` translations (in dataset order) as one text item."""
        shown = sorted(self.hyps)[: self.num_media]
        lines = [f"src: {self.sources[i]}\nref: {self.refs[i]}\nhyp: {h}\n" for i, h in shown
                 if i < len(self.refs) and i < len(self.sources)]
        return [Text(f"{ctx.key_prefix}/translations", "\n".join(lines))] if lines else []

    def write(self, out_dir: Path, ctx: EvalContext) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        name = f"{ctx.key_prefix}_step{ctx.step}"
        (out_dir / f"{name}.hyp.txt").write_text("".join(h + "\n" for _, h in self.hyps), encoding="utf-8")
        (out_dir / f"{name}.sacrebleu.json").write_text(json.dumps(self.signatures, indent=1), encoding="utf-8")
        print(f"sacreBLEU signatures: {self.signatures}", file=sys.stderr, flush=True)
