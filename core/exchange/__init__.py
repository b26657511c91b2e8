"""Models in and out of tk: pretrained sources, export formats and weight mappings.

- ``pretrained``: a finished tk run as the source of a new run (``model.pretrained_from``);
  ``backbone``: ``PretrainedBackbone``, a task's one-line declaration of that key (the engine does the rest);
  ``hf/``: Hugging Face models, one mapping table per family read both ways (``hf/bert``: BERT
  encoders into the core ``TextEncoder``; ``hf/gpt2``, ``hf/llama``, ``hf/phi3``, ``hf/gemma``:
  decoders into ``DecoderOnlyLM`` and back; ``hf/marian``, ``hf/seq2seq``: Marian and M2M100/NLLB
  translators into ``EncoderDecoder`` and back; ``hf/folder``: config, sharded safetensors).
- ``export``: safetensors files and checkpoint averaging; ``export_hf``: a core model as a
  ``transformers`` folder; ``export_timm``: a ViT as timm weights; ``export_graph``:
  ``torch.export`` programs and ONNX.

(timm ViT weights *into* the core ViT: ``tk.core.nn.vit.convert_timm_vit_state_dict``,
beside the model whose names it maps.)

May import: ``tk.core.run`` (checkpoints, atomic writes) and the base layers. Never
``tk.core.training``, ``tk.core.engine`` or ``tk.core.cli``.
"""
