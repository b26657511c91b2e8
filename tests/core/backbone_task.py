"""A toy tagger whose model keeps a backbone under ``encoder.`` and declares it as the seed of
``model.pretrained_from`` in one line (``Task.pretrained_backbone``): the engine does the rest."""

from dataclasses import dataclass

from torch import nn

from tk.core.exchange.backbone import PretrainedBackbone
from tests.core.toy_text import ToyTextTask


@dataclass
class BackboneModel:
    hidden: int = 32  # hidden width (the backbone's shape: a source run decides it)
    dropout: float = 0.1  # dropout after the embedding
    pretrained_from: str | None = None  # a toy_backbone run to start from


class Tagger(nn.Module):
    def __init__(self, vocab: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Embedding(vocab, hidden), nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(tokens))


class BackboneTask(ToyTextTask):
    name = "toy_backbone"
    ModelConfig = BackboneModel
    pretrained_backbone = PretrainedBackbone(prefix="encoder.", files=("vocab.txt",), shape_keys=("hidden",))

    def setup(self, resume=False):
        if self.run_dir is not None and not self.files.exists("vocab.txt"):  # a source's copy is kept
            self.files.write_text("vocab.txt", f"{self.model_cfg.hidden} ids of a run\n")

    def build_model(self):
        return Tagger(self.data.vocab_size, self.model_cfg.hidden, self.model_cfg.dropout)
