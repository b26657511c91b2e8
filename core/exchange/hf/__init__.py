"""Hugging Face ``transformers`` models in and out of tk: one module per model family, each one
table read in both directions (import and export cannot drift), and the folder reader.

- ``folder``: a ``save_pretrained`` folder (or a hub id): ``config.json``, one or sharded
  safetensors read tensor by tensor, the tokenizer and generation files.
- ``table``: the mapping machinery a family declares (config keys, tensor names, fusions).
- ``gpt2``, ``llama`` (Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5, Qwen3), ``phi3``, ``gemma``
  (Gemma 1 and 2): the decoder families; ``decoders``: the family of a ``model_type``, the
  meta-device load and the export; ``source``: a decoder folder as a run's ``model.pretrained_from``
  (shape, tokenizer, generation settings, kept task files); ``bert``: BERT-family encoders (into
  ``TextEncoder``).

May import: ``tk.core.run`` and the base layers (as the rest of ``tk.core.exchange``).
"""
