"""Translation plugin: Transformer encoder-decoder on parallel text, subword tokenizers, sacreBLEU."""

from tk.plugins.translation.task import TranslationTask

__all__ = ["TranslationTask"]
