"""Runs, from start to use: the top of core, below only the command line.

- ``train``: the :class:`Trainer`, the one loop every task runs through;
  ``trainer_state``: what a trainer's checkpoint holds and how a resume restores it.
- ``launch``: starting a run (run dir checks, torch.distributed from torchrun's
  environment, multi-process launch).
- ``inference``: the finished-run API (``load_run``, ``evaluate_run``, ``predict_run``,
  ``average_run``, and the pretrained-source helpers): the one engine module plugins import.
- ``predict``: batched prediction for ``tk predict``; ``summary``: ``tk summary``;
  ``export_run``: ``tk export`` (a run's model in another format, with its model card).

May import: ``tk.core.training``, ``tk.core.run``, ``tk.core.exchange`` and the base
layers (``nn``, ``data``, ``text``, the task contract, config). Never ``tk.core.cli``.
"""
