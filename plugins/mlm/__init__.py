"""Masked-LM pretraining plugin: BERT's masked-token objective on the core TextEncoder."""

from tk.plugins.mlm.task import MLMTask

__all__ = ["MLMTask"]
