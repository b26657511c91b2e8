"""Language-model plugin: a decoder-only Transformer (GPT) on text or a synthetic grammar; ``tk generate``."""

from tk.plugins.language_model.task import LanguageModelTask

__all__ = ["LanguageModelTask"]
