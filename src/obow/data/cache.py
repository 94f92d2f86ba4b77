"""Decode a folder's images once, each whole at its own aspect ratio, for ``data.pipeline: device``.

The device pipeline (:mod:`obow.data.batched_views`) makes the views of a batch from decoded pixels, so each
image is decoded once per run set-up instead of once per sample. The cache is a file in ``data.cache_dir``
(default ``$XDG_CACHE_HOME/obow`` or ``~/.cache/obow``), named by a key of the folder's contents (every image's
relative path, size in bytes and modification time) and the cached side: a later run on the same, unchanged
images reads it back at once; a changed, added or removed file gives another key and the cache is rebuilt (the
cache of the same images' earlier contents is removed). A folder's subsets (``data.images_per_class``) have
caches of their own: the :data:`KEEP_PER_FOLDER` most recently used per folder and side are kept. A cache
written in an older format (:data:`CACHE_VERSION`) is never read: it is removed and rebuilt, in one log line.

Layout: one flat ``uint8`` buffer, each image's ``[3, h, w]`` pixels after the previous one's, with every image's
height and width in the metadata (:attr:`ImageCache.sizes`; the offsets follow). It is read into memory when it
fits in half of the memory available, memory-mapped otherwise (:attr:`ImageCache.where`; the run's header says
which, with its size). :meth:`ImageCache.batch` gathers a batch padded to its largest height and width, the
padding repeating each image's last row and column, so that one batched ``roi_align`` serves every image with
boxes in its own pixels and no box sees another pixel than its image's (``[N, 3, h, w]`` at once when all images
have one size, as CIFAR-10's do: no padding, the gather of a square cache as before).

Every image keeps its whole area, as the worker pipeline sees it, so a crop may reach anywhere in it. Its size:
with ``data.cache_size`` set, every image's shorter side is resized to it; by default an image whose shorter side
is at most the *sharp side* (:func:`sharp_side`: the smallest shorter side at which none of the recipe's views is
upsampled, 654 px for the paper's ImageNet views) is kept as it is, pixel for pixel, and a larger one is reduced
to it (PIL's antialiased bilinear filter): a view of the cache is upsampled exactly when the worker pipeline's
view of the original file is, and a phone photo does not take 36 MB. A cache larger than the free space of its
folder is refused in one line before anything is written. Unreadable files are left out, with one warning that
counts them. Tiny images (:data:`~obow.data.folders.TINY_UPSCALE`) are kept, and the loader names them in its
batches, for the run to report each once, as the worker pipeline does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from obow.data.folders import ImageList, load_rgb, tiny_below
from obow.data.identity import relative

log = logging.getLogger("obow")

#: Bumped when the file layout, the decoding or the metadata changes, so that old caches are not read (2: the
#: images' shorter sides recorded; 3: whole images at their own aspect ratio, one flat buffer, their sizes).
CACHE_VERSION = 3
#: Caches kept per folder and side: the most recently used ones (a folder's subsets, ``data.images_per_class``,
#: each have their own); older ones, and those of a folder's earlier contents, are removed when one is written.
KEEP_PER_FOLDER = 3
#: A box of torchvision's RandomResizedCrop is at least ``sqrt(scale * 3/4)`` of a square image's side.
NARROWEST_RATIO = 3 / 4
#: At most this many pixels are gathered at once when a batch of mixed sizes is padded (the index is 8 bytes each).
GATHER_CHUNK = 1 << 24


def sharp_side(resize: int, crops: Sequence[tuple[int, float]]) -> int:
    """The smallest shorter side of an image from which no view is upsampled: the teacher's ``Resize(resize)`` and
    random-resized ``crops`` of ``(output side, smallest area share)``. A crop of area share ``a`` of a square of
    side ``S`` is at least ``S * sqrt(a * 3/4)`` pixels wide and high (torchvision's rule, aspect ratios from 3/4;
    a longer image only widens it). The paper's views: ``ceil(160 / sqrt(0.08 * 3/4)) = 654`` for its crops, 382
    for its patch grid, 256 for its teacher."""
    return max([resize, *(math.ceil(size / math.sqrt(share * NARROWEST_RATIO)) for size, share in crops)])


def stored_sizes(sizes: np.ndarray, side: int, exact: bool) -> np.ndarray:
    """The ``[N, 2]`` (height, width) each image of ``sizes`` (height, width) is cached at: its shorter side made
    ``side`` (``exact``, ``data.cache_size``) or ``min(side, its own)`` (the default: never enlarged), the longer
    one in proportion (rounded); an image already at that size is kept as it is."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    short = sizes.min(axis=1)
    target = np.full_like(short, side) if exact else np.minimum(short, side)
    scaled = np.maximum(1, np.round(sizes * (target / np.maximum(short, 1))[:, None])).astype(np.int64)
    scaled[np.arange(len(sizes)), sizes.argmin(axis=1)] = target
    return np.where((target == short)[:, None], sizes, scaled)


@dataclass
class ImageCache:
    """Decoded images ``pixels`` (one flat uint8 buffer, CPU; a NumPy array, possibly memory-mapped: each image's
    ``[3, h, w]`` after the previous one's) of ``images`` (the readable ones, in the folder's order), their
    ``sizes`` ``[N, 2]`` (height, width), the side they were cached at (:func:`stored_sizes`; ``exact``: every
    shorter side made ``side``, else at most ``side``), the file they live in and where they are held;
    ``tiny``: the tiny ones among them for the views the cache was asked for (position -> shorter side)."""

    pixels: np.ndarray
    sizes: np.ndarray
    images: ImageList
    side: int
    exact: bool
    file: Path
    where: str  # "memory" or "memory-mapped"
    resized: int  # images whose own size was not kept
    tiny: dict[int, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(self.pixels.nbytes)

    @cached_property
    def offsets(self) -> np.ndarray:
        """Where each image's pixels start in :attr:`pixels`."""
        return np.concatenate([[0], np.cumsum(3 * self.sizes.prod(axis=1))[:-1]]).astype(np.int64)

    @cached_property
    def uniform(self) -> tuple[int, int] | None:
        """The images' (height, width) when all have the same, else ``None``."""
        first = (int(self.sizes[0][0]), int(self.sizes[0][1]))
        return first if bool((self.sizes == self.sizes[0]).all()) else None

    def batch(self, indices: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """The images at ``indices`` (a CPU tensor) as one uint8 tensor ``[B, 3, H, W]``, ``H`` and ``W`` the largest
        height and width among them, each image at the top left, its last row and column repeated beyond (a copy).
        ``source``: :attr:`pixels` as a tensor already on a device (the loader's resident copy; the batch is made
        there), else read from :attr:`pixels` (only the batch's bytes: a memory-mapped cache reads no others)."""
        picked = indices.numpy()
        if self.uniform is not None:
            h, w = self.uniform
            if source is None:
                return torch.from_numpy(np.ascontiguousarray(self.pixels.reshape(-1, 3, h, w)[picked]))
            return source.view(-1, 3, h, w)[indices.to(source.device)]
        sizes = self.sizes[picked]
        if source is None:
            lengths = 3 * sizes.prod(axis=1)
            starts = self.offsets[picked]
            source = torch.from_numpy(
                np.concatenate([self.pixels[s : s + n] for s, n in zip(starts, lengths, strict=True)])
            )
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        else:
            offsets = self.offsets[picked]
        return padded_batch(source, offsets, sizes)

    def describe(self) -> str:
        """One line for the run's header: how many images, at what size, the bytes on disk and where they are held."""
        if self.uniform is not None:
            size = f"{self.uniform[0]}x{self.uniform[1]} px"
        else:
            shorter = self.sizes.min(axis=1)
            size = f"their own aspect ratios, shorter sides {shorter.min()}-{shorter.max()} px"
        rule = f"shorter sides made {self.side} px (data.cache_size)" if self.exact else (
            f"none enlarged, none above {self.side} px on its shorter side, where no view is upsampled"
        )  # fmt: skip
        held = "held in memory" if self.where == "memory" else "memory-mapped, not held in memory"
        notes = f"; {self.resized} resized" if self.resized else ""
        notes += f"; {len(self.tiny)} tiny images upscaled" if self.tiny else ""
        return (
            f"{len(self.images)} images decoded whole at {size} ({rule}), {self.nbytes / 2**20:.0f} MiB on disk, "
            f"{held}, from {self.file}{notes}"
        )


def padded_batch(flat: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray) -> torch.Tensor:
    """Images ``[3, h_i, w_i]`` stored one after another in ``flat`` (from ``offsets``) as ``[B, 3, H, W]`` on
    ``flat``'s device: each at the top left, its last row and column repeated to the largest ``H`` and ``W``
    (so that a bilinear sample near its edge reads its edge, as ``roi_align`` does at a tensor's border). One
    gather of clamped indices, :data:`GATHER_CHUNK` pixels at a time."""
    device = flat.device
    height, width = (int(v) for v in sizes.max(axis=0))
    out = torch.empty(len(sizes), 3, height, width, dtype=flat.dtype, device=device)
    rows = torch.arange(height, device=device).view(1, 1, -1, 1)
    cols = torch.arange(width, device=device).view(1, 1, 1, -1)
    channel = torch.arange(3, device=device).view(1, 3, 1, 1)
    step = max(1, GATHER_CHUNK // (3 * height * width))
    for start in range(0, len(sizes), step):
        part = torch.from_numpy(np.ascontiguousarray(sizes[start : start + step])).to(device).view(-1, 2, 1, 1, 1)
        h, w = part[:, 0], part[:, 1]
        first = torch.from_numpy(np.asarray(offsets[start : start + step], dtype=np.int64)).to(device)
        index = first.view(-1, 1, 1, 1) + channel * h * w + torch.minimum(rows, h - 1) * w + torch.minimum(cols, w - 1)
        out[start : start + step] = flat[index]
    return out


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "obow"


def contents_key(images: ImageList) -> str:
    """A digest of the images' relative paths, sizes and modification times (any change gives another key)."""
    digest = hashlib.sha256(f"obow-cache-v{CACHE_VERSION}".encode())
    prefix = os.path.join(images.root, "")
    for path in images.paths:
        stat = os.stat(path)
        digest.update(f"{relative(path, images.root, prefix)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def names_key(images: ImageList) -> str:
    """A digest of the images' relative paths alone: the same for a folder's earlier and later contents."""
    digest = hashlib.sha256()
    prefix = os.path.join(images.root, "")
    for path in images.paths:
        digest.update(f"{relative(path, images.root, prefix)}\n".encode())
    return digest.hexdigest()[:20]


def folder_key(root: str) -> str:
    return hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:12]


def sizes_summary(images: ImageList) -> dict[str, Any]:
    """Every image's ``[height, width]`` from its header (``[0, 0]`` when unreadable): what the cache's size and the
    tiny images are known from before decoding. Reading 50,000 CIFAR-10 headers took 8 s here, so every cache's
    metadata records it and a later run on the same contents reads it from there."""
    sizes: list[list[int]] = []
    for path in images.paths:
        try:
            with Image.open(path) as img:
                sizes.append([img.height, img.width])
        except Exception:  # unreadable: left out when decoding, counted there
            sizes.append([0, 0])
    return {"sizes": sizes}


def known_summary(folder: Path, prefix: str) -> dict[str, Any] | None:
    """The :func:`sizes_summary` recorded by a cache of the same contents (any side), if there is one."""
    for meta in folder.glob(f"{prefix}-*px.json"):
        with contextlib.suppress(OSError, ValueError):
            sizes = json.loads(meta.read_text()).get("sizes")
            if sizes is not None:
                return sizes
    return None


def _decode(path: str, side: int, exact: bool) -> np.ndarray | None:
    """One image as ``[3, h, w]`` uint8 at its cached size (:func:`stored_sizes`), or ``None`` when unreadable."""
    try:
        img = load_rgb(path)
    except Exception:
        return None
    height, width = stored_sizes(np.array([img.height, img.width]), side, exact)[0]
    if (height, width) != (img.height, img.width):
        img = img.resize((int(width), int(height)), Image.Resampling.BILINEAR, reducing_gap=None)
    return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)


def build_cache(
    images: ImageList,
    side: int,
    cache_size: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    tiny_side: int | None = None,
) -> ImageCache:
    """The decoded images of ``images``: read from ``cache_dir`` when a cache of the same contents and size is
    there, else decoded (threads) and written there first. ``side``: the default cap on every image's shorter
    side (:func:`sharp_side` of the recipe's views); ``cache_size`` (``data.cache_size``), when set, the shorter
    side every image is resized to. Raises ``ValueError`` (one line) when the folder cannot be cached: no readable
    image, a cache folder that cannot be written, or too little space there. ``tiny_side``: the side the views are
    made from, which tells the tiny images (:func:`obow.data.folders.tiny_below`; default ``side``)."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    prefix = f"{folder_key(images.root)}-{contents_key(images)}"
    summary = known_summary(folder, prefix) or sizes_summary(images)
    exact = cache_size is not None
    side = cache_size if cache_size is not None else side
    key = f"{prefix}-{'' if exact else 'upto'}{side}px"
    file, meta_file = folder / f"{key}.u8", folder / f"{key}.json"
    if not (file.is_file() and meta_file.is_file()):
        _write_cache(images, side, exact, folder, key, summary)
    else:
        with contextlib.suppress(OSError):
            os.utime(meta_file)  # used now: the last to be removed
    meta = json.loads(meta_file.read_text())
    kept, sizes = meta["kept"], np.asarray(meta["stored"], dtype=np.int64).reshape(-1, 2)
    nbytes = int(3 * sizes.prod(axis=1).sum())
    if nbytes <= available_memory() // 2:
        pixels, where = np.fromfile(file, dtype=np.uint8), "memory"
    else:
        pixels, where = np.memmap(file, dtype=np.uint8, mode="r", shape=(nbytes,)), "memory-mapped"
    labels = None if images.labels is None else [images.labels[i] for i in kept]
    readable = replace(images, paths=[images.paths[i] for i in kept], labels=labels)
    own = np.asarray(summary["sizes"], dtype=np.int64).reshape(-1, 2)[kept]
    resized = int((np.sort(own, axis=1) != np.sort(sizes, axis=1)).any(axis=1).sum())  # EXIF may turn an image
    below = tiny_below(side if tiny_side is None else tiny_side)
    tiny = {position: int(own[position].min()) for position in range(len(kept)) if own[position].min() < below}
    return ImageCache(pixels, sizes, readable, side, exact, file, where, resized, tiny)


def _write_cache(images: ImageList, side: int, exact: bool, folder: Path, key: str, summary: dict[str, Any]) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        names = names_key(images)
        remove_older_formats(folder, folder_key(images.root))
        same_side = f"{folder_key(images.root)}-*-{key.split('-', 2)[2]}"
        remove_old_caches(folder, same_side, KEEP_PER_FOLDER - 1, key, names)
        expected = int(3 * stored_sizes(np.asarray(summary["sizes"]), side, exact).prod(axis=1).sum())
        free = shutil.disk_usage(folder).free
        if expected > free:
            raise ValueError(
                f"the image cache of {len(images)} images would take {expected / 2**30:.1f} GiB, more than the "
                f"{free / 2**30:.1f} GiB free in {folder}; set data.cache_dir, a smaller data.cache_size, or "
                "data.pipeline=workers"
            )
        partial = folder / f"{key}.u8.{os.getpid()}.partial"  # runs that build the same cache at once do not mix
        log.info("Data: decoding %d images of %s into the image cache in %s", len(images), images.root, folder)
        kept: list[int] = []
        stored: list[list[int]] = []
        with open(partial, "wb") as out, ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            for i, pixels in enumerate(pool.map(lambda p: _decode(p, side, exact), images.paths, chunksize=64)):
                if pixels is not None:
                    out.write(pixels.tobytes())
                    kept.append(i)
                    stored.append(list(pixels.shape[1:]))
    except OSError as err:
        raise ValueError(f"cannot write the image cache in {folder} ({err.strerror}); set data.cache_dir") from err
    if not kept:
        partial.unlink(missing_ok=True)
        raise ValueError(f"no readable image under {images.root}")
    if len(kept) < len(images):
        skipped = sorted(set(range(len(images))) - set(kept))
        log.warning("image cache: %d unreadable images left out (e.g. %s)", len(skipped), images.paths[skipped[0]])
    os.replace(partial, folder / f"{key}.u8")
    meta = {
        "version": CACHE_VERSION, "root": images.root, "side": side, "exact": exact, "names": names,
        "sizes": summary, "kept": kept, "stored": stored,
    }  # fmt: skip
    partial_meta = folder / f"{key}.json.{os.getpid()}.partial"
    partial_meta.write_text(json.dumps(meta))
    os.replace(partial_meta, folder / f"{key}.json")  # last: a cache with its list of images is complete


def remove_older_formats(folder: Path, folder_prefix: str) -> None:
    """Remove the caches of a folder (``folder_prefix``, :func:`folder_key`) written in an older format than
    :data:`CACHE_VERSION` (never read: their keys differ), saying so in one line."""
    old: dict[str, Any] = {}
    for meta in folder.glob(f"{folder_prefix}-*.json"):
        with contextlib.suppress(OSError, ValueError):
            version = json.loads(meta.read_text()).get("version")
            if version != CACHE_VERSION:
                old[meta.name[: -len(".json")]] = version
    if old:
        log.info(
            "image cache: %d cache(s) of this folder in an older format (version %s) removed from %s; it is "
            "rebuilt as version %d (whole images)",
            len(old), ", ".join(sorted({str(v) for v in old.values()})), folder, CACHE_VERSION,
        )  # fmt: skip
        for path in folder.glob(f"{folder_prefix}-*"):
            if path.name.split(".")[0] in old:
                path.unlink(missing_ok=True)


def remove_old_caches(folder: Path, pattern: str, keep: int, current: str, names: str) -> None:
    """Before cache ``current`` (of the image list ``names``, :func:`names_key`) is written: remove the other
    caches named ``pattern`` in ``folder`` that hold the same list's earlier contents, or that are incomplete
    (no metadata file), and of the rest all but the ``keep`` most recently used (by their metadata file's
    modification time). Nothing of ``current`` is touched (another process may be writing it too)."""

    def other_list(meta: Path) -> bool:
        try:
            return json.loads(meta.read_text()).get("names") != names
        except (OSError, ValueError):
            return False

    metas = [m for m in folder.glob(f"{pattern}.json") if not m.name.startswith(current) and other_list(m)]
    metas.sort(key=lambda m: m.stat().st_mtime_ns, reverse=True)
    kept = {current} | {m.name[: -len(".json")] for m in metas[:keep]}
    for path in folder.glob(f"{pattern}.*"):
        if path.name.split(".")[0] not in kept:
            path.unlink(missing_ok=True)


def available_memory() -> int:
    """Bytes of memory available now (``MemAvailable``), or the physical memory when that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
