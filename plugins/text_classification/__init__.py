"""Text classification plugin: BERT-style encoder (from scratch or fine-tuned BERT/MiniLM) on text files or synthetic text."""

from tk.plugins.text_classification.task import TextClassificationTask

__all__ = ["TextClassificationTask"]
