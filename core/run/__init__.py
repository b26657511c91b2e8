"""The run folder: what a run writes to disk and reads back.

- ``run_dir``: the ``.tk-run`` marker, the checks before anything is written, the lock a
  training run holds, ``--overwrite``'s set-aside copy, ``--resume auto``.
- ``checkpoint``: atomic saves, weights-only loads, rotation, model-state matching;
  ``rng``: the RNG states a checkpoint holds; ``shards``: the sharded checkpoints of fsdp
  runs; ``atomic``: files that are either old or complete, never half.
- ``runlog``: ``train.log``, ``metrics.jsonl``, ``status.json``, the progress bar;
  ``loggers``: jsonl/csv/tensorboard/wandb; ``curves``: ``curves.png`` and ``tk plot``.

May import: the base layers only (``config``, ``errors``, ``media``, ...). Never
``tk.core.training``, ``tk.core.exchange``, ``tk.core.engine`` or ``tk.core.cli``.
"""
