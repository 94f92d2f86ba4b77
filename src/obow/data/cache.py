"""Decode a folder's images once into a ``uint8`` array ``[N, 3, S, S]`` for ``data.pipeline: device``.

The device pipeline (:mod:`obow.data.batched_views`) makes the views of a batch from decoded pixels, so each
image is decoded once per run set-up instead of once per sample. The array is a file in ``data.cache_dir``
(default ``$XDG_CACHE_HOME/obow`` or ``~/.cache/obow``), named by a key of the folder's contents (every image's
relative path, size in bytes and modification time) and the cached size: a later run on the same, unchanged
images reads it back at once; a changed, added or removed file gives another key and the cache is rebuilt (the
cache of the same images' earlier contents is removed). A folder's subsets (``data.images_per_class``) have
caches of their own: the :data:`KEEP_PER_FOLDER` most recently used per folder and size are kept. It is read
into memory when it fits in half of the memory available, memory-mapped otherwise (:attr:`ImageCache.where`
says which, and the run's header prints it).

Every image is stored as a square of ``S`` pixels: its central square, resized with PIL's antialiased bilinear
filter to ``S``. ``S`` is ``data.cache_size`` when set; otherwise the images' own size when they all are squares
of one size (CIFAR-10, the 160 px Imagenette: no resampling at all), else the largest view that the recipe
makes before cropping (``max(views.teacher_resize, views.patch_grid_size)``). Non-square images lose their edges
outside the central square (the worker pipeline's random crops may reach them): the header counts them.
Unreadable files are left out, with one warning that counts them. Tiny images (:data:`~obow.data.folders.TINY_UPSCALE`)
are kept, and the loader names them in its batches, for the run to report each once, as the worker pipeline does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from obow.data.folders import ImageList, load_rgb, tiny_below

log = logging.getLogger("obow")

#: Bumped when the file layout, the decoding or the metadata changes, so that old caches are not read (2: the
#: images' shorter sides recorded).
CACHE_VERSION = 2
#: Caches kept per folder and side: the most recently used ones (a folder's subsets, ``data.images_per_class``,
#: each have their own); older ones, and those of a folder's earlier contents, are removed when one is written.
KEEP_PER_FOLDER = 3


@dataclass
class ImageCache:
    """Decoded images ``pixels`` ``[N, 3, side, side]`` (uint8, CPU; a NumPy array, possibly memory-mapped) of
    ``images`` (the readable ones, in the folder's order), the file they live in, and where they are held;
    ``tiny``: the tiny ones among them for the views the cache was asked for (position -> shorter side)."""

    pixels: np.ndarray
    images: ImageList
    side: int
    file: Path
    where: str  # "memory" or "memory-mapped"
    not_square: int  # images whose edges outside the central square were cut
    tiny: dict[int, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(self.pixels.nbytes)

    def batch(self, indices: torch.Tensor) -> torch.Tensor:
        """The images at ``indices`` as a ``[B, 3, S, S]`` uint8 CPU tensor (a copy)."""
        return torch.from_numpy(np.ascontiguousarray(self.pixels[indices.numpy()]))

    def describe(self) -> str:
        """One line for the run's header: how many images, their size, the bytes held and where."""
        cut = f"; {self.not_square} non-square images cut to their central square" if self.not_square else ""
        cut += f"; {len(self.tiny)} tiny images upscaled" if self.tiny else ""
        return (
            f"{len(self.images)} images decoded to {self.side} px squares, {self.nbytes / 2**20:.0f} MiB "
            f"{'in memory' if self.where == 'memory' else 'memory-mapped'} from {self.file}{cut}"
        )


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "obow"


def contents_key(images: ImageList) -> str:
    """A digest of the images' relative paths, sizes and modification times (any change gives another key)."""
    digest = hashlib.sha256(f"obow-cache-v{CACHE_VERSION}".encode())
    for path in images.paths:
        stat = os.stat(path)
        digest.update(f"{os.path.relpath(path, images.root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def names_key(images: ImageList) -> str:
    """A digest of the images' relative paths alone: the same for a folder's earlier and later contents."""
    digest = hashlib.sha256()
    for path in images.paths:
        digest.update(f"{os.path.relpath(path, images.root)}\n".encode())
    return digest.hexdigest()[:20]


def folder_key(root: str) -> str:
    return hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:12]


def sizes_summary(images: ImageList) -> dict[str, Any]:
    """What the cached side depends on, from the images' headers: ``one_size`` (their side when all are squares of
    one size, else ``None``), ``not_square`` (how many are not square), and ``shorter``: each image's shorter side
    (0 when unreadable), which tells the tiny ones. Reading 50,000 CIFAR-10 headers took 8 s here, so every cache's
    metadata records it and a later run on the same contents reads it from there."""
    sizes: list[tuple[int, int] | None] = []
    for path in images.paths:
        try:
            with Image.open(path) as img:
                sizes.append(img.size)
        except Exception:  # unreadable: left out when decoding, counted there
            sizes.append(None)
    read = [size for size in sizes if size is not None]
    not_square = sum(1 for w, h in read if w != h)
    one_size = read[0][0] if read and not_square == 0 and len(set(read)) == 1 else None
    return {"one_size": one_size, "not_square": not_square, "shorter": [min(s) if s else 0 for s in sizes]}


def choose_side(summary: dict[str, Any], views_side: int, cache_size: int | None) -> int:
    """The cached side ``S`` (see the module's docstring) for images of :func:`sizes_summary` ``summary``."""
    if cache_size is not None:
        return cache_size
    return summary["one_size"] or views_side


def known_summary(folder: Path, prefix: str) -> dict[str, Any] | None:
    """The :func:`sizes_summary` recorded by a cache of the same contents (any side), if there is one."""
    for meta in folder.glob(f"{prefix}-*px.json"):
        with contextlib.suppress(OSError, ValueError):
            sizes = json.loads(meta.read_text()).get("sizes")
            if sizes is not None:
                return sizes
    return None


def _decode(path: str, side: int) -> np.ndarray | None:
    """One image as ``[3, side, side]`` uint8 (its central square resized), or ``None`` when unreadable."""
    try:
        img = load_rgb(path)
    except Exception:
        return None
    w, h = img.size
    edge = min(w, h)
    left, top = (w - edge) // 2, (h - edge) // 2
    square = img.crop((left, top, left + edge, top + edge))
    if edge != side:
        square = square.resize((side, side), Image.Resampling.BILINEAR, reducing_gap=None)
    return np.asarray(square, dtype=np.uint8).transpose(2, 0, 1)


def build_cache(
    images: ImageList,
    views_side: int,
    cache_size: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    tiny_side: int | None = None,
) -> ImageCache:
    """The decoded images of ``images``: read from ``cache_dir`` when a cache of the same contents and size is
    there, else decoded (threads) and written there first. Raises ``ValueError`` (one line) when the folder cannot
    be cached: no readable image, or a cache folder that cannot be written. ``tiny_side``: the side the views are
    made from, which tells the tiny images (:func:`obow.data.folders.tiny_below`; default ``views_side``)."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    prefix = f"{folder_key(images.root)}-{contents_key(images)}"
    sizes = known_summary(folder, prefix) or sizes_summary(images)
    side = choose_side(sizes, views_side, cache_size)
    key = f"{prefix}-{side}px"
    file, meta_file = folder / f"{key}.u8", folder / f"{key}.json"
    if not (file.is_file() and meta_file.is_file()):
        _write_cache(images, side, folder, key, sizes)
    else:
        with contextlib.suppress(OSError):
            os.utime(meta_file)  # used now: the last to be removed
    meta = json.loads(meta_file.read_text())
    kept = meta["kept"]
    shape = (len(kept), 3, side, side)
    nbytes = int(np.prod(shape))
    if nbytes <= available_memory() // 2:
        pixels, where = np.fromfile(file, dtype=np.uint8).reshape(shape), "memory"
    else:
        pixels, where = np.memmap(file, dtype=np.uint8, mode="r", shape=shape), "memory-mapped"
    labels = None if images.labels is None else [images.labels[i] for i in kept]
    readable = replace(images, paths=[images.paths[i] for i in kept], labels=labels)
    below, shorter = tiny_below(views_side if tiny_side is None else tiny_side), sizes["shorter"]
    tiny = {position: shorter[i] for position, i in enumerate(kept) if shorter[i] < below}
    return ImageCache(pixels, readable, side, file, where, sizes["not_square"], tiny)


def _write_cache(images: ImageList, side: int, folder: Path, key: str, sizes: dict[str, Any]) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        names = names_key(images)
        remove_old_caches(folder, f"{folder_key(images.root)}-*-{side}px", KEEP_PER_FOLDER - 1, key, names)
        partial = folder / f"{key}.u8.{os.getpid()}.partial"  # runs that build the same cache at once do not mix
        log.info("Data: decoding %d images of %s into the image cache in %s", len(images), images.root, folder)
        kept: list[int] = []
        with open(partial, "wb") as out, ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            for i, pixels in enumerate(pool.map(lambda p: _decode(p, side), images.paths, chunksize=64)):
                if pixels is not None:
                    out.write(pixels.tobytes())
                    kept.append(i)
    except OSError as err:
        raise ValueError(f"cannot write the image cache in {folder} ({err.strerror}); set data.cache_dir") from err
    if not kept:
        partial.unlink(missing_ok=True)
        raise ValueError(f"no readable image under {images.root}")
    if len(kept) < len(images):
        skipped = sorted(set(range(len(images))) - set(kept))
        log.warning("image cache: %d unreadable images left out (e.g. %s)", len(skipped), images.paths[skipped[0]])
    os.replace(partial, folder / f"{key}.u8")
    meta = {"version": CACHE_VERSION, "root": images.root, "side": side, "names": names, "sizes": sizes, "kept": kept}
    partial_meta = folder / f"{key}.json.{os.getpid()}.partial"
    partial_meta.write_text(json.dumps(meta))
    os.replace(partial_meta, folder / f"{key}.json")  # last: a cache with its list of images is complete


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
