"""Images in, tensors out: image folders and the epoch sampler (:mod:`~obow.data.folders`), the teacher's and
the student's views (:mod:`~obow.data.transforms`), CutMix (:mod:`~obow.data.cutmix`) and the evaluation
sets (:mod:`~obow.data.eval_sets`).

The allowed values of the data settings are declared here, without importing PyTorch.
"""

#: How labels are read from a folder: class sub-folders when there are any (auto), always, or never.
LABEL_MODES = ("auto", "folders", "none")
#: Who makes the training views: loader worker processes, or batched kernels on the training device.
PIPELINES = ("auto", "workers", "device")
