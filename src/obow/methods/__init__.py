"""Pretraining methods: OBoW and the paper's baselines, each a small module beside the one training loop.

``model.method`` picks one:

==========  ======================================  ==========================================================
method      module                                  paper
==========  ======================================  ==========================================================
``obow``    :class:`obow.methods.obow.OBoW`         the method (sections 3.1-3.3)
``mocov2``  :class:`obow.methods.mocov2.MoCoV2`     appendix "Comparing with MoCo for the same augmentations"
``bownet``  :class:`obow.methods.bownet.BoWNet`     Table 5 (static teacher, offline k-means vocabulary)
``rotnet``  :class:`obow.methods.rotnet.RotNet`     Table 5 (BoWNet's teacher: rotation prediction)
==========  ======================================  ==========================================================

Every method subclasses :class:`obow.methods.base.Method`: the contract between a method and the training loop
(:func:`obow.training.loop.pretrain`) is written there once, with the pieces the methods share. The
``model.method`` values and the other choices of the methods' settings are declared in
:mod:`obow.config.choices`. The authors' released checkpoints become obow ones in :mod:`obow.methods.official`
(``obow import-official``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from obow.config import Config, ViewsConfig
    from obow.data.batched_views import BatchedViews
    from obow.methods.base import Method


def method_class(name: str) -> type[Method]:
    """The class of ``model.method`` ``name`` (what it supports, without building it)."""
    if name == "obow":
        from obow.methods.obow import OBoW

        return OBoW
    if name == "mocov2":
        from obow.methods.mocov2 import MoCoV2

        return MoCoV2
    if name == "bownet":
        from obow.methods.bownet import BoWNet

        return BoWNet
    if name == "rotnet":
        from obow.methods.rotnet import RotNet

        return RotNet
    raise ValueError(f"model.method={name!r} is not one of obow, mocov2, bownet, rotnet")  # config checks it


def build_method(cfg: Config, total_iterations: int, *, resuming: bool = False) -> Method:
    """The module of ``cfg.model.method``, built from ``cfg``, for a run of ``total_iterations`` steps.

    ``resuming``: the weights will come from a checkpoint, so nothing is read from elsewhere (BoWNet's
    teacher file may be gone: its weights are in the checkpoint)."""
    method = cfg.model.method
    if method == "obow":
        from obow.methods.obow import OBoW

        return OBoW.from_config(cfg.model, total_iterations=total_iterations)
    if method == "mocov2":
        from obow.methods.mocov2 import MoCoV2

        return MoCoV2.from_config(cfg, total_iterations=total_iterations)
    if method == "bownet":
        from obow.methods.bownet import BoWNet

        return BoWNet.from_config(cfg, total_iterations=total_iterations, load_teacher_file=not resuming)
    if method == "rotnet":
        from obow.methods.rotnet import RotNet

        return RotNet.from_config(cfg, total_iterations=total_iterations)
    raise ValueError(f"model.method={method!r} is not one of obow, mocov2, bownet, rotnet")  # config checks it


def build_views(cfg: Config) -> Callable[[Any], dict]:
    """The per-image transform of ``cfg``'s method: a PIL image -> ``{"teacher": ..., "crops": ..., ...}``."""
    from obow.data.transforms import OBoWViews

    if cfg.model.method == "mocov2" and cfg.moco.augmentation == "mocov2":
        from obow.data.transforms import MoCoV2Views

        return MoCoV2Views(cfg.views, cfg.moco.crop_scale)
    return OBoWViews(cfg.views)


def views_side(views: ViewsConfig) -> int:
    """The largest image the views are made from before cropping (the square images the render benchmarks use;
    the device pipeline's cache side is :func:`cache_side`)."""
    return max(views.teacher_resize, views.patch_grid_size, views.teacher_size)


def used_side(views: ViewsConfig) -> int:
    """The largest image the views are actually made from: the teacher's resize, and the patch grid only when there
    are patches (:func:`views_side` counts the grid's size even without them).
    Under a quarter of it, an image is tiny (:func:`obow.data.folders.tiny_below`)."""
    return max(views.teacher_resize, views.teacher_size, views.patch_grid_size if views.num_patches else 0)


def cache_side(cfg: Config) -> int:
    """The device pipeline's default cap on the cached images' shorter side (:func:`obow.data.cache.sharp_side`):
    the smallest at which none of the method's views is upsampled (654 px for the paper's ImageNet views)."""
    from obow.data.cache import sharp_side

    views = cfg.views
    if cfg.model.method == "mocov2" and cfg.moco.augmentation == "mocov2":
        return sharp_side(0, [(views.teacher_size, cfg.moco.crop_scale[0])])
    crops = [(views.crop_size, views.crop_scale[0])] * (views.num_crops > 0)
    crops += [(views.patch_grid_size, views.patch_scale[0])] * (views.num_patches > 0)
    return sharp_side(views.teacher_resize, crops)


def build_batched_views(cfg: Config, side: int | None = None) -> BatchedViews:
    """:func:`build_views`' views for whole batches of decoded images (``data.pipeline: device``); ``side``: when all
    are squares of ``side`` pixels (:class:`~obow.data.batched_views.BatchedViews`)."""
    from obow.data.batched_views import BatchedViews

    mocov2 = cfg.model.method == "mocov2" and cfg.moco.augmentation == "mocov2"
    return BatchedViews(cfg.views, side, mocov2=mocov2, moco_crop_scale=cfg.moco.crop_scale)
