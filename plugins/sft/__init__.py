"""Supervised fine-tuning on instructions and conversations: the loss on what the model should say."""

from tk.plugins.sft.task import SFTTask

__all__ = ["SFTTask"]
