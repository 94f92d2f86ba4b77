"""The run: its folder (:mod:`~obow.training.run.state`: the config, checkpoints at step boundaries, signals, exact
resume, extending a run; :mod:`~obow.training.run.lock`: one writer per folder; :mod:`~obow.training.run.logger`:
JSON lines, TensorBoard, the progress bar) and its settled settings (:mod:`~obow.training.run.settle`: the ``auto``
settings resolved once, a resumed run keeping what it started with; :mod:`~obow.training.run.threads`: threads per
process; :mod:`~obow.training.run.precision`: ``train.precision`` and autocast).

The bottom of :mod:`obow.training`: it imports nothing from the step (:mod:`obow.training.step`) or the loop.
"""
