"""The run, a module a concern: where it stands (:mod:`~obow.training.run.state`); its folder
(:mod:`~obow.training.run.folder`: ``config.yaml``, the checkpoint found, what a killed process left); the checks of
a resumed run against its checkpoint (:mod:`~obow.training.run.settings_check`, :mod:`~obow.training.run.data_check`);
saving and restoring (:mod:`~obow.training.run.checkpoints`: exact resume, extending a run); every process's random
states (:mod:`~obow.training.run.random_states`); the signals that stop it at a step boundary
(:mod:`~obow.training.run.signals`); one writer per folder (:mod:`~obow.training.run.lock`); its logs
(:mod:`~obow.training.run.logger`: JSON lines, TensorBoard, the progress bar); what stops or warns of a run gone
wrong (:mod:`~obow.training.run.guards`); and its settled settings (:mod:`~obow.training.run.settle`: the ``auto``
settings resolved once, a resumed run keeping what it started with; :mod:`~obow.training.run.threads`: threads per
process; :mod:`~obow.training.run.precision`: ``train.precision`` and autocast).

The bottom of :mod:`obow.training`: it imports nothing from the step (:mod:`obow.training.step`) or the loop.
"""
