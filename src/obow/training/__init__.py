"""``obow pretrain``, in three parts read top to bottom:

* the loop (:mod:`~obow.training.loop`) and the parts it is built from (:mod:`~obow.training.build`: process,
  device, data, method, optimiser);
* the step (:mod:`obow.training.step`): its call and :func:`~obow.training.step.build_step`; the eager, compiled
  and graphed modes, a module each; what they share (:mod:`~obow.training.step.shared`), beneath them; the watch
  over a step that compiles (:mod:`~obow.training.step.watch`);
* the run (:mod:`obow.training.run`), a module a concern: where it stands (:mod:`~obow.training.run.state`), its
  folder (:mod:`~obow.training.run.folder`), the checks of a resumed run (:mod:`~obow.training.run.settings_check`,
  :mod:`~obow.training.run.data_check`), saving and restoring (:mod:`~obow.training.run.checkpoints`), random
  states (:mod:`~obow.training.run.random_states`), signals (:mod:`~obow.training.run.signals`), one writer per
  run folder (:mod:`~obow.training.run.lock`), its logs (:mod:`~obow.training.run.logger`) and its settled
  settings (:mod:`~obow.training.run.settle`, :mod:`~obow.training.run.threads`,
  :mod:`~obow.training.run.precision`).

Imports go down: the loop imports the step and the run, the step imports the run, the run neither
(tests/test_layers.py).

The allowed values of the training settings are declared in :mod:`obow.config.choices`.
"""
