"""The parts the training loop (``tk.core.engine.train``) is made of.

- ``assemble``: the one order in which every command builds task, data and model;
  ``build``: the loaders, batch stream, teacher and DDP wrapper a config asks for;
  ``batches``: the resumable stream of training batches.
- ``update``: the gradient arithmetic of one optimizer update; ``precision``: autocast and
  fp16 loss scaling; ``parallel``: DDP and FSDP2 wrapping, sharded state, gradient sync.
- ``ema``, ``best`` (best metric, early stopping), ``progress`` (counters, evaluation
  cadence), ``evaluate`` (one split's loss and metrics), ``device`` (device choice, checks
  before a run, seeding, activation checkpointing), ``signals`` (SIGINT/SIGTERM).

May import: ``tk.core.run`` and the base layers. Never ``tk.core.engine``,
``tk.core.exchange`` or ``tk.core.cli``.
"""
