"""Sequence labelling with BIO tags for tk: an external task plugin (see README.md)."""

from tk_token_tagging.task import TokenTaggingTask

__all__ = ["TokenTaggingTask"]
