"""``obow pretrain``: the training loop (:mod:`~obow.training.loop`), the parts it is built from
(:mod:`~obow.training.build`: process, device, data, method, optimiser), its arithmetic
(:mod:`~obow.training.precision`) and threads (:mod:`~obow.training.threads`), what a run saves and how it
resumes (:mod:`~obow.training.state`), one writer per run folder (:mod:`~obow.training.lock`), and its logs
(:mod:`~obow.training.logger`).

The allowed values of the training settings are declared here, without importing PyTorch.
"""

#: Where a run computes: a GPU when one is visible (auto), or the one named.
DEVICES = ("auto", "cpu", "cuda")
#: Arithmetic of the forward pass: float32, or bfloat16 / float16 autocast (the BoW codes stay float32); auto:
#: bf16 where the device computes bfloat16 in hardware, else fp32 (chosen once per run, when it starts).
PRECISIONS = ("fp32", "bf16", "fp16", "auto")
#: ``train.compile``: nothing, the networks (``torch.compile`` of the student and the teacher), or the whole step
#: (forward and backward as one graph, the optimiser step as another: :mod:`obow.training.compiled`). ``true`` and
#: ``false``, the setting's values before ``step``, mean ``networks`` and ``off``.
COMPILE_MODES = ("off", "networks", "step")
