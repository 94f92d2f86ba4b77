"""The teacher's view and the student's crops and patches of a whole batch at once, on the training device.

The same views as :mod:`obow.data.transforms` (paper appendix, official notes 2.11), made from a batch of
decoded ``uint8`` images ``[B, 3, H, W]`` (an :class:`obow.data.cache.ImageCache`, each image whole at its own
size, the batch padded with each image's edge) instead of one PIL image at a time in a loader worker: every image
still gets its own random parameters (crop box, flip, colour jitter and its order, grayscale, blur radius, patch
cells and jitter), but all the pixel work of a batch is a handful of batched kernels (two batched matrix products
per view group for every resized crop, elementwise colour maths, one grouped convolution for the blur).
``data.pipeline: device`` uses it (:class:`obow.data.device_loader.DeviceLoader`).

The random parameters are drawn on the CPU from a ``torch.Generator`` the caller seeds (per global batch), so
the views depend only on that seed and the images, whichever device computes them: a resumed run makes the
views an uninterrupted one made, and a run on several GPUs the views of one GPU.

Where the views fall is the worker pipeline's, on every image shape: the boxes of the teacher's view (its
``Resize`` + ``CenterCrop``), of the crops and of the patch view follow torchvision's rules on each image's own
height and width (``RandomResizedCrop``: integer boxes, ten tries, the same fallback), and the cache keeps every
image whole, at its own size up to the side where no view is upsampled (:func:`obow.data.cache.sharp_side`). On
500x375 and 375x500 images with the paper's views, every measure of ``benchmarks/views_distribution.py`` (box
area, aspect, centre, reach outside the central square, upsampled share, area outside the teacher's view; flip
and grey rates) agreed with the worker pipeline's by two-sample tests over 600 images (smallest p 0.026)
(docs/results/views_distribution.json; ``tests/test_device_views_distribution.py``). The pixels are Pillow's, as
the worker pipeline makes them (``tests/test_batched_views.py``, on two photos): the resampling is Pillow's
antialiased bilinear filter (:func:`resized_crops`; 240 views of each kind reduced 1x-4x against Pillow's of the
same box: crops 0.03, patch views 0.008, teacher views 0.001 levels of 255 off per pixel on average, gradient energy
1.000x Pillow's for each, median), the colour jitter and grayscale bring each result to the 8-bit grid as Pillow
does (the tests' views and 2,048 CIFAR-10 crops level for level: the same mean brightness; the hue's conversion
back, in float32 where Pillow's is in double, can round a near-tie the other way: one pixel a level off in another
1,024 crops), and the blur is PIL's own (three extended box blurs along each axis, of variance sigma squared at every
sigma) in floats, within the 3 levels of 255 that PIL's rounding adds. On square images of one size (CIFAR-10) the
draws are those of the square cache before, and the views moved from that render's (6aa5d3d: ``roi_align``, float
colour) by the 8-bit rounding: at most a level in the teacher's view and wherever ``roi_align`` read only the box,
tens of levels at a crop's edge, where it read beyond the box and the view is now Pillow's; the jitter's rounding
makes the student's views about a level darker on average (``benchmarks/render_change.py`` on 1,024 CIFAR-10
images, docs/results/render_cpu.md).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from obow.config import ViewsConfig
from obow.data.transforms import GRID_SIDE
from obow.graphs import CaptureError

#: torchvision's RandomResizedCrop: aspect ratios in [3/4, 4/3], ten tries before the central fallback.
CROP_RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10
#: ITU-R 601-2 luma, as PIL's convert("L") (the worker pipeline jitters PIL images); torchvision's tensor
#: rgb_to_grayscale weighs red 0.2989.
LUMA = (0.299, 0.587, 0.114)
#: The same in 16-bit fixed point (each weight times 2**16, rounded), the integers Pillow's conversion sums.
LUMA_FIXED = tuple(round(w * 2**16) for w in LUMA)


# ---------------------------------------------------------------------------------------------------------------
# random parameters (CPU, one generator)


@dataclass
class BoxDraws:
    """The random numbers of torchvision's ``RandomResizedCrop.get_params`` for views ``[*]``, drawn before the
    images' sizes are known (:func:`draw_boxes`): each try's area share and aspect ratio ``[*, CROP_TRIES]`` and
    the corner's two uniforms ``[*, 2]`` (float64); :func:`place_boxes` makes them boxes on images of given
    sizes."""

    share: Tensor
    aspect: Tensor
    corner: Tensor

    def __getitem__(self, rows: slice) -> BoxDraws:
        return BoxDraws(self.share[rows], self.aspect[rows], self.corner[rows])

    def to(self, device: torch.device, non_blocking: bool = True) -> BoxDraws:
        return BoxDraws(*(t.to(device, non_blocking=non_blocking) for t in (self.share, self.aspect, self.corner)))


def draw_boxes(
    shape: tuple[int, ...], scale: Sequence[float], generator: torch.Generator, ratio: Sequence[float] = CROP_RATIO
) -> BoxDraws:
    """For views ``shape``: up to :data:`CROP_TRIES` area shares uniform in ``scale`` and log-uniform aspect ratios
    in ``ratio``, and two uniforms for the corner, in this order from ``generator``."""
    share = torch.empty(*shape, CROP_TRIES, dtype=torch.float64).uniform_(scale[0], scale[1], generator=generator)
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    log_aspect = torch.empty(*shape, CROP_TRIES, dtype=torch.float64).uniform_(log_lo, log_hi, generator=generator)
    corner = torch.rand(*shape, 2, dtype=torch.float64, generator=generator)
    return BoxDraws(share, torch.exp(log_aspect), corner)


def place_boxes(draws: BoxDraws, sizes: Tensor, ratio: Sequence[float] = CROP_RATIO) -> Tensor:
    """torchvision's ``RandomResizedCrop.get_params`` for images of ``sizes`` ``[*, 2]`` (height, width), all at once,
    from ``draws`` ``[*]``: the first try whose rounded width and height fit the image is kept, its top-left corner
    uniform over the integer positions; when none fits, torchvision's fallback: the whole image, or, when its own
    aspect ratio is outside ``ratio``, the largest central box of the nearest ratio in it. Returns integer boxes
    ``[*, 4]`` as ``(top, left, height, width)`` in each image's pixels (int64)."""
    sizes = sizes.to(torch.float64)
    height, width = sizes[..., 0:1], sizes[..., 1:2]
    target = draws.share * (height * width)
    w = torch.round(torch.sqrt(target * draws.aspect))
    h = torch.round(torch.sqrt(target / draws.aspect))
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = torch.argmax(fits.to(torch.int8), dim=-1, keepdim=True)  # the first try that fits (0 when none does)
    h, w = h.gather(-1, first)[..., 0], w.gather(-1, first)[..., 0]
    height, width = height[..., 0], width[..., 0]
    top = torch.floor(draws.corner[..., 0] * (height - h + 1))
    left = torch.floor(draws.corner[..., 1] * (width - w + 1))
    boxes = torch.stack([top, left, h, w], dim=-1)
    in_ratio = width / height
    fallback_w = torch.where(in_ratio > ratio[1], torch.round(height * ratio[1]), width)
    fallback_h = torch.where(in_ratio < ratio[0], torch.round(width / ratio[0]), height)
    centred = [
        torch.div(height - fallback_h, 2, rounding_mode="floor"),
        torch.div(width - fallback_w, 2, rounding_mode="floor"),
    ]
    fallback = torch.stack([*centred, fallback_h, fallback_w], dim=-1)
    return torch.where(fits.any(dim=-1, keepdim=True), boxes, fallback).to(torch.int64)


def random_resized_boxes(
    sizes: Tensor, scale: Sequence[float], generator: torch.Generator, ratio: Sequence[float] = CROP_RATIO
) -> Tensor:
    """:func:`place_boxes` of fresh :func:`draw_boxes`: one torchvision ``RandomResizedCrop`` box ``[n, 4]`` per
    image of ``sizes`` ``[n, 2]``."""
    return place_boxes(draw_boxes((len(sizes),), scale, generator, ratio), sizes, ratio)


def teacher_boxes(sizes: Tensor, resize: int, size: int) -> Tensor:
    """The teacher's ``Resize(resize)`` + ``CenterCrop(size)`` (torchvision's) of images of ``sizes`` ``[n, 2]``
    (height, width) as boxes in their own pixels ``[n, 4]`` (top, left, height, width; float64): the shorter side
    resized to ``resize``, the longer to ``int(resize * longer / shorter)``; the crop starts
    ``round((resized - size) / 2)`` pixels into each resized side, i.e. that many times ``side / resized``
    source pixels."""
    sizes = sizes.to(torch.float64)
    height, width = sizes.unbind(-1)
    narrow = width <= height  # torchvision takes the width for the shorter side then
    resized_w = torch.where(narrow, torch.full_like(width, resize), torch.floor(resize * width / height))
    resized_h = torch.where(narrow, torch.floor(resize * height / width), torch.full_like(height, resize))
    top = torch.round((resized_h - size) / 2.0) * height / resized_h
    left = torch.round((resized_w - size) / 2.0) * width / resized_w
    return torch.stack([top, left, size * height / resized_h, size * width / resized_w], dim=-1)


@dataclass
class PhotometricParams:
    """One draw of the student's colour and flip augmentations for a batch of views (see
    :func:`draw_photometric`); every field has the same leading dimensions ``[*]``."""

    jitter: Tensor  # [*] bool: colour jitter applied
    factors: Tensor  # [*, 4]: brightness, contrast, saturation factors and hue shift
    order: Tensor  # [*, 4]: the order of the four operations (a permutation of 0..3 per view)
    gray: Tensor  # [*] bool
    blur: Tensor  # [*] bool
    sigma: Tensor  # [*]: the blur's standard deviation in pixels (meaningful where blur)
    flip: Tensor  # [*] bool

    def to(self, device: torch.device, non_blocking: bool = True) -> PhotometricParams:
        return PhotometricParams(**{k: v.to(device, non_blocking=non_blocking) for k, v in vars(self).items()})

    def flatten(self) -> PhotometricParams:
        """The fields with their two leading dimensions ``[B, m]`` merged into one (``fields``, not ``vars``: traced
        in a compiled render, where torch 2.11's Dynamo cannot read an object's ``__dict__``)."""
        return PhotometricParams(**{f.name: getattr(self, f.name).flatten(0, 1) for f in dataclasses.fields(self)})

    def __getitem__(self, rows: slice) -> PhotometricParams:
        return PhotometricParams(**{k: v[rows] for k, v in vars(self).items()})


def jitter_ranges(strengths: Sequence[float]) -> list[tuple[float, float]]:
    """torchvision's ColorJitter ranges: ``[max(0, 1 - s), 1 + s]`` for brightness, contrast and saturation,
    ``[-h, h]`` for the hue shift."""
    b, c, s, h = strengths
    return [(max(0.0, 1 - b), 1 + b), (max(0.0, 1 - c), 1 + c), (max(0.0, 1 - s), 1 + s), (-h, h)]


def draw_photometric(
    shape: tuple[int, ...], cfg: ViewsConfig, generator: torch.Generator, blur: bool
) -> PhotometricParams:
    """Per-view parameters of colour jitter (with ``cfg.color_jitter_prob``; torchvision draws a random order of
    the four operations and a factor each), grayscale (``cfg.grayscale_prob``), blur (``cfg.blur_prob``, radius
    uniform in ``cfg.blur_sigma``; never when ``blur`` is false) and a horizontal flip (1/2)."""
    u = torch.rand(*shape, 4, generator=generator)
    ranges = jitter_ranges(cfg.color_jitter)
    factors = torch.stack([torch.empty(shape).uniform_(lo, hi, generator=generator) for lo, hi in ranges], dim=-1)
    order = torch.argsort(torch.rand(*shape, 4, generator=generator), dim=-1)
    sigma = torch.empty(shape).uniform_(cfg.blur_sigma[0], cfg.blur_sigma[1], generator=generator)
    return PhotometricParams(
        jitter=u[..., 0] < cfg.color_jitter_prob,
        factors=factors,
        order=order,
        gray=u[..., 1] < cfg.grayscale_prob,
        blur=(u[..., 2] < cfg.blur_prob) & blur,
        sigma=sigma,
        flip=u[..., 3] < 0.5,
    )


def draw_patch_cells(n: int, num_patches: int, jitter: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """For ``n`` patch views: which cells of the 3x3 grid are kept (``[n, num_patches]``, a random subset in random
    order, as ``randperm(9)[:num_patches]``) and each kept cell's jitter (``[n, num_patches, 2]``, integers in
    ``[0, jitter]``), as :class:`obow.data.transforms.PatchGrid` draws them."""
    cells = GRID_SIDE * GRID_SIDE
    keep = torch.argsort(torch.rand(n, cells, generator=generator), dim=1)[:, :num_patches]
    offsets = torch.randint(0, jitter + 1, (n, num_patches, 2), generator=generator)
    return keep, offsets


# ---------------------------------------------------------------------------------------------------------------
# pixel work (any device, batched)


def to_levels(x: Tensor) -> Tensor:
    """``x`` brought to the 8-bit grid as Pillow stores a resampled pixel: rounded half up, clipped to [0, 255]."""
    return torch.floor(x + 0.5).clamp_(0, 255)


#: Pillow keeps its resampling weights in fixed point with 22 fractional bits (for 8-bit images); the weights here
#: are rounded to the same grid, which the tests found to decide the rounding of a pixel on a tie now and then.
WEIGHT_BITS = 22


def axis_weights(start: Tensor, length: Tensor, low: Tensor, high: Tensor, out: int, size: int) -> Tensor:
    """Pillow's antialiased bilinear filter along one axis, as a matrix ``[*, out, size]`` (float32) per view ``[*]``:
    output pixel ``i`` of a box from ``start`` over ``length`` input pixels is centred at ``start + (i + 0.5) *
    scale`` (``scale = length / out``) and weighs input pixel ``x`` by the triangle ``1 - |x + 0.5 - centre| /
    support`` (``support = max(scale, 1)``: the filter widens with the reduction, plain bilinear when enlarging),
    over the pixels ``[low, high)`` the filter may read (Pillow's image edges), normalised to sum to 1 and rounded to
    :data:`WEIGHT_BITS` fractional bits. The centres are placed in float64 and split into an integer and a
    fraction (a float32 centre 600 pixels in would be 3e-5 px off); the shape depends only on ``out`` and ``size``,
    and nothing is read back to the host."""
    scale = length.to(torch.float64) / out
    steps = torch.arange(out, device=start.device, dtype=torch.float64) + 0.5
    centre = start.to(torch.float64).unsqueeze(-1) + steps * scale.unsqueeze(-1)  # [*, out]
    whole = torch.floor(centre)
    fraction = (centre - whole).float().unsqueeze(-1)
    reach = 1 / scale.clamp_min(1.0).float()[..., None, None]
    pixel = torch.arange(size, device=start.device, dtype=torch.float32) + 0.5
    weight = (1 - ((pixel - whole.float().unsqueeze(-1)) - fraction).abs() * reach).clamp_min(0)
    inside = (pixel >= low[..., None, None]) & (pixel < high[..., None, None])
    weight = torch.where(inside, weight, 0.0)
    weight = weight / weight.sum(dim=-1, keepdim=True)
    return torch.floor(weight * 2.0**WEIGHT_BITS + 0.5) / 2.0**WEIGHT_BITS


def resized_crops(images: Tensor, boxes: Tensor, size: int, bounds: Tensor | None = None) -> Tensor:
    """``m`` crops of each image, each resized to ``size x size`` as Pillow's ``resize`` with its antialiased
    bilinear filter: ``images`` ``[B, 3, H, W]`` (any dtype, values in 0-255), ``boxes`` ``[B, m, 4]`` (top, left,
    height, width in pixels of its image, integer or not); returns float32 ``[B, m, 3, size, size]`` on the 8-bit
    grid.

    The filter reads the pixels inside ``bounds`` ``[B, m, 4]`` (same layout): by default the box itself, as
    torchvision's ``resized_crop`` of a PIL image (crop, then resize the crop); the whole image for a resize of the
    image followed by a crop (the teacher's view). Separable, as Pillow's: a horizontal pass then a vertical one
    (:func:`axis_weights`), each a batched matrix product over the padded batch (weights are 0 outside ``bounds``, so
    the padding is never read) and each brought to the 8-bit grid as Pillow stores its passes (:func:`to_levels`).
    Against Pillow (``tests/test_batched_views.py``): on 240 boxes of photos reduced 1x-4x, 3.1 % of the pixel
    values a level off, and all but 0.1 % (of all values) Pillow's with the two passes swapped: Pillow 13 runs some
    reductions vertical pass first (Pillow before 13 never did); on CIFAR-10's enlarged crops 1.2 % a level off and
    a few pixels two, near-ties of Pillow's 22-bit fixed point that float32 weights and sums round the other way
    (float64 sums leave a third of them). ``roi_align``, what rendered before, was 1.3 levels off on average and
    sharper (gradient energy 1.17x Pillow's for crops, 1.27x for patch views, 1.30x for teacher views, median;
    ``tests/test_batched_views.py``'s slow tests' views). On a GPU with ``train.tf32`` the products round the
    weights to TF32's 10 bits: a level off in a few pixels. Cost: the products read the whole padded image once per
    view (``B * m * size * 3 * H * W`` multiply-adds for the first pass), where ``roi_align`` read only the box."""
    _, _, height, width = images.shape
    boxes = boxes.to(images.device, torch.float64)
    bounds = boxes if bounds is None else bounds.to(images.device, torch.float64)
    top, left, box_h, box_w = boxes.unbind(-1)
    low_y, low_x, span_y, span_x = bounds.unbind(-1)
    rows = axis_weights(top, box_h, low_y, low_y + span_y, size, height)  # [B, m, size, H]
    cols = axis_weights(left, box_w, low_x, low_x + span_x, size, width)  # [B, m, size, W]
    across = to_levels(torch.einsum("bchw,bmjw->bchmj", images.float(), cols))
    return to_levels(torch.einsum("bmih,bchmj->bmcij", rows, across))


def grayscale(x: Tensor) -> Tensor:
    """Luma ``[n, 1, h, w]`` of RGB ``[n, 3, h, w]`` in 8-bit levels, as Pillow's ``convert("L")`` makes it: the
    ITU-R 601-2 weights (:data:`LUMA`) in 16-bit fixed point, rounded to the nearest level (equal to Pillow's on
    every pixel tried; exact in float32, every partial sum an integer under 2**24)."""
    r, g, b = x.unbind(1)
    weighted = LUMA_FIXED[0] * r + LUMA_FIXED[1] * g + LUMA_FIXED[2] * b
    return torch.floor((weighted + 2**15) / 2**16).unsqueeze(1)


def blend(x: Tensor, weights: Tensor) -> Tensor:
    """Brightness, contrast or saturation, each view its own, as Pillow's ``ImageEnhance`` (what torchvision runs on
    a PIL image): ``target + f * (x - target)`` in float32, clipped to [0, 255] and truncated to a level as
    ``Image.blend`` stores it, with the target black, the view's mean luma rounded to a level, or its luma
    (:func:`grayscale`). ``x``: views ``[n, 3, h, w]`` on the 8-bit grid (levels 0-255).

    ``weights`` ``[n, 3]`` per view: ``f`` and the weights of the luma and of its mean in the target: (0, 0) for
    brightness, (0, 1) for contrast, (1, 0) for saturation; ``f = 1`` leaves a view as it is, exactly. All views
    in one pass, whichever operation each does, so a round of colour jitter is a few kernels, not a few per
    operation."""
    w = weights.to(x.device, x.dtype, non_blocking=True).view(-1, 3, 1, 1, 1).unbind(1)
    f, on_luma, on_mean = w
    luma = grayscale(x)
    total = luma.sum(dim=(1, 2, 3), keepdim=True, dtype=torch.float64)  # exact, as Pillow's ImageStat in double
    mean = torch.floor(total / luma[0].numel() + 0.5).to(x.dtype)
    target = on_luma * luma + on_mean * mean
    return torch.floor((target + f * (x - target)).clamp_(0, 255))


def adjust_hue(x: Tensor, shift: Tensor) -> Tensor:
    """Rotate the hue of each view by ``shift`` (a fraction of a turn, per view) as torchvision does on a PIL image:
    the view converted to Pillow's 8-bit HSV, ``int(shift * 255)`` added to the hue byte (wrapping round), and
    converted back. ``x``: views ``[n, 3, h, w]`` on the 8-bit grid; returns them on it.

    RGB to HSV: value the largest channel, saturation ``delta / max`` and hue (in sixths of a turn: ``2 i + (next
    - previous) / delta`` for the largest channel ``i``, red first on ties) each truncated to a byte, with the
    intermediate precision at which Pillow rounds them (float32 ratios, float64 sums), which made every one of
    200,000 random pixels Pillow's byte. HSV to RGB: channel ``v * (1 - s * clamp(min(k, 4 - k), 0, 1))`` rounded,
    ``k = (n + 6 h) mod 6`` with ``n = 5, 3, 1`` for red, green, blue; a grey pixel stays as it is. Written for few
    kernels (about 30), as the device pipeline runs it on every jittered view."""
    maxc = x.amax(dim=1, keepdim=True)
    delta = maxc - x.amin(dim=1, keepdim=True)
    ratios = (maxc - x) / delta.clamp_min(1)  # Pillow's rc, gc, bc
    rc, gc, bc = (ratios[:, i : i + 1] for i in range(3))
    wide = torch.float64
    sixths = torch.where(
        x[:, 0:1] == maxc,
        (bc - gc).to(wide),
        torch.where(x[:, 1:2] == maxc, 2 + rc.to(wide) - bc.to(wide), 4 + gc.to(wide) - rc.to(wide)),
    ).to(x.dtype)
    turn = torch.remainder(sixths.to(wide) / 6 + 1, 1.0).to(x.dtype)
    coloured = delta > 0
    hue = torch.where(coloured, torch.floor(turn.to(wide) * 255), 0.0)
    saturation = torch.where(coloured, torch.floor((delta / maxc.clamp_min(1)).to(wide) * 255), 0.0).to(x.dtype)
    steps = torch.trunc(shift.to(wide) * 255).view(-1, 1, 1, 1)  # numpy's int32 of hue_factor * 255
    hue = torch.remainder(hue + steps, 256).to(x.dtype)
    # n = 5, 3, 1 made on the device (torch.tensor([5., 3., 1.]) was a copy from the host each call, which a CUDA
    # graph's capture refuses)
    k = (hue * 6 / 255 + torch.arange(5.0, 0.0, -2.0, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)) % 6
    return torch.floor(maxc * (1 - saturation / 255 * torch.minimum(k, 4.0 - k).clamp_(0, 1)) + 0.5)


#: The order of the colour jitter's operations in ``PhotometricParams.order`` (torchvision's ColorJitter).
BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)


def blend_weights(f: Tensor, op: Tensor) -> Tensor:
    """:func:`blend`'s per-view weights ``[n, 3]`` for factors ``f`` and operations ``op`` of one jitter round."""
    return torch.stack([f, (op == SATURATION).to(f.dtype), (op == CONTRAST).to(f.dtype)], dim=1)


def select_views(mask: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``a`` where a view's ``mask`` is set, else ``b`` (views ``[n, c, h, w]``, ``mask`` ``[n]``)."""
    return torch.where(mask.view(-1, 1, 1, 1), a, b)


def color_jitter(x: Tensor, factors: Tensor, order: Tensor, apply: Tensor) -> Tensor:
    """torchvision's ColorJitter with each view's own factors and order, on the views where ``apply``: four
    rounds, in round ``r`` every view applies its operation ``order[:, r]``: the views that brighten, change the
    contrast or the saturation in one :func:`blend` over all views, then those that rotate the hue (the costly
    one, once per view) picked out. ``factors``, ``order`` and ``apply`` are CPU tensors, so each round's
    selection is made on the CPU, without a device synchronisation. ``x``: views on the 8-bit grid; each operation
    brings them back to it as Pillow does (:func:`blend`, :func:`adjust_hue`). A hue shift of exactly 0 is no
    operation, as a ColorJitter without hue (the round trip through 8-bit HSV is not lossless)."""
    views = torch.arange(len(order))
    owned = False  # x is still the caller's tensor, which the hue's in-place write must not touch
    for r in range(4):
        op = torch.where(apply, order[:, r], -1)
        blends = (op >= 0) & (op != HUE)
        if bool(blends.any()):
            f = torch.where(blends, factors[views, op.clamp(0, 2)], 1.0)
            x, owned = blend(x, blend_weights(f, op)), True
        rows = torch.nonzero((op == HUE) & (factors[:, HUE] != 0)).flatten()  # a shift of 0: none (see above)
        if len(rows):
            x, owned = (x if owned else x.clone()), True
            on_device = rows.to(x.device, non_blocking=True)
            shift = factors[rows, HUE].to(x.device, non_blocking=True)
            x.index_copy_(0, on_device, adjust_hue(x.index_select(0, on_device), shift))
    return x


BLUR_PASSES = 3  # PIL's ImageFilter.GaussianBlur: three box blurs along each axis


def box_blur_radius(sigma: Tensor, passes: int = BLUR_PASSES) -> tuple[Tensor, Tensor]:
    """The box PIL runs ``passes`` times along each axis for a Gaussian blur of standard deviation ``sigma``
    (``_gaussian_blur_radius`` in Pillow's ``BoxBlur.c``; Gwosdek et al., SSVM 2011, eqs. 7, 11, 14): an integer
    radius and the fraction of a pixel beyond it, chosen so that the ``passes`` boxes' variances add up
    to ``sigma ** 2`` exactly, at every sigma (a Gaussian sampled at the pixel centres loses its variance below
    about 0.5 px: at sigma 0.2 its neighbours weigh 4e-6)."""
    s2 = sigma**2 / passes
    radius = torch.floor((torch.sqrt(12 * s2 + 1) - 1) / 2)
    frac = (2 * radius + 1) * (radius * (radius + 1) - 3 * s2) / (6 * (s2 - (radius + 1) ** 2))
    return radius, frac


def box_kernel(sigma: Tensor, reach: int) -> Tensor:
    """PIL's extended box ``[n, 2 * reach + 1]`` for each ``sigma`` (:func:`box_blur_radius`: radius ``r``,
    fraction ``f``): weight ``1 / (2r + 2f + 1)`` on the ``2r + 1`` central taps, the rest of the unit sum split
    between the two taps at ``r + 1`` (PIL's ``ww`` and ``fw``); ``reach`` at least the largest ``r + 1``."""
    radius, frac = (v.unsqueeze(1) for v in box_blur_radius(sigma))
    inner = 1 / (2 * (radius + frac) + 1)
    outer = (1 - (2 * radius + 1) * inner) / 2
    t = torch.arange(-reach, reach + 1, device=sigma.device, dtype=sigma.dtype).abs()
    return torch.where(t <= radius, inner, torch.where(t == radius + 1, outer, torch.zeros_like(inner)))


def gaussian_blur(x: Tensor, sigma: Tensor, max_sigma: float) -> Tensor:
    """Blur each view of ``x`` ``[n, 3, h, w]`` as PIL's ``ImageFilter.GaussianBlur(sigma[i])`` does, in floats:
    three passes of PIL's extended box (:func:`box_kernel`) along the rows, then three along the columns, the
    edges replicated before each pass (as PIL extends them), each pass one grouped convolution over all views.
    The variance is ``sigma ** 2`` at every sigma (PIL's too, but for its rounding to 8 bits after each pass,
    which below sigma 0.11 leaves even a black-to-white edge unblurred). Shapes depend only on ``max_sigma``
    (>= every ``sigma``), so the blur reads nothing back to the host and can be captured in a CUDA graph."""
    n, c, h, w = x.shape
    # the largest box's radius + 1, with a margin for rounding (a tap too many weighs 0, one too few would be lost)
    reach = math.floor((math.sqrt(12 * max_sigma**2 / BLUR_PASSES + 1) - 1) / 2 + 1e-3) + 1
    exact = torch.promote_types(x.dtype, torch.float32)  # the boxes' radii from at least float32 arithmetic
    kernel = box_kernel(sigma.to(exact), reach).to(x.dtype).repeat_interleave(c, dim=0)  # [n*c, 2*reach + 1]
    flat = x.reshape(1, n * c, h, w)
    for weight, pad in (
        (kernel.view(n * c, 1, 1, -1), (reach, reach, 0, 0)),
        (kernel.view(n * c, 1, -1, 1), (0, 0, reach, reach)),
    ):
        for _ in range(BLUR_PASSES):
            flat = F.conv2d(F.pad(flat, pad, mode="replicate"), weight, groups=n * c)
    return flat.view(n, c, h, w)


def photometric(x: Tensor, p: PhotometricParams, max_sigma: float) -> Tensor:
    """The student's augmentations after the crop, in the worker pipeline's order: colour jitter -> grayscale ->
    blur -> flip. ``x``: ``[n, 3, h, w]`` in 8-bit levels (0-255, on the grid Pillow rounds to; the blur's result
    is left in floats); ``p`` on the CPU."""
    x = color_jitter(x, p.factors, p.order, p.jitter)
    device = p.to(x.device)

    x = select_views(device.gray, grayscale(x).expand_as(x), x)
    if bool(p.blur.any()):  # decided on the CPU: no device synchronisation
        x = select_views(device.blur, gaussian_blur(x, device.sigma, max_sigma), x)
    return select_views(device.flip, x.flip(-1), x)


#: The hue slots of a round are the expected number of views that rotate in it plus this many standard deviations
#: (:func:`hue_capacity`): a batch with more falls back to the eager render (at 6, about once in 10^9 rounds).
HUE_SLOTS_SIGMAS = 6.0


@dataclass
class HueSlots:
    """The views that rotate their hue in each of the colour jitter's four rounds, in a fixed number ``K`` of slots
    a round (:func:`hue_slots`), so that a dense render (:func:`color_jitter_dense`) rotates ``K`` views a round, not
    all of them, with shapes that never depend on the draw. ``rows`` ``[4, K]``: the rotating views' indices, then a
    view that does not rotate in that round (unused slots); ``shift`` ``[4, K]``: their hue shifts; ``valid`` ``[4,
    K]``: which slots rotate."""

    rows: Tensor
    shift: Tensor
    valid: Tensor

    def to(self, device: torch.device, non_blocking: bool = True) -> HueSlots:
        return HueSlots(*(v.to(device, non_blocking=non_blocking) for v in (self.rows, self.shift, self.valid)))


def hue_capacity(views: int, cfg: ViewsConfig) -> int:
    """Slots a round for ``views`` views (:class:`HueSlots`): each view rotates its hue in a given round with
    probability ``q = color_jitter_prob / 4`` (jittered, the hue one of four operations in random order), so a
    round's count is binomial; the slots are its mean plus :data:`HUE_SLOTS_SIGMAS` standard deviations, at most
    ``views``; 0 where the hue never rotates. For 256 views (128 images, 2 crops each) 90 slots: a dense render
    rotates 1.4 views' worth a view instead of 4."""
    q = cfg.color_jitter_prob / 4 if cfg.color_jitter[HUE] > 0 else 0.0
    if q <= 0:
        return 0
    return min(views, math.ceil(views * q + HUE_SLOTS_SIGMAS * math.sqrt(views * q * (1 - q))))


def hue_slots(factors: Tensor, order: Tensor, apply: Tensor, capacity: int) -> HueSlots | None:
    """:class:`HueSlots` of views ``[n]`` (``factors`` ``[n, 4]``, ``order`` ``[n, 4]``, ``apply`` ``[n]``, CPU) in
    ``capacity`` slots a round: the views that rotate in round ``r`` as :func:`color_jitter` picks them (jittered,
    the hue their ``r``-th operation, a shift other than 0), in order; ``None`` when a round has more than
    ``capacity`` (the caller renders that batch eagerly). An unused slot names a view that does not rotate in that
    round and is not valid: a dense render writes that view back as it was."""
    n = len(order)
    rows = torch.empty(4, capacity, dtype=torch.int64)
    shift = torch.zeros(4, capacity, dtype=factors.dtype)
    valid = torch.zeros(4, capacity, dtype=torch.bool)
    for r in range(4):
        rotates = apply & (order[:, r] == HUE) & (factors[:, HUE] != 0)
        picked = torch.nonzero(rotates).flatten()
        count = len(picked)
        if count > capacity:
            return None
        rows[r, :count], shift[r, :count], valid[r, :count] = picked, factors[picked, HUE], True
        if count < capacity:  # a view left as it is (one exists: count < capacity <= n)
            rows[r, count:] = int(torch.nonzero(~rotates).flatten()[0]) if count < n else 0
    return HueSlots(rows, shift, valid)


def color_jitter_dense(x: Tensor, factors: Tensor, order: Tensor, apply: Tensor, hue: HueSlots | None = None) -> Tensor:
    """:func:`color_jitter` with shapes that never depend on the draw: in each round every view goes through the
    blend (with ``f = 1``, which leaves a view as it is, exactly, where it does not blend) and through the hue
    rotation (kept by ``torch.where`` only where it rotates), or, with ``hue`` (:class:`HueSlots`), only the views
    in the round's slots go through it (picked and written back; an unused slot writes its view back unchanged).
    The same numbers, bit for bit in eager mode (every operation is per view), with more arithmetic and no host
    decision: the form a compiled render traces into one graph, and a CUDA graph replays. ``factors``, ``order``,
    ``apply`` and ``hue`` on ``x``'s device. Measured on a CPU (``imagenet20_resnet18_full``, 8 images): the
    rotation of every view in every round was 56 % of the dense render's time."""
    for r in range(4):
        op = torch.where(apply, order[:, r], -1)
        blends = (op >= 0) & (op != HUE)
        f = torch.where(blends, factors.gather(1, op.clamp(0, 2).unsqueeze(1)).squeeze(1), 1.0)
        x = blend(x, blend_weights(f, op))
        if hue is None:
            rotates = (op == HUE) & (factors[:, HUE] != 0)
            x = torch.where(rotates.view(-1, 1, 1, 1), adjust_hue(x, factors[:, HUE]), x)
        elif hue.rows.shape[1]:
            picked = x.index_select(0, hue.rows[r])
            rotated = torch.where(hue.valid[r].view(-1, 1, 1, 1), adjust_hue(picked, hue.shift[r]), picked)
            x = x.index_copy(0, hue.rows[r], rotated)
    return x


def photometric_dense(x: Tensor, p: PhotometricParams, max_sigma: float, hue: HueSlots | None = None) -> Tensor:
    """:func:`photometric` with every view through every operation, each kept where its view draws it
    (:func:`color_jitter_dense`, the hue rotation in ``hue``'s slots when given; the blur computed for all views):
    the same views, and ``p`` on ``x``'s device."""
    x = color_jitter_dense(x, p.factors, p.order, p.jitter, hue)
    x = select_views(p.gray, grayscale(x).expand_as(x), x)
    x = select_views(p.blur, gaussian_blur(x, p.sigma, max_sigma), x)
    return select_views(p.flip, x.flip(-1), x)


def cut_patches(view: Tensor, keep: Tensor, offsets: Tensor, patch_size: int, jitter: int) -> Tensor:
    """The kept cells of the 3x3 patch grid of each view ``[n, 3, G, G]`` -> ``[n, P, 3, p, p]``: cell ``(i, j)``
    starts at ``(i * step + dy, j * step + dx)`` with ``step = (G - p - jitter) // 2`` (as
    :class:`obow.data.transforms.PatchGrid`). One gather."""
    n, _, side, _ = view.shape
    step = (side - patch_size - jitter) // (GRID_SIDE - 1)
    keep, offsets = keep.to(view.device), offsets.to(view.device)
    top = (keep // GRID_SIDE) * step + offsets[..., 0]  # [n, P]
    left = (keep % GRID_SIDE) * step + offsets[..., 1]
    span = torch.arange(patch_size, device=view.device)
    rows = (top[..., None] + span)[..., :, None]  # [n, P, p, 1]
    cols = (left[..., None] + span)[..., None, :]  # [n, P, 1, p]
    owner = torch.arange(n, device=view.device).view(n, 1, 1, 1)
    patches = view.permute(0, 2, 3, 1)[owner, rows, cols]  # [n, P, p, p, 3]
    return patches.permute(0, 1, 4, 2, 3)


# ---------------------------------------------------------------------------------------------------------------
# the views of a batch


@dataclass
class GroupParams:
    """The random parameters of ``m`` student views of each of ``B`` images: the draws of their crop boxes
    ``[B, m]`` (:class:`BoxDraws`), the boxes themselves ``[B, m, 4]`` (top, left, height, width in each image's
    pixels) once placed on the images' sizes (:meth:`BatchedViews.place`; ``None`` before), and their photometric
    parameters ``[B, m, ...]``."""

    draws: BoxDraws
    boxes: Tensor | None
    photo: PhotometricParams
    #: the dense render's hue slots (:meth:`BatchedViews.with_hue_slots`), made on the host for the whole group
    hue: HueSlots | None = None

    def __getitem__(self, rows: slice) -> GroupParams:  # the slots name views of the whole group: not kept
        return GroupParams(self.draws[rows], None if self.boxes is None else self.boxes[rows], self.photo[rows])

    def to(self, device: torch.device, non_blocking: bool = True) -> GroupParams:
        boxes = None if self.boxes is None else self.boxes.to(device, non_blocking=non_blocking)
        hue = None if self.hue is None else self.hue.to(device, non_blocking)
        return GroupParams(self.draws.to(device, non_blocking), boxes, self.photo.to(device, non_blocking), hue)


@dataclass
class ViewParams:
    """Every random parameter of a batch's views (CPU tensors, first dimension the image), drawn by
    :meth:`BatchedViews.draw`; ``params[a:b]`` is the parameters of images ``a..b-1`` (a process's share of a
    global batch). The draws do not depend on the images; the boxes (``teacher_box`` ``[B, 4]`` and each group's)
    are placed on the images' sizes by :meth:`BatchedViews.place` before the render."""

    teacher_flip: Tensor | None  # [B] bool; None for MoCo v2's views, whose key view is a student-like crop
    crops: GroupParams | None
    grid: GroupParams | None  # the patch view (one per image), whose grid of patches is cut as below
    patch_keep: Tensor | None  # [B, P]: kept cells of the 3x3 grid
    patch_offsets: Tensor | None  # [B, P, 2]: their jitter
    teacher_box: Tensor | None = None  # [B, 4]: the teacher's resize and centre crop in each image's pixels
    sizes: Tensor | None = None  # [B, 2]: each image's height and width, where the teacher's filter stops

    def __getitem__(self, rows: slice) -> ViewParams:
        return ViewParams(*(None if v is None else v[rows] for v in vars(self).values()))

    def to(self, device: torch.device, non_blocking: bool = True) -> ViewParams:
        """The parameters on ``device`` (copies made without waiting on the host, where the device allows)."""
        moved = (None if v is None else v.to(device, non_blocking=non_blocking) for v in vars(self).values())
        return ViewParams(*moved)


class BatchedViews:
    """All views of a batch of decoded images, as :class:`obow.data.transforms.OBoWViews` makes them one image at a
    time (``mocov2=True``: as :class:`~obow.data.transforms.MoCoV2Views`, a key and a query view of
    ``views.teacher_size``, random-resized crops of scale ``moco_crop_scale`` with blur).

    Three steps: :meth:`draw` draws every random parameter of ``B`` images from a seeded CPU ``generator`` (the
    same numbers whatever the images); :meth:`place` makes the boxes of the teacher's view, the crops and the
    patch view on each image's own height and width (torchvision's rules), so that a crop may reach anywhere in
    its image; :meth:`render` makes the views of images ``[B, 3, H, W]`` (uint8, any device; each image at the
    top left, padded as :meth:`obow.data.cache.ImageCache.batch` pads) with them, in the collated form the worker
    pipeline gives: ``{"teacher": [B, 3, T, T], "crops": [B, n, 3, c, c], "patches": [B, P, 3, p, p]}``
    (normalised float32, on the images' device). ``side``: when every image is a square of ``side`` pixels,
    :meth:`draw` places the boxes at once (what the tests and benchmarks of square images use).
    """

    def __init__(
        self,
        cfg: ViewsConfig,
        side: int | None = None,
        mocov2: bool = False,
        moco_crop_scale: Sequence[float] = (0.2, 1.0),
    ) -> None:
        if side is not None and side < 1:
            raise ValueError(f"BatchedViews needs images of at least 1 pixel, got {side}")
        self.cfg = cfg
        self.side = side
        self.mocov2 = mocov2
        self.moco_crop_scale = tuple(moco_crop_scale)
        self._mean_std: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}  # per device, made once

    def draw(self, batch: int, generator: torch.Generator) -> ViewParams:
        """The random parameters of ``batch`` images' views, in a fixed order of draws from ``generator`` (placed on
        squares of ``side`` when the views were made for them)."""
        cfg = self.cfg
        if self.mocov2:
            both = self._draw_group(batch, 2, self.moco_crop_scale, True, generator)
            params = ViewParams(None, both, None, None, None)
        else:
            flip = torch.rand(batch, generator=generator) < 0.5
            crops = self._draw_group(batch, cfg.num_crops, cfg.crop_scale, True, generator) if cfg.num_crops else None
            grid = keep = offsets = None
            if cfg.num_patches:
                grid = self._draw_group(batch, 1, cfg.patch_scale, False, generator)
                keep, offsets = draw_patch_cells(batch, cfg.num_patches, cfg.patch_jitter, generator)
            params = ViewParams(flip, crops, grid, keep, offsets)
        if self.side is None:
            return params
        return self.place(params, torch.tensor([[self.side, self.side]]).expand(batch, 2))

    def place(self, params: ViewParams, sizes: Tensor) -> ViewParams:
        """``params`` with their boxes placed on images of ``sizes`` ``[B, 2]`` (height, width; CPU)."""

        def placed(group: GroupParams | None) -> GroupParams | None:
            if group is None:
                return None
            boxes = place_boxes(group.draws, sizes.unsqueeze(1).expand(*group.draws.corner.shape[:2], 2))
            return dataclasses.replace(group, boxes=boxes)

        teacher = None if self.mocov2 else teacher_boxes(sizes, self.cfg.teacher_resize, self.cfg.teacher_size)
        crops, grid = placed(params.crops), placed(params.grid)
        return dataclasses.replace(
            params, crops=crops, grid=grid, teacher_box=teacher, sizes=sizes.to(torch.int64).contiguous()
        )

    def with_hue_slots(self, params: ViewParams) -> ViewParams | None:
        """``params`` (on the host) with each group's :class:`HueSlots` for a dense render (:func:`hue_capacity`
        slots a round), or ``None`` when a round of some group has more rotating views than its slots (then the
        batch is rendered eagerly: about once in 10^9 rounds)."""
        groups = {}
        for name in ("crops", "grid"):
            group = getattr(params, name)
            if group is None:
                continue
            photo = group.photo.flatten()
            slots = hue_slots(photo.factors, photo.order, photo.jitter, hue_capacity(len(photo.order), self.cfg))
            if slots is None:
                return None
            groups[name] = dataclasses.replace(group, hue=slots)
        return dataclasses.replace(params, **groups)

    def render(self, images: Tensor, params: ViewParams, dense: bool = False) -> dict[str, Tensor]:
        """The views of ``images`` ``[B, 3, H, W]`` under ``params`` (of the same ``B`` images, placed on their sizes).

        ``dense``: every view through every photometric operation, each kept where drawn
        (:func:`photometric_dense`), with ``params`` on the images' device: the same views with shapes that never
        depend on the draw, as :func:`compiled_render` traces them; otherwise the operations run on the views
        that draw them, picked on the host (less arithmetic in eager mode)."""
        cfg = self.cfg
        images = images.float()  # once for every group (a padded batch of whole images is large)
        if self.mocov2:
            assert params.crops is not None  # MoCo v2's two crops
            both = self._render_group(images, params.crops, cfg.teacher_size, dense)
            return {"teacher": both[:, 0], "crops": both[:, 1:]}
        assert params.teacher_box is not None and params.sizes is not None  # placed on the images' sizes (place)
        # the teacher's view is a crop of the resized image: its filter reads the whole image, up to its own edges
        whole = F.pad(params.sizes.unsqueeze(1), (2, 0))  # [B, 1, 4]: (0, 0, height, width)
        teacher = resized_crops(images, params.teacher_box.unsqueeze(1), cfg.teacher_size, whole)[:, 0] / 255.0
        assert params.teacher_flip is not None  # drawn for OBoW's teacher view
        flip = params.teacher_flip.to(images.device, non_blocking=True).view(-1, 1, 1, 1)
        views = {"teacher": self._normalize(torch.where(flip, teacher.flip(-1), teacher))}
        if params.crops is not None:
            views["crops"] = self._render_group(images, params.crops, cfg.crop_size, dense)
        if params.grid is not None:
            grid = self._render_group(images, params.grid, cfg.patch_grid_size, dense)[:, 0]
            assert params.patch_keep is not None and params.patch_offsets is not None  # drawn with the grid
            patches = cut_patches(grid, params.patch_keep, params.patch_offsets, cfg.patch_size, cfg.patch_jitter)
            views["patches"] = patches.contiguous()
        return views

    def __call__(self, images: Tensor, generator: torch.Generator) -> dict[str, Tensor]:
        """The views of a batch of images ``[B, 3, H, W]``, all of that size, under fresh draws."""
        params = self.draw(images.shape[0], generator)
        return self.render(images, self.place(params, torch.tensor([images.shape[-2:]]).expand(len(images), 2)))

    def _draw_group(self, batch: int, m: int, scale, blur: bool, generator: torch.Generator) -> GroupParams:
        draws = draw_boxes((batch, m), scale, generator)
        return GroupParams(draws, None, draw_photometric((batch, m), self.cfg, generator, blur))

    def _render_group(self, images: Tensor, group: GroupParams, size: int, dense: bool = False) -> Tensor:
        """The group's augmented, normalised crops of ``size`` px: ``[B, m, 3, size, size]``."""
        assert group.boxes is not None  # placed on the images' sizes (place)
        batch, m = group.boxes.shape[:2]
        crops = resized_crops(images, group.boxes, size).flatten(0, 1)  # in 8-bit levels, as the photometric maths
        if dense:
            crops = photometric_dense(crops, group.photo.flatten(), self.cfg.blur_sigma[1], group.hue)
        else:
            crops = photometric(crops, group.photo.flatten(), self.cfg.blur_sigma[1])
        return self._normalize(crops / 255.0).view(batch, m, 3, size, size)

    def _normalize(self, x: Tensor) -> Tensor:
        mean, std = self._mean_std_on(x.device, x.dtype)
        return (x - mean) / std

    def _mean_std_on(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        where = (torch.device(device), dtype)
        if where not in self._mean_std:
            mean, std = (
                torch.tensor(v, dtype=dtype).view(1, 3, 1, 1).to(device) for v in (self.cfg.mean, self.cfg.std)
            )
            self._mean_std[where] = (mean, std)
        return self._mean_std[where]


def compiled_render(
    views: BatchedViews, device: torch.device, backend: str = "inductor", **compile_kwargs
) -> Callable[[Tensor, ViewParams], dict[str, Tensor]]:
    """``views.render`` as one compiled graph (``fullgraph``, static shapes): ``render(images, params)`` moves
    ``params`` to ``device`` and renders densely (:meth:`BatchedViews.render` with ``dense``), so that nothing in
    the graph depends on the draw and a batch of the same size never recompiles (the hue rotated in a fixed number
    of slots a round, :meth:`BatchedViews.with_hue_slots`; a batch with more rotating views renders eagerly). The
    random parameters are still drawn on the host by :meth:`BatchedViews.draw`: a compiled render makes the views an
    eager one makes, to float32 rounding (the fused kernels round in their own order). ``data.pipeline: device``
    uses it with ``train.compile: step`` (:class:`obow.data.device_loader.DeviceLoader`)."""
    views._mean_std_on(device, torch.float32)  # made here, so that the traced graph only reads it
    graph = torch.compile(
        functools.partial(views.render, dense=True), backend=backend, fullgraph=True, dynamic=False, **compile_kwargs
    )

    def render(images: Tensor, params: ViewParams) -> dict[str, Tensor]:
        slotted = views.with_hue_slots(params)  # on the host, before the parameters move
        if slotted is None:  # more rotating views than slots in a round: this batch eagerly (no recompilation)
            return views.render(images, params.to(device))
        return graph(images, slotted.to(device))

    render.kind = "compiled"  # type: ignore[attr-defined]
    return render


def graphed_render(
    views: BatchedViews, device: torch.device, graph: Callable[[], Any]
) -> Callable[[Tensor, ViewParams], dict[str, Tensor]]:
    """``views.render`` captured once as a CUDA graph (``graph()``: an :class:`obow.graphs.StepGraph`)
    and replayed: the dense render (:meth:`BatchedViews.render` with ``dense``, whose shapes never depend on the
    draw) on static buffers, into which each batch's images and parameters (still drawn on the host) are copied;
    each call returns copies of the graph's outputs (the loader makes one batch ahead, so the next replay must
    not overwrite the views a step still reads). The views are the eager render's (the same operators). The hue
    is rotated in a fixed number of slots a round (:meth:`BatchedViews.with_hue_slots`, made on the host). A
    capture that fails, a batch of another size, or one with more rotating views than slots (about once in 10^9
    rounds) renders eagerly (the first said in one log line).
    ``train.compile: graph`` with the device pipeline uses it (:func:`obow.training.build.build_data`)."""
    views._mean_std_on(device, torch.float32)  # made here: the graph only reads it
    held: dict[str, Any] = {}

    def render(images: Tensor, params: ViewParams) -> dict[str, Tensor]:
        slotted = views.with_hue_slots(params)  # on the host, before the parameters move
        params = (params if slotted is None else slotted).to(device)
        if held.get("eager_why") is not None or (slotted is None and "graph" not in held):
            return views.render(images, params)
        if "graph" not in held:
            return capture(images, params)
        static_images, static_params = held["inputs"]
        ours, theirs = param_tensors(static_params), param_tensors(params)
        if images.shape != static_images.shape or [t.shape for t in ours] != [t.shape for t in theirs]:
            return views.render(images, params)
        static_images.copy_(images, non_blocking=True)
        for a, b in zip(ours, theirs, strict=True):
            a.copy_(b, non_blocking=True)
        held["graph"].replay()
        return {key: value.clone() for key, value in held["outputs"].items()}

    def capture(images: Tensor, params: ViewParams) -> dict[str, Tensor]:
        static_images = images.to(device).clone()
        held["inputs"] = (static_images, params)
        g = graph()
        g.warmup(lambda: views.render(static_images, params, dense=True))
        try:
            held["outputs"] = g.capture(lambda: views.render(static_images, params, dense=True))
        except CaptureError as err:
            held["eager_why"] = str(err)
            logging.getLogger("obow").warning(
                "train.compile=graph: the views' render could not be captured as a CUDA graph (%s); it runs eagerly",
                err,
            )
            return err.outputs if err.step_done else views.render(images, params)
        held["graph"] = g
        return {key: value.clone() for key, value in held["outputs"].items()}

    render.kind = "graphed"  # type: ignore[attr-defined]
    return render


def param_tensors(params: Any) -> list[Tensor]:
    """Every tensor of a view-parameter record (nested dataclasses of tensors, ``None`` left out), in order."""
    if isinstance(params, Tensor):
        return [params]
    if params is None:
        return []
    return [t for f in dataclasses.fields(params) for t in param_tensors(getattr(params, f.name))]
