"""BoWNet (Gidaris et al., CVPR 2020), the paper's BoW-like baseline (Table 5, section 3.1's first paragraph).

A static teacher, pretrained by another method (a RotNet run, ``model.method=rotnet``, for the first round; the
previous round's student for the next), quantises its feature maps with a vocabulary computed once, off-line,
by k-means; a student learns to predict the resulting BoW targets from perturbed views. What differs from
:class:`~obow.methods.obow.OBoW`, which it reuses for everything else (targets, head, loss, view groups, cutmix):

* the teacher is loaded from ``bownet.teacher`` (:func:`load_teacher`), frozen and always in eval mode (a
  pretrained network uses its running batch-norm statistics); it is never updated;
* the vocabulary is :class:`StaticVocabulary` (its update changes nothing), filled by :meth:`BoWNet.prepare`
  before the first step of a new run with k-means (:func:`kmeans`) over teacher features of training images;
* BoWNet's own settings are ``model.assignment: hard``, ``model.head: fixed``, ``model.cutmix: true`` with one
  224 px crop (Table 5's "BoWNet" row), chosen in the recipe rather than forced here.

A second round is a new run whose ``bownet.teacher`` is the first round's checkpoint: its student becomes the
teacher, and a new vocabulary is computed from it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch import Tensor

from obow import distributed as D
from obow.backbones import Backbone, build_backbone
from obow.bow.kmeans import kmeans, nearest_centroids
from obow.bow.predictor import BoWPredictor, build_predictor
from obow.bow.targets import BoWExtractor, build_extractors, flatten_locations, remove_border
from obow.bow.vocabulary import Vocabulary
from obow.config import Config, ModelConfig
from obow.methods.base import whole_recipe
from obow.methods.obow import OBoW
from obow.weights.checkpoint import load_checkpoint

log = logging.getLogger("obow")


class StaticVocabulary(Vocabulary):
    """Words fixed for the whole run (BoWNet's off-line k-means vocabulary): :meth:`update` changes nothing.

    The words start as the base class's noise; :meth:`BoWNet.set_vocabularies` writes the k-means centroids.
    """

    def update(self, feature_map: Tensor, distances: Tensor, codes: Tensor | None) -> dict[str, Tensor]:
        return {}


def load_teacher(path: str | Path, cfg: ModelConfig) -> Backbone:
    """The backbone in ``path``: an ``obow pretrain`` checkpoint (its student: a RotNet run, or an earlier
    BoWNet round) or a file of ``obow export``; it must be ``cfg``'s architecture, stem and options."""
    from obow.weights.load import load_backbone

    where = f"bownet.teacher={str(path)!r}"
    if not Path(path).is_file():
        raise ValueError(
            f"{where} does not exist: give an obow pretrain checkpoint (e.g. of a model.method=rotnet run) or an "
            "exported backbone"
        )
    try:
        load_checkpoint(path)
        is_checkpoint = True
    except ValueError:
        is_checkpoint = False
    try:
        if is_checkpoint:
            teacher, info = load_backbone(path, network="student", arch=cfg.arch, stem=cfg.stem)
        else:
            teacher, info = load_backbone(backbone_file=path, arch=cfg.arch, stem=cfg.stem)
    except ValueError as err:
        raise ValueError(
            f"{where} cannot be the teacher of this run (model.arch={cfg.arch!r}, model.stem={cfg.stem!r}): {err}"
        ) from None
    options = dict(info.get("arch_options") or {})
    if options != dict(cfg.arch_options):
        raise ValueError(
            f"{where} holds a {info['arch']} built with arch_options {options}, but this run's model.arch_options "
            f"are {dict(cfg.arch_options)}: the teacher must be the same network as the student"
        )
    return teacher


class BoWNet(OBoW):
    """Student, static pretrained teacher, one static-vocabulary :class:`~obow.bow.targets.BoWExtractor` per level,
    and a BoW prediction head; the loss, view groups and cutmix are :class:`~obow.methods.obow.OBoW`'s.

    Buffers: ``vocabulary_ready`` (false until :meth:`prepare` or :meth:`set_vocabularies` has written the
    words; a step before that raises), ``iteration``, and the extractors' words and temperature statistics.
    The teacher's weights are part of the ``state_dict`` too, so a resumed run continues with the teacher it
    started with even if the file changed since (:meth:`from_config` still reads the file, which must exist).

    Args:
        student: the backbone being trained.
        teacher: the pretrained backbone, of the student's architecture; it is frozen here.
        extractors: level name -> extractor whose vocabulary is a :class:`StaticVocabulary`.
        predictor: the head (BoWNet: :class:`~obow.bow.predictor.FixedBoWPredictor`).
        total_iterations, loss_weighting, cutmix: as :class:`~obow.methods.obow.OBoW`.
    """

    vocabulary_ready: Tensor

    #: its step reads ``vocabulary_ready`` on the host (not yet a tensor the step can keep on the device)
    step_modes: ClassVar[frozenset[str]] = frozenset({"off", "networks"})

    def __init__(
        self,
        student: Backbone,
        teacher: Backbone,
        extractors: Mapping[str, BoWExtractor],
        predictor: BoWPredictor,
        *,
        total_iterations: int,
        loss_weighting: str = "group_sum",
        cutmix: bool = False,
    ) -> None:
        for level, extractor in extractors.items():
            if not isinstance(extractor.vocabulary, StaticVocabulary):
                raise ValueError(
                    f"BoWNet's vocabularies are static; level {level!r} has a {type(extractor.vocabulary)}"
                )
        super().__init__(
            student,
            extractors,
            predictor,
            total_iterations=total_iterations,
            teacher_momentum=1.0,  # never averaged with the student (update_teacher is a no-op as well)
            teacher_momentum_schedule="constant",
            loss_weighting=loss_weighting,
            cutmix=cutmix,
        )
        mine, theirs = student.state_dict(), teacher.state_dict()
        different = [
            k
            for k in mine.keys() | theirs.keys()
            if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape
        ]
        if different:
            raise ValueError(
                f"the teacher is not the student's network (model.arch / model.stem / model.arch_options): "
                f"{len(different)} weights differ in name or shape, e.g. {sorted(different)[0]}"
            )
        self.teacher = teacher.requires_grad_(False).eval()
        self.register_buffer("vocabulary_ready", torch.zeros((), dtype=torch.bool))

    @classmethod
    def from_config(  # type: ignore[override]
        cls, cfg: Config, total_iterations: int, load_teacher_file: bool = True
    ) -> BoWNet:
        """The model of a ``model.method=bownet`` recipe; loads the teacher from ``bownet.teacher``, unless
        ``load_teacher_file`` is false (a resumed run: the teacher's weights are in its checkpoint, so the run
        resumes even when that file is gone)."""
        cfg = whole_recipe(cfg, "BoWNet")
        m = cfg.model
        if not cfg.bownet.teacher:
            raise ValueError(
                "model.method=bownet needs bownet.teacher (an obow pretrain checkpoint or an exported backbone)"
            )
        if load_teacher_file:
            teacher = load_teacher(cfg.bownet.teacher, m)
        else:
            teacher = build_backbone(m.arch, m.stem, m.arch_options).requires_grad_(False)
        student = build_backbone(m.arch, m.stem, m.arch_options)
        extractors = build_extractors(m, student, lambda channels: StaticVocabulary(m.num_words, channels))
        return cls(
            student,
            teacher,
            extractors,
            build_predictor(m, student),
            total_iterations=total_iterations,
            loss_weighting=m.loss_weighting,
            cutmix=m.cutmix,
        )

    def train(self, mode: bool = True) -> BoWNet:
        """As ``nn.Module.train``, except that the static teacher stays in eval mode (running BN statistics)."""
        super().train(mode)
        self.teacher.eval()
        return self

    @torch.no_grad()
    def update_teacher(self, momentum: float | Tensor) -> None:
        """The teacher is static: nothing to do."""

    def set_vocabularies(self, words: Mapping[str, Tensor]) -> None:
        """Write every level's words ``[K, C_l]`` and mark the vocabulary as built."""
        for level in self.levels:
            target = cast(BoWExtractor, self.extractors[level]).vocabulary.words
            if level not in words or tuple(words[level].shape) != tuple(target.shape):
                got = tuple(words[level].shape) if level in words else None
                raise ValueError(f"level {level!r} needs words of shape {tuple(target.shape)}, got {got}")
            target.copy_(words[level])
        self.vocabulary_ready.fill_(True)

    def _teacher_side(self, teacher_images: Tensor, groups: list[Tensor]) -> dict:
        if not bool(self.vocabulary_ready):
            raise RuntimeError(
                "BoWNet's vocabulary was never built: obow pretrain builds it with k-means before the first step "
                "of a new run (BoWNet.prepare, settings bownet.kmeans_*); outside it call prepare or set_vocabularies"
            )
        state = super()._teacher_side(teacher_images, groups)
        state["metrics"].pop("teacher_momentum", None)
        return state

    @torch.no_grad()
    def prepare(self, images: Any, cfg: Config, device: torch.device | str) -> dict[str, float]:
        """Build the vocabulary: k-means over the teacher's features of training images (BoWNet's off-line step).

        ``min(bownet.kmeans_images, len(images))`` images of the :class:`~obow.data.folders.ImageList`
        ``images``, chosen at random (seeded by ``train.seed``), go through the teacher's evaluation view (resize,
        centre crop);
        at every level of ``model.levels``, ``bownet.kmeans_samples_per_image`` random locations (all of them
        when the map has fewer) of the border-free map are kept per image, and ``bownet.kmeans_iterations``
        Lloyd iterations with ``K = model.num_words`` give the words. In a distributed run every process
        computes the same words (same seed); rank 0's are broadcast all the same, so that non-deterministic GPU
        sums cannot make them differ. Returns the final k-means objective (mean squared distance) per level.
        """
        from obow.data.eval_sets import eval_dataset
        from obow.data.folders import EpochSampler, ImageList, build_loader

        device = torch.device(device)
        b, m = cfg.bownet, cfg.model
        generator = torch.Generator().manual_seed(cfg.train.seed)
        count = min(b.kmeans_images, len(images))
        chosen = sorted(torch.randperm(len(images), generator=generator)[:count].tolist())
        subset = ImageList(root=images.root, paths=[images.paths[i] for i in chosen], labels=None, classes=None)
        dataset = eval_dataset(subset, cfg.views)
        batch_size = max(1, cfg.data.batch_size // D.world_size())
        sampler = EpochSampler(len(dataset), batch_size, shuffle=False, drop_last=False)
        loader = build_loader(dataset, sampler, batch_size, cfg.data.num_workers, pin_memory=device.type == "cuda")
        samples: dict[str, list[Tensor]] = {level: [] for level in self.levels}
        self.teacher.eval()
        for batch in loader:
            maps = self.teacher(batch["image"].to(device, non_blocking=True), levels=self.levels).maps
            for level in self.levels:
                border = cast(BoWExtractor, self.extractors[level]).border
                features = flatten_locations(remove_border(maps[level].float(), border))
                samples[level].append(sample_locations(features, b.kmeans_samples_per_image, generator))
        words, objective = {}, {}
        for level in self.levels:
            points = torch.cat(samples[level])
            if points.shape[0] < m.num_words:
                raise ValueError(
                    f"k-means for {level} has {points.shape[0]} feature vectors ({count} images x at most "
                    f"{b.kmeans_samples_per_image} locations) for model.num_words={m.num_words} words: raise "
                    "bownet.kmeans_images or bownet.kmeans_samples_per_image, or lower model.num_words"
                )
            centroids = kmeans(points, m.num_words, b.kmeans_iterations, generator)
            words[level] = D.broadcast_(centroids.contiguous())
            objective[level] = float(nearest_centroids(points, words[level])[1].mean())
            log.info(
                "BoWNet vocabulary %s: k-means of %d teacher features (%d images) into %d words, %d iterations, "
                "mean squared distance %.4g",
                level,
                points.shape[0],
                count,
                m.num_words,
                b.kmeans_iterations,
                objective[level],
            )
        self.set_vocabularies(words)
        return objective


def sample_locations(features: Tensor, count: int, generator: torch.Generator | None = None) -> Tensor:
    """``count`` distinct random locations of every image of ``features`` ``[B, N, C]`` (all ``N`` when
    ``count >= N``), stacked into ``[B * min(count, N), C]``; the draws are made on the CPU."""
    b, n, c = features.shape
    count = min(count, n)
    index = torch.rand(b, n, generator=generator).argsort(dim=1)[:, :count].to(features.device)
    return features.gather(1, index.unsqueeze(-1).expand(b, count, c)).reshape(b * count, c)
