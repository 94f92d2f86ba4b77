"""MoCo v2, the paper's appendix baseline (appendix "Comparing with MoCo for the same image augmentations").

A query encoder (``student`` backbone + ``projector``) is trained to tell each image's key, computed by a
momentum key encoder (``teacher`` + ``key_projector``), apart from a queue of keys of earlier batches, with
the InfoNCE loss (:func:`info_nce_loss`). One call of :meth:`MoCoV2.forward` in training mode is one step:

1. the key encoder becomes ``m * key + (1 - m) * query`` (parameters only; its batch-norm statistics are its
   own, as for OBoW's teacher), with the constant ``m = moco.key_momentum``;
2. keys = ``normalize(key_projector(teacher(teacher_images).pool5))``, without gradient, with MoCo's
   shuffled batch norm (:meth:`MoCoV2.compute_keys`; below);
3. every student view of every group is a query, contrasted with its image's key (the positive) and the
   queue (the negatives: the queue *before* this step's keys are added); a group's loss is the mean over its
   views, and the groups are combined as OBoW's (``model.loss_weighting``: ``group_sum`` sums the group
   means, ``view_mean`` averages over all views);
4. this step's keys of all processes, in rank order, replace the oldest entries of the queue (FIFO).

The caller does the backward pass and the optimiser step.

Shuffled batch norm (MoCo, section 3.3). A batch-norm statistic mixes the images it is computed over, so a
query and its key normalised with the statistics of the same images share a signature the keys of the queue
(normalised in earlier steps) lack: the pretext task can be solved through it ("cheating": the
instance-discrimination accuracy ``moco/accuracy`` is high while the features learn little). MoCo trains on
several GPUs, each normalising its own share of the batch, and encodes the keys of a randomly permuted batch
(then puts them back in order); its single-GPU code simulates the GPUs by splitting batch norm into
sub-batches. Both are here, and compose: with ``P`` processes of ``b`` images each and ``s = bn_splits``
(batch norm of the query and the key encoder computed over contiguous sub-batches of the rows,
:mod:`obow.methods.split_batchnorm`), the keys of a random permutation of the global batch are encoded, process
``r`` taking its ``b`` images, cut into ``s`` sub-batches of ``m = b / s`` images. What holds, for image ``i``:

* its queries (in every view group: the views are image-major, ``[b, n, ...]`` flattened, so the ``n`` views of
  an image are adjacent rows) are all normalised with the statistics of one fixed block ``Q(i)`` of ``m``
  images of its process's batch (the images ``m * (i // m) ... m * (i // m) + m - 1``, every view of them);
* its key is normalised with the statistics of ``K(i)``: ``i`` and ``m - 1`` other images drawn uniformly at
  random, afresh each step, from the ``P * b - 1`` others of the global batch, independently of ``Q(i)``. The
  other images of ``Q(i)`` are in ``K(i)`` only by chance: ``(m - 1)^2 / (P b - 1)`` of them on average, about
  a share ``1 / (P s)`` of the sub-batch (MoCo's 8 GPUs: 1/8), and ``K(i) = Q(i)`` with probability
  ``1 / C(P b - 1, m - 1)``.

This is MoCo's guarantee, not disjointness: a key's statistics come from a random other set of images than its
query's. With ``P = s = 1`` (``bn_splits=1`` on one process) ``K(i) = Q(i)`` is the whole batch: the leak.
The permutation is drawn from the run's random generator on the images' device (saved in checkpoints: resuming
is exact); with ``bn_splits=1`` on one process none is drawn.

What follows MoCo v2 (Chen, Fan, Girshick, He, "Improved baselines with momentum contrastive learning",
2020): the 2-layer MLP head (``Linear(F, F) -> ReLU -> Linear(F, 128)``, ``moco.hidden_dim: null`` makes the
hidden layer as wide as the backbone's features), the temperature 0.2, the queue of negatives, the key
momentum 0.999, the augmentation with Gaussian blur and crop scale (0.2, 1) (:class:`obow.data.transforms.
MoCoV2Views`, ``moco.augmentation: mocov2``) and shuffled batch norm. The cosine learning rate and the SGD
settings are the recipe's (``optim``), not this module's.

What differs or is a choice here:

* ``moco.augmentation: ours`` (the paper's "MoCo v2 (our aug.)"): OBoW's views; the teacher's centre crop is
  the key view and every crop and patch is a query (MoCo v2 has exactly one query per key);
* the queue size (65536 for ImageNet in MoCo) is the recipe's: on small data sets a queue larger than the
  data set would hold several keys of the same image. It must be a multiple of the global batch;
* ``moco.bn_splits`` (``null``: :func:`auto_bn_splits`, sub-batches of 32 images or more, up to 8 of them, as
  each of MoCo's 8 GPUs normalised 32 images on ImageNet and its single-GPU CIFAR code split a batch of 512 in 8);
  runs started before the setting existed keep the ``1`` they trained with when resumed;
* ``train.sync_batchnorm`` does not apply: synchronised batch norm would normalise a query and its key with the
  same global statistics (:func:`obow.training.build.synchronises_batchnorm`);
* the key-encoder momentum is constant (MoCo v2), whatever ``model.teacher_momentum_schedule`` says.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from obow import distributed as D
from obow.backbones import Backbone, build_backbone
from obow.bow.targets import at_least_float32
from obow.checks import check_choice, check_positive, check_unit_interval
from obow.config import Config
from obow.config.choices import LOSS_WEIGHTINGS
from obow.diagnostics import feature_diagnostics
from obow.methods.base import Method, StepOutput, check_views, ema_update_, group_weight, whole_recipe
from obow.methods.split_batchnorm import convert_split_batchnorm

#: What ``moco.bn_splits: null`` aims for (:func:`auto_bn_splits`): sub-batches of at least this many images
#: (MoCo's ImageNet runs: 32 per GPU), and at most this many of them (MoCo's single-GPU CIFAR code: 8 of 64).
AUTO_SUB_BATCH, AUTO_MAX_SPLITS = 32, 8


def auto_bn_splits(local_batch: int, processes: int) -> int:
    """``moco.bn_splits`` when it is ``null``, for ``local_batch`` images per process and ``processes`` processes.

    The most sub-batches, up to :data:`AUTO_MAX_SPLITS`, that divide the batch into equal sub-batches of at least
    :data:`AUTO_SUB_BATCH` images (64 -> 2, 128 -> 4, 256 -> 8, 512 -> 8). A batch smaller than 64 gets, on one
    process, the fewest sub-batches (2 to 8) of at least 2 images that divide it (8 -> 2), since one would leave
    the leak; with several processes it gets 1, the shuffle across processes doing the work (MoCo's ImageNet
    recipe: 8 GPUs of 32 images). 1 when nothing divides the batch (e.g. 7 on one process).
    """
    divides = [s for s in range(1, AUTO_MAX_SPLITS + 1) if local_batch % s == 0]
    large = [s for s in divides if local_batch // s >= AUTO_SUB_BATCH]
    if large and (max(large) > 1 or processes > 1):
        return max(large)
    if processes > 1:
        return 1
    return next((s for s in divides if s > 1 and local_batch // s >= 2), 1)


def check_bn_splits(splits: int, local_batch: int) -> None:
    """A ``ValueError`` naming both numbers unless ``splits`` divides the per-process batch ``local_batch``."""
    if local_batch % splits != 0:
        raise ValueError(
            f"moco.bn_splits={splits} does not divide the batch of {local_batch} images per process into equal "
            "sub-batches: choose a divisor of it (or null for the automatic choice)"
        )


def info_nce_loss(queries: Tensor, keys: Tensor, queue: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """MoCo's InfoNCE loss and its instance-discrimination top-1 accuracy.

    ``queries`` and ``keys`` are ``[N, D]`` (row ``i`` of ``keys`` is the positive of query ``i``), ``queue``
    is ``[Q, D]`` (one negative key per row). All three are used as given: the caller L2-normalises them, so
    the logits are cosine similarities ``[q . k+, q . queue_1, ..., q . queue_Q] / temperature``. The loss is
    the cross-entropy with the positive at index 0, averaged over the ``N`` queries; the accuracy (percent) is
    the share of queries whose largest logit is the positive (a tie counts for the positive). Computed in at
    least float32. Gradients flow to every input that requires them (MoCo's keys and queue do not).
    """
    if queries.dim() != 2 or keys.shape != queries.shape:
        raise ValueError(f"queries and keys must both be [N, D], got {tuple(queries.shape)} and {tuple(keys.shape)}")
    if queue.dim() != 2 or queue.shape[1] != queries.shape[1]:
        raise ValueError(
            f"queue must be [Q, D] with D={queries.shape[1]} (the queries' width), got {tuple(queue.shape)}"
        )
    check_positive("temperature", temperature)
    q, k, negatives = at_least_float32(queries), at_least_float32(keys), at_least_float32(queue)
    positive = (q * k.to(q.dtype)).sum(dim=1, keepdim=True)
    logits = torch.cat([positive, q @ negatives.to(q.dtype).t()], dim=1) / temperature
    loss = F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long, device=q.device))
    with torch.no_grad():
        accuracy = (logits.argmax(dim=1) == 0).float().mean() * 100
    return loss, accuracy


def projection_head(in_dim: int, hidden_dim: int, out_dim: int) -> nn.Sequential:
    """MoCo v2's MLP head: ``Linear(in, hidden) -> ReLU -> Linear(hidden, out)`` (no batch norm)."""
    return nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, out_dim))


class MoCoV2(Method):
    """Query encoder (``student`` + ``projector``), momentum key encoder (``teacher`` + ``key_projector``) and
    a queue of negative keys.

    Args:
        student: the backbone being trained (``pool5`` features of ``student.num_features`` channels); the
            key encoder starts as an exact copy and never gets gradients.
        dim: width of the keys and queries (128).
        hidden_dim: the head's hidden width; ``None``: ``student.num_features`` (MoCo v2).
        queue_size: number of negative keys ``Q`` (a multiple of the global batch).
        temperature: the logits' temperature (0.2).
        key_momentum: ``m`` of the key encoder's update ``m * key + (1 - m) * query`` (0.999).
        total_iterations: length of the run (kept for the method contract; the momentum is constant).
        loss_weighting: ``"group_sum"`` (OBoW's official combination of view groups) or ``"view_mean"``.
        bn_splits: sub-batches of the query and key encoders' batch norm in training mode (their
            ``nn.BatchNorm2d`` become :class:`~obow.methods.split_batchnorm.SplitBatchNorm2d`, same
            ``state_dict``); with ``bn_splits > 1`` the keys of a random permutation of the batch are encoded
            (see the module's docstring). ``1``: plain batch norm and, on one process, no shuffle (leaky).
            Every batch must divide into it.

    Buffers: ``queue`` ``[Q, dim]`` (rows: keys, L2-normalised; random unit vectors at the start, as in MoCo),
    ``queue_ptr`` (the row the next keys are written to) and ``iteration`` (training steps done).
    """

    queue: Tensor
    queue_ptr: Tensor
    iteration: Tensor
    teacher: Backbone  # always there (the key encoder)

    step_modes: ClassVar[frozenset[str]] = frozenset({"off", "networks", "step", "graph"})

    def __init__(
        self,
        student: Backbone,
        *,
        dim: int = 128,
        hidden_dim: int | None = None,
        queue_size: int = 65536,
        temperature: float = 0.2,
        key_momentum: float = 0.999,
        total_iterations: int = 1,
        loss_weighting: str = "group_sum",
        bn_splits: int = 1,
    ) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("queue_size", queue_size), ("total_iterations", total_iterations)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        bad_hidden = isinstance(hidden_dim, bool) or not isinstance(hidden_dim, int) or hidden_dim < 1
        if hidden_dim is not None and bad_hidden:
            raise ValueError(f"hidden_dim must be a positive integer or None, got {hidden_dim!r}")
        check_positive("temperature", temperature)
        check_unit_interval("key_momentum", key_momentum)
        check_choice("loss_weighting", loss_weighting, LOSS_WEIGHTINGS)
        if isinstance(bn_splits, bool) or not isinstance(bn_splits, int) or bn_splits < 1:
            raise ValueError(f"bn_splits must be a positive integer, got {bn_splits!r}")
        width = student.num_features
        self.bn_splits = bn_splits
        self.student = cast(Backbone, convert_split_batchnorm(student, bn_splits))
        self.teacher = copy.deepcopy(student).requires_grad_(False)
        self.projector = projection_head(width, hidden_dim or width, dim)
        self.key_projector = copy.deepcopy(self.projector).requires_grad_(False)
        self.temperature = float(temperature)
        self.key_momentum = float(key_momentum)
        self.total_iterations = total_iterations
        self.loss_weighting = loss_weighting
        self.register_buffer("queue", F.normalize(torch.randn(queue_size, dim), dim=1))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("iteration", torch.zeros((), dtype=torch.long))

    @classmethod
    def from_config(cls, cfg: Config, total_iterations: int) -> MoCoV2:
        """The model of a whole :class:`~obow.config.Config`: ``model`` (backbone, loss weighting) and ``moco``
        (``moco.bn_splits: null``: :func:`auto_bn_splits` of this process's share of ``data.batch_size``, which
        ``moco.bn_splits`` must divide)."""
        cfg = whole_recipe(cfg, "MoCoV2")
        m, moco = cfg.model, cfg.moco
        processes = D.world_size()
        local_batch = cfg.data.batch_size // processes
        splits = moco.bn_splits if moco.bn_splits is not None else auto_bn_splits(local_batch, processes)
        check_bn_splits(splits, local_batch)
        return cls(
            build_backbone(m.arch, m.stem, m.arch_options),
            dim=moco.dim,
            hidden_dim=moco.hidden_dim,
            queue_size=moco.queue_size,
            temperature=moco.temperature,
            key_momentum=moco.key_momentum,
            total_iterations=total_iterations,
            loss_weighting=m.loss_weighting,
            bn_splits=splits,
        )

    def realign_iteration(self, iteration: int) -> None:
        """The ``iteration`` buffer (the steps done) set to ``iteration`` (:meth:`Method.realign_iteration
        <obow.methods.base.Method.realign_iteration>`)."""
        self.iteration.fill_(iteration)

    def current_momentum(self) -> float:
        """The key encoder's momentum for the step about to run: ``key_momentum``, constant (MoCo v2). A compiled
        step (:mod:`obow.training.step.compiled`) writes it into :attr:`~obow.methods.base.Method.momentum_input`."""
        return self.key_momentum

    @torch.no_grad()
    def update_key_encoder(self, momentum: float | Tensor) -> None:
        """``key <- momentum * key + (1 - momentum) * query`` over the parameters of the backbone and the head;
        the key encoder's batch-norm statistics are its own."""
        keys = [*self.teacher.parameters(), *self.key_projector.parameters()]
        ema_update_(keys, [*self.student.parameters(), *self.projector.parameters()], momentum)

    @torch.no_grad()
    def compute_keys(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """``(local keys [b, dim], every process's keys [world * b, dim] in rank order)``, L2-normalised.

        MoCo's shuffled batch norm. With several processes the global batch is gathered, permuted by a
        permutation drawn on rank 0 and broadcast, each process encodes its slice of the permuted batch (so
        the key encoder's batch statistics mix images of all processes, and a query cannot find its key by
        the statistics of its own small batch), then the keys are gathered and put back in the original order.
        Every process must hold the same number of images. With one process and ``bn_splits > 1`` the batch is
        permuted and encoded (its sub-batches thus random sets of images), and the keys put back in order; with
        ``bn_splits=1``, or in evaluation mode (running statistics: nothing to shuffle), it is encoded as it is.
        """
        if not D.is_distributed():
            if self.bn_splits == 1 or not self.training:
                keys = self._encode_keys(images)
                return keys, keys
            perm = torch.randperm(images.shape[0], device=images.device)
            shuffled = self._encode_keys(images[perm])
            keys = torch.empty_like(shuffled)
            keys[perm] = shuffled  # row j of shuffled is the key of image perm[j]
            return keys, keys
        rank, local = D.rank(), images.shape[0]
        everything = D.all_gather_cat(images)
        perm = torch.randperm(everything.shape[0], device=images.device)
        D.broadcast_(perm, src=0)
        mine = slice(rank * local, (rank + 1) * local)
        shuffled_keys = D.all_gather_cat(self._encode_keys(everything[perm[mine]]))
        all_keys = torch.empty_like(shuffled_keys)
        all_keys[perm] = shuffled_keys  # row j of shuffled_keys is the key of image perm[j]
        return all_keys[mine], all_keys

    def _encode_keys(self, images: Tensor) -> Tensor:
        return F.normalize(at_least_float32(self.key_projector(self.teacher(images).pool5)), dim=1)

    @torch.no_grad()
    def enqueue(self, keys: Tensor) -> None:
        """Write ``keys`` ``[n, dim]`` (every process's, in rank order) over the oldest rows of the queue."""
        size, n = self.queue.shape[0], keys.shape[0]
        if size % n != 0:
            raise RuntimeError(
                f"the queue ({size} keys) must be a multiple of the keys enqueued per step ({n}, the global batch): "
                "set moco.queue_size to a multiple of data.batch_size"
            )
        # the rows ptr .. ptr + n - 1 (mod size) as a tensor: the pointer is never read on the host (a device
        # synchronisation on a GPU) and the written rows never shape the graph (train.compile=step)
        rows = (self.queue_ptr + torch.arange(n, device=self.queue_ptr.device)) % size
        self.queue.index_copy_(0, rows, keys.to(self.queue.dtype))
        self.queue_ptr.copy_((self.queue_ptr + n) % size)

    def forward(
        self,
        teacher_images: Tensor,
        student_views: Sequence[Tensor],
        group: int | None = None,
        grad_scale: float = 1.0,
    ) -> StepOutput:
        """One step's maths. ``student_views``: one tensor per view group, ``[B, n, 3, h, w]`` or ``[B, 3, h, w]``.

        In training mode this updates the key encoder and, after the last group, the queue; in evaluation mode
        neither changes. ``group=None`` computes the whole loss; ``group=g`` only group ``g``'s term, for
        ``g = 0, 1, ...`` in order with the same arguments (group 0 computes the keys and snapshots the queue,
        the last group enqueues), each followed by the caller's backward pass. The groups share no graph
        (keys and queue carry no gradient), so ``grad_scale`` is not needed and is ignored.

        ``targets`` of the output: ``{"keys": [B, dim]}``, the keys of this process's images.
        """
        groups = check_views(teacher_images, student_views)
        step = self.grouped_step(group, len(groups), lambda: self._key_side(teacher_images))
        state = step.state
        metrics = dict(state["metrics"]) if step.first else {}
        loss = teacher_images.new_zeros((), dtype=torch.float32)
        for g in step.groups:
            loss = loss + self._group_loss(g, groups, state, metrics)
        metrics["loss"] = loss.detach()
        if step.last:
            metrics["moco/accuracy"] = state["correct"] / state["count"] * 100
            if self.training:
                self.enqueue(state["all_keys"])
        return StepOutput(loss=loss, metrics=metrics, targets={"keys": state["keys"]})

    def _key_side(self, teacher_images: Tensor) -> dict:
        """Key-encoder update, this step's keys, and the queue as it is before they are added."""
        metrics: dict[str, Tensor] = {}
        if self.training:
            momentum = self.current_momentum() if self.momentum_input is None else self.momentum_input
            self.update_key_encoder(momentum)
            self.iteration += 1
            metrics["teacher_momentum"] = torch.as_tensor(momentum, dtype=torch.float32)
        keys, all_keys = self.compute_keys(teacher_images)
        return {
            "metrics": metrics,
            "keys": keys,
            "all_keys": all_keys,
            # a copy: the enqueue writes into the buffer while the groups' graphs still hold the negatives
            "negatives": self.queue.clone(),
            "correct": torch.zeros((), device=keys.device),
            "count": 0,
        }

    def _group_loss(self, g: int, groups: list[Tensor], state: dict, metrics: dict) -> Tensor:
        """Group ``g``'s term: mean InfoNCE over its views, weighted as ``loss_weighting`` says."""
        views = groups[g]
        n = views.shape[1]
        features = self.student(views.flatten(0, 1)).pool5
        if self.diagnose and g == 0 and features.shape[0] > 1:  # collapse diagnostics, on the first group's views
            metrics.update({f"student/{k}": v for k, v in feature_diagnostics(features).items()})
        queries = F.normalize(at_least_float32(self.projector(features)), dim=1)
        keys = state["keys"].repeat_interleave(n, dim=0)  # the views are image-major: image i's views are rows i*n..
        group_loss, accuracy = info_nce_loss(queries, keys, state["negatives"], self.temperature)
        metrics[f"loss/group{g}"] = group_loss.detach()
        metrics[f"moco/accuracy/group{g}"] = accuracy
        state["correct"] = state["correct"] + accuracy / 100 * len(queries)
        state["count"] += len(queries)
        return group_loss * group_weight(n, groups, self.loss_weighting)
