"""Images in, tensors out: image folders and the epoch sampler (:mod:`~obow.data.folders`), the teacher's and
the student's views (:mod:`~obow.data.transforms`), CutMix (:mod:`~obow.data.cutmix`) and the evaluation
sets (:mod:`~obow.data.eval_sets`).

The allowed values of the data settings are declared in :mod:`obow.config.choices`.
"""
