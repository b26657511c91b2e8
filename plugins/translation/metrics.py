"""Translation metrics: sacreBLEU corpus BLEU and chrF of detokenised output (perplexity is
:class:`tk.core.text.Perplexity`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping

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
        self._bleu = self._chrf = None

    def update(self, out: StepOutput, batch: Mapping[str, Any]) -> None:
        self.extend("hyps", out.outputs["hyps"])

    def keys(self) -> list[str]:
        return ["bleu", "chrf"]

    def compute(self) -> dict[str, float]:
        ids = [i for i, _ in self.hyps]
        hyps = [h for _, h in self.hyps]
        refs = [self.refs[i] for i in ids]
        self._bleu, self._chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
        bleu = self._bleu.corpus_score(hyps, [refs])
        chrf = self._chrf.corpus_score(hyps, [refs])
        return {"bleu": bleu.score, "chrf": chrf.score}

    def signatures(self) -> dict[str, str]:
        """The sacreBLEU signatures of the last ``compute``."""
        if self._bleu is None:
            return {}
        return {"bleu": str(self._bleu.get_signature()), "chrf": str(self._chrf.get_signature())}

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
        (out_dir / f"{name}.sacrebleu.json").write_text(json.dumps(self.signatures(), indent=1), encoding="utf-8")
        print(f"sacreBLEU signatures: {self.signatures()}", file=sys.stderr, flush=True)
