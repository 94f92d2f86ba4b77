"""``obow pretrain``: the training loop (:mod:`~obow.training.loop`), the parts it is built from
(:mod:`~obow.training.build`: process, device, data, method, optimiser), its arithmetic
(:mod:`~obow.training.precision`) and threads (:mod:`~obow.training.threads`), what a run saves and how it
resumes (:mod:`~obow.training.state`), one writer per run folder (:mod:`~obow.training.lock`), and its logs
(:mod:`~obow.training.logger`).

The allowed values of the training settings are declared in :mod:`obow.config.choices`.
"""
