"""Models in and out of tk: pretrained sources, export formats and weight mappings.

- ``pretrained``: a finished tk run as the source of a new run (``model.pretrained_from``);
  ``convert_bert``: a Hugging Face BERT-family folder as the core ``TextEncoder``.
- ``export``: safetensors files and checkpoint averaging; ``export_hf``: a core model as a
  ``transformers`` folder; ``export_timm``: a ViT as timm weights; ``export_graph``:
  ``torch.export`` programs and ONNX.

(timm ViT weights *into* the core ViT: ``tk.core.nn.vit.convert_timm_vit_state_dict``,
beside the model whose names it maps.)

May import: ``tk.core.run`` (checkpoints, atomic writes) and the base layers. Never
``tk.core.training``, ``tk.core.engine`` or ``tk.core.cli``.
"""
