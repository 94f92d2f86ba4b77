"""The allowed values of the settings that pick one of several named options, declared once, without
importing PyTorch: :mod:`~obow.config.schema` checks a recipe against them, and the modules that implement
the options import them from here (the configuration sits below the code it configures)."""

# model (obow.methods)
#: The methods: ``model.method`` values (each built by :func:`obow.methods.build_method`).
METHODS = ("obow", "mocov2", "bownet", "rotnet")
#: Teacher (EMA) momentum schedules over the run.
MOMENTUM_SCHEDULES = ("cosine", "constant")
#: How the crop groups' losses combine: the sum of the groups' means (official) or a mean over all views.
LOSS_WEIGHTINGS = ("group_sum", "view_mean")
#: MoCo v2's views: its own two views, or OBoW's (every crop and patch a query).
MOCO_AUGMENTATIONS = ("mocov2", "ours")

# model (obow.bow)
#: How a feature is coded against the vocabulary: soft (paper eq. 1), hard (Table 3), Sinkhorn-balanced.
ASSIGNMENTS = ("soft", "hard", "sinkhorn")
#: How a map's codes become one BoW: max over locations (official) or mean.
POOLINGS = ("max", "avg")
#: How the queue vocabulary draws one feature per image.
QUEUE_SAMPLINGS = ("local_average", "local", "global_average")
#: Vocabulary update rules: the queue (paper) or online k-means (appendix).
VOCABULARIES = ("queue", "kmeans")
#: BoW prediction heads: the dynamic weight generator (paper) or fixed per-word weights (Table 3).
HEADS = ("dynamic", "fixed")

# data (obow.data)
#: How labels are read from a folder: class sub-folders when there are any (auto), always, or never.
LABEL_MODES = ("auto", "folders", "none")
#: Who makes the training views: loader worker processes, or batched kernels on the training device.
PIPELINES = ("auto", "workers", "device")
#: ``data.on_change``: what a resume does when the training images differ from the checkpoint's (some added,
#: removed or changed in size): stop and say so, or go on with the images now there.
DATA_CHANGES = ("refuse", "continue")

# train (obow.training)
#: Where a run computes: a GPU when one is visible (auto), or the one named.
DEVICES = ("auto", "cpu", "cuda")
#: Arithmetic of the forward pass: float32, or bfloat16 / float16 autocast (the BoW codes stay float32); auto:
#: bf16 where the device computes bfloat16 in hardware, else fp32 (chosen once per run, when it starts).
PRECISIONS = ("fp32", "bf16", "fp16", "auto")
#: ``train.compile``: nothing, the networks (``torch.compile`` of the student and the teacher), or the whole step
#: (forward and backward as one graph, the optimiser step as another: :mod:`obow.training.step.compiled`), or the eager
#: step captured once as a CUDA graph and replayed (:mod:`obow.training.step.graphed`; no compiler). ``true`` and
#: ``false``, the setting's values before ``step``, mean ``networks`` and ``off``.
COMPILE_MODES = ("off", "networks", "step", "graph")
