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
padding repeating each image's last row and column, so that one batched render serves every image with boxes in
its own pixels (the render's resampling weights never reach past an image's own size, so the padding is never
read: :mod:`obow.data.batched_views`; ``[N, 3, h, w]`` at once when all images have one size, as CIFAR-10's do:
no padding, the gather of a square cache as before).

Every image keeps its whole area, as the worker pipeline sees it, so a crop may reach anywhere in it. Its size: with
``data.cache_size`` set, every image's shorter side is resized to it; by default an image whose shorter side is at
most the *sharp side* (:func:`sharp_side`: the smallest shorter side at which none of the recipe's views is
upsampled, 654 px for the paper's ImageNet views) is kept as it is, pixel for pixel, and a larger one is reduced to
it (PIL's antialiased bilinear filter): a view of the cache is upsampled exactly when the worker pipeline's view of
the original file is, and a phone photo does not take 36 MB. A JPEG of at least twice that side is first decoded at
libjpeg's reduced scale that keeps it above the side, as the worker pipeline decodes it, then resized: the same
stored size, 6-9x faster for a 12 MP photo (``benchmarks/photo_decoding.py``). A cache larger than the free space of
its folder is refused in one line before anything is written. Unreadable files are left out, with one warning that
counts them by reason; the cache records each with its reason (:func:`~obow.data.decode.unreadable_reason`) and the
loader names them in its batches, so that a run counts the same ``skipped_images`` as the worker pipeline does. Tiny
images (:data:`~obow.data.folders.TINY_UPSCALE`) are kept, and the loader names them in its batches, for the run to
report each once, as the worker pipeline does.

Integrity. The metadata records the file's size and a CRC-32 of every :data:`BLOCK_BYTES` block, computed as the
block is first written. A cache is checked when it is opened: its size against the metadata's (a truncated file),
then, for a cache read into memory, each block's checksum as the block is read (one read of the file, the only
one: the check is a CRC-32 pass over bytes already in memory, by threads while the next blocks are read). A
memory-mapped cache, larger than half the memory, is not read at open (that is its point): each block is checked
the first time a batch reads from it (:meth:`ImageCache.batch`), or as it is copied to the GPU. CRC-32 detects any
damage a disk or a stray write makes (a burst of up to 32 bits always; anything else but for one chance in 2^32 per
block); it is no defence against a deliberate forgery (whoever can write the cache can write its metadata too),
nor needs to be. A cache that does not match is removed and rebuilt, in one line; found damaged in the middle of
a run, it is rebuilt then and the run goes on. A build is atomic: the pixels are written to
``<key>.u8.<pid>.partial``, renamed when complete, and the metadata written last. A build stopped by SIGINT,
SIGTERM or SIGHUP removes its partial file and says so in one line, then stops as the signal would have stopped it
(:func:`stopped_by_signals`); a partial file left by a build killed outright (``kill -9``) is removed by the next
build, in one line (:func:`remove_stopped_builds`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import multiprocessing
import os
import shutil
import signal
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from obow.data.decode import load_rgb_resized, unreadable_reason
from obow.data.folders import (
    ImageList,
    forks_workers,
    max_decoding_workers,
    tiny_below,
)
from obow.data.identity import relative
from obow.notices import counted

log = logging.getLogger("obow")

#: Bumped when the file layout, the decoding or the metadata changes, so that old caches are not read (2: the
#: images' shorter sides recorded; 3: whole images at their own aspect ratio, one flat buffer, their sizes; 4: the
#: file's size and its blocks' checksums, the images left out with their reasons).
CACHE_VERSION = 4
#: The cache file is checked in blocks of this many bytes (a CRC-32 each): a memory-mapped cache checks a block the
#: first time a batch reads from it, so a block is small next to a file, large next to an image.
BLOCK_BYTES = 4 << 20
#: A partial file (a build's) unchanged for this long is left over even if its process number is alive (it may be
#: another machine's, on a shared folder, or a number used again): the next build removes it.
STALE_PARTIAL_S = 3600.0
#: The signals that stop a build (:func:`stopped_by_signals`): Ctrl-C, ``kill``'s and schedulers' SIGTERM, SIGHUP.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Caches kept per folder and side: the most recently used ones (a folder's subsets, ``data.images_per_class``,
#: each have their own); older ones, and those of a folder's earlier contents, are removed when one is written.
KEEP_PER_FOLDER = 3
#: A box of torchvision's RandomResizedCrop is at least ``sqrt(scale * 3/4)`` of a square image's side.
NARROWEST_RATIO = 3 / 4
#: At most this many pixels are gathered at once when a batch of mixed sizes is padded (the index is 8 bytes each).
GATHER_CHUNK = 1 << 24


class CacheDamaged(ValueError):
    """A cache file that does not match its metadata (size or a block's checksum), or metadata that does not read."""


def human_bytes(n: float) -> str:
    """``n`` bytes in the unit a reader expects: ``1.5 GiB``, ``694 MiB``, ``37.5 MiB``, ``12.0 KiB``, ``100 bytes``
    (a tenth shown under 100 of the unit)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.{0 if n >= 100 * size else 1}f} {unit}"
    return f"{int(n)} bytes"


def block_checksums(data: bytes | memoryview, block: int | None = None) -> list[int]:
    """The CRC-32 of every ``block`` (default :data:`BLOCK_BYTES`) bytes of ``data`` (the last block shorter)."""
    block = block or BLOCK_BYTES
    view = memoryview(data).cast("B")
    return [zlib.crc32(view[start : start + block]) for start in range(0, len(view), block)]


class BlockDigest:
    """Running :func:`block_checksums` of bytes written one piece after another (each piece split at the block
    boundaries it crosses), so that a build digests what it writes as it writes it."""

    def __init__(self, block: int | None = None) -> None:
        self.block, self.crc, self.filled = block or BLOCK_BYTES, 0, 0
        self.sums: list[int] = []

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block - self.filled)
            self.crc = zlib.crc32(view[:take], self.crc)
            self.filled += take
            view = view[take:]
            if self.filled == self.block:
                self.sums.append(self.crc)
                self.crc, self.filled = 0, 0

    def digest(self) -> list[int]:
        return self.sums + ([self.crc] if self.filled else [])


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
    #: the images of the folder left out, each with why (:func:`~obow.data.decode.unreadable_reason`)
    left_out: list[tuple[str, str]] = field(default_factory=list)
    #: the CRC-32 of every ``block`` bytes of :attr:`pixels` and which blocks were checked against it
    checksums: list[int] = field(default_factory=list)
    block: int = BLOCK_BYTES
    checked: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    #: builds the cache again (its file removed first), for one found damaged in the middle of a run
    rebuild: Callable[[], ImageCache] | None = None

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
                length = np.full(len(picked), 3 * h * w, dtype=np.int64)
                if not self.check_blocks(picked.astype(np.int64) * length, length):
                    return self.batch(indices)
                return torch.from_numpy(np.ascontiguousarray(self.pixels.reshape(-1, 3, h, w)[picked]))
            return source.view(-1, 3, h, w)[indices.to(source.device)]
        sizes = self.sizes[picked]
        if source is None:
            lengths = 3 * sizes.prod(axis=1)
            starts = self.offsets[picked]
            if not self.check_blocks(starts, lengths):  # rebuilt: the same images, read again
                return self.batch(indices)
            source = torch.from_numpy(
                np.concatenate([self.pixels[s : s + n] for s, n in zip(starts, lengths, strict=True)])
            )
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        else:
            offsets = self.offsets[picked]
        return padded_batch(source, offsets, sizes)

    def check_blocks(self, starts: np.ndarray, lengths: np.ndarray) -> bool:
        """Check the blocks of :attr:`pixels` that bytes ``[start, start + length)`` lie in against their checksums,
        those not checked yet (a memory-mapped cache's, read the first time here). ``False`` when one did not
        match: the cache was then rebuilt (:attr:`rebuild`, in one line) and its pixels replaced, to be read
        again; a ``ValueError`` (one line) when it cannot be, the images having changed since it was opened."""
        if self.checked.all() or not len(starts):
            return True
        first, last = starts // self.block, (starts + np.maximum(lengths, 1) - 1) // self.block
        wanted = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last, strict=True)]))
        for b in wanted[~self.checked[wanted]]:
            if zlib.crc32(self.pixels[b * self.block : (b + 1) * self.block].data) != self.checksums[b]:
                self._rebuild(f"block {b + 1} of {len(self.checksums)} does not match its checksum")
                return False
            self.checked[b] = True
        return True

    def checked_blocks(self) -> Iterator[tuple[int, np.ndarray]]:
        """``(offset, bytes)`` of every block of :attr:`pixels`, in order, each checked against its checksum first
        (once): what the loader copies to the GPU, reading the file once. A block that does not match rebuilds
        the cache (:meth:`check_blocks`) and the blocks start over from the new file's first."""
        b = 0
        while b < len(self.checksums):
            start = b * self.block
            chunk = self.pixels[start : start + self.block]
            if not self.check_blocks(np.array([start]), np.array([len(chunk)])):
                b = 0
                continue
            yield start, chunk
            b += 1

    def _rebuild(self, why: str) -> None:
        if self.rebuild is None:
            raise CacheDamaged(f"the image cache {self.file} is damaged ({why}); remove it to rebuild it")
        log.warning("image cache %s is damaged (%s), changed on disk since it was opened: rebuilt", self.file, why)
        self.file.unlink(missing_ok=True)
        self.file.with_suffix(".json").unlink(missing_ok=True)
        new = self.rebuild()
        if new.images.paths != self.images.paths or not np.array_equal(new.sizes, self.sizes):
            raise ValueError(
                f"the image cache {self.file} was damaged in the middle of the run and the images under "
                f"{self.images.root} changed since it started: run the same command again (it resumes from the "
                "last checkpoint)"
            )
        self.pixels, self.file, self.where = new.pixels, new.file, new.where
        self.checksums, self.block, self.checked = new.checksums, new.block, new.checked

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
            f"{len(self.images)} images decoded whole at {size} ({rule}), {human_bytes(self.nbytes)} on disk, "
            f"{held}, from {self.file}{notes}"
        )


def padded_batch(flat: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray) -> torch.Tensor:
    """Images ``[3, h_i, w_i]`` stored one after another in ``flat`` (from ``offsets``) as ``[B, 3, H, W]`` on
    ``flat``'s device: each at the top left, its last row and column repeated to the largest ``H`` and ``W``
    (the render gives the padding no weight; repeated edges keep it finite and plain to look at). One gather of
    clamped indices, :data:`GATHER_CHUNK` pixels at a time."""
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
        line = f"{relative(path, images.root, prefix)}\0{stat.st_size}\0{stat.st_mtime_ns}\n"
        digest.update(line.encode("utf-8", "surrogateescape"))  # a name in no UTF-8 (an old archive's): its bytes
    return digest.hexdigest()[:20]


def names_key(images: ImageList) -> str:
    """A digest of the images' relative paths alone: the same for a folder's earlier and later contents."""
    digest = hashlib.sha256()
    prefix = os.path.join(images.root, "")
    for path in images.paths:
        digest.update(f"{relative(path, images.root, prefix)}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:20]


def folder_key(root: str) -> str:
    return hashlib.sha256(os.path.realpath(root).encode("utf-8", "surrogateescape")).hexdigest()[:12]


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
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sizes = json.loads(meta.read_text()).get("sizes")
            if sizes is not None:
                return sizes
    return None


def _decode(path: str, side: int, exact: bool, reduced: bool = True) -> tuple[np.ndarray | None, str]:
    """One image as ``[3, h, w]`` uint8 at its cached size (:func:`stored_sizes` of its whole size), or ``None`` and
    why it cannot be used (:func:`~obow.data.decode.unreadable_reason`). ``reduced``: a JPEG of at least twice that
    size is decoded at libjpeg's reduced scale first (:func:`~obow.data.decode.load_rgb_resized`)."""

    def size_of(width: int, height: int) -> tuple[int, int]:
        stored_height, stored_width = stored_sizes(np.array([height, width]), side, exact)[0]
        return int(stored_width), int(stored_height)

    try:
        img = load_rgb_resized(path, size_of, reduced)
    except Exception as err:
        return None, unreadable_reason(err)
    return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1), ""


#: A folder of at least this many images is decoded by worker processes (:func:`decoded_in_order`); a smaller one in
#: the calling thread, where a pool's start would cost more than it saves.
PROCESS_MIN_IMAGES = 4096
#: The most images a worker process decodes per task: many enough that a task's round trip is a small part of its
#: time (a 32 px image decodes in about 0.2 ms)...
CHUNK_IMAGES = 256
#: ... and about the most bytes of decoded pixels per task, by the folder's mean image: with two tasks per worker
#: ahead of the writer, 16 workers hold about 512 MiB ahead.
CHUNK_BYTES = 16 << 20


def chunk_images(image_bytes: int) -> int:
    """Images per decoding task for images of ``image_bytes`` decoded bytes on average (:data:`CHUNK_IMAGES`,
    :data:`CHUNK_BYTES`)."""
    return max(1, min(CHUNK_IMAGES, CHUNK_BYTES // max(1, image_bytes)))


def _decode_chunk(paths: Sequence[str], side: int, exact: bool) -> list[tuple[np.ndarray | None, str]]:
    return [_decode(path, side, exact) for path in paths]


def _ignore_stop_signals() -> None:
    """A decoding worker leaves the stop signals to the building process, which says one line and shuts the pool
    down (a terminal's Ctrl-C reaches the whole process group; no worker prints its own traceback). The signals are
    blocked in it from its fork (:func:`decoded_in_order`); ignored too, should anything unblock them."""
    for signum in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if signum is not None:
            signal.signal(signum, signal.SIG_IGN)


def decoding_pool(workers: int) -> ProcessPoolExecutor | None:
    """``workers`` decoding processes forked from this one (as PyTorch's DataLoader starts its workers on Linux):
    they run Pillow and NumPy only, and a fork imports nothing again and never runs the caller's ``__main__``
    (a spawned worker would: a script without a ``__main__`` guard would start over in each). ``None`` where the
    platform does not fork them (:func:`obow.data.folders.forks_workers`; the images are then decoded in the calling
    thread)."""
    if not forks_workers():
        return None
    context = multiprocessing.get_context("fork")
    return ProcessPoolExecutor(workers, mp_context=context, initializer=_ignore_stop_signals)


def decoded_in_order(
    paths: Sequence[str], side: int, exact: bool, workers: int, image_bytes: int | None = None
) -> Generator[tuple[np.ndarray | None, str], None, None]:
    """:func:`_decode` of every path, in order: by ``workers`` processes (:func:`decoding_pool`) for a folder of
    :data:`PROCESS_MIN_IMAGES` or more, in chunks (:func:`chunk_images` of ``image_bytes``, the images' mean decoded
    size; unknown: an image of ``side`` x 2 ``side``), at most two chunks per worker ahead of
    the caller (not the whole folder decoded into memory while the file is written); else one by one here. A
    thread pool was measured slower than one thread (Python holds its lock through most of a small image's
    decoding): CIFAR-10's 50,000 images took 20.3 s with 8 threads and 8.1-8.6 s with one, on 2 cores. The chunks not
    started yet are dropped when the caller stops (a signal)."""
    pool = decoding_pool(workers) if workers >= 2 and len(paths) >= PROCESS_MIN_IMAGES else None
    if pool is None:
        for path in paths:
            yield _decode(path, side, exact)
        return
    pending: deque[Future] = deque()
    size = chunk_images(image_bytes if image_bytes is not None else 6 * side * side)
    chunks = [list(paths[start : start + size]) for start in range(0, len(paths), size)]
    try:
        # the first task forks every worker: a stop signal raised in the middle of a fork would be lost (Python
        # ignores an exception in its fork hooks), so the stop signals wait until the workers are started (the
        # workers keep them blocked: the building process alone answers them)
        stops = {signal.SIGINT, signal.SIGTERM} | ({signal.SIGHUP} if hasattr(signal, "SIGHUP") else set())
        before = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        try:
            pending.append(pool.submit(_decode_chunk, chunks[0], side, exact))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        for chunk in chunks[1:]:
            pending.append(pool.submit(_decode_chunk, chunk, side, exact))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def build_cache(
    images: ImageList,
    side: int,
    cache_size: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    tiny_side: int | None = None,
) -> ImageCache:
    """The decoded images of ``images``: read from ``cache_dir`` when a cache of the same contents and size is
    there and matches its metadata, else decoded (by worker processes for a large folder) and written there first
    (a damaged one is removed and rebuilt, in one line). ``side``: the default cap on every image's shorter side
    (:func:`sharp_side` of the recipe's views); ``cache_size`` (``data.cache_size``), when set, the shorter side
    every image is resized to. Raises ``ValueError`` (one line) when the folder cannot be cached: no readable
    image, a cache folder that cannot be written, or too little space there. ``tiny_side``: the side the views are
    made from, which tells the tiny images (:func:`obow.data.folders.tiny_below`; default ``side``)."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    prefix = f"{folder_key(images.root)}-{contents_key(images)}"
    try:
        with stopped_by_signals():  # the headers of a large folder take minutes
            summary = known_summary(folder, prefix) or sizes_summary(images)
    except BuildStopped as stopped:
        log.warning("%s: the image cache build stopped while reading the images' sizes; nothing was written", stopped)
        pass_on(stopped)
    exact = cache_size is not None
    side = cache_size if cache_size is not None else side
    key = f"{prefix}-{'' if exact else 'upto'}{side}px"
    file, meta_file = folder / f"{key}.u8", folder / f"{key}.json"
    built = False
    if not (file.is_file() and meta_file.is_file()):
        _write_cache(images, side, exact, folder, key, summary)
        built = True
    else:
        with contextlib.suppress(OSError):
            os.utime(meta_file)  # used now: the last to be removed
    try:
        meta, pixels, where, checked = open_cache(file, meta_file)
    except CacheDamaged as err:
        if built:
            raise ValueError(f"the image cache just written in {folder} does not read back ({err})") from None
        log.warning("image cache %s is damaged (%s): removed and rebuilt", file, err)
        file.unlink(missing_ok=True)
        meta_file.unlink(missing_ok=True)
        return build_cache(images, side, cache_size, cache_dir, tiny_side)
    kept, sizes = meta["kept"], np.asarray(meta["stored"], dtype=np.int64).reshape(-1, 2)
    labels = None if images.labels is None else [images.labels[i] for i in kept]
    readable = replace(images, paths=[images.paths[i] for i in kept], labels=labels)
    own = np.asarray(summary["sizes"], dtype=np.int64).reshape(-1, 2)[kept]
    resized = int((np.sort(own, axis=1) != np.sort(sizes, axis=1)).any(axis=1).sum())  # EXIF may turn an image
    below = tiny_below(side if tiny_side is None else tiny_side)
    tiny = {position: int(own[position].min()) for position in range(len(kept)) if own[position].min() < below}
    left_out = [(images.paths[i], str(why)) for i, why in meta["left_out"]]
    sums, block = meta["crc32"], meta["block"]
    cache = ImageCache(pixels, sizes, readable, side, exact, file, where, resized, tiny, left_out, sums, block, checked)
    cache.rebuild = lambda: build_cache(images, side, cache_size, cache_dir, tiny_side)
    return cache


#: What the metadata of a cache must hold, and of what type, to be read (else the cache is rebuilt).
META_KEYS = {"kept": list, "stored": list, "left_out": list, "bytes": int, "block": int, "crc32": list}


def open_cache(file: Path, meta_file: Path) -> tuple[dict[str, Any], np.ndarray, str, np.ndarray]:
    """A cache's metadata, its pixels (read into memory when they fit in half of the memory available, else
    memory-mapped), where they are held, and which blocks were checked against their checksums (all of them for
    a cache read into memory: each as it is read). Raises :class:`CacheDamaged` when the metadata does not read,
    the file's size is not the one it records, or a block read does not match its checksum."""
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:
        raise CacheDamaged(f"its metadata {meta_file.name} does not read: {err}") from None
    if not isinstance(meta, dict) or any(not isinstance(meta.get(k), t) for k, t in META_KEYS.items()):
        raise CacheDamaged(f"its metadata {meta_file.name} lacks what it should hold")
    nbytes, block, sums = meta["bytes"], meta["block"], meta["crc32"]
    stored = np.asarray(meta["stored"], dtype=np.int64).reshape(-1, 2)
    if nbytes != int(3 * stored.prod(axis=1).sum()) or block < 1 or len(sums) != -(-nbytes // block):
        raise CacheDamaged(f"its metadata {meta_file.name} does not add up")
    try:
        size = file.stat().st_size
    except OSError as err:
        raise CacheDamaged(f"{err.strerror}") from None
    if size != nbytes:
        raise CacheDamaged(f"{size:,} bytes where its metadata says {nbytes:,}: truncated or written over")
    checked = np.zeros(len(sums), dtype=bool)
    if nbytes > available_memory() // 2:
        return meta, np.memmap(file, dtype=np.uint8, mode="r", shape=(nbytes,)), "memory-mapped", checked
    pixels = np.empty(nbytes, dtype=np.uint8)
    # each block's checksum computed by threads (zlib releases the GIL) while the next blocks are read
    with open(file, "rb", buffering=0) as f, ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        crcs = []
        for start in range(0, nbytes, block):
            view = pixels[start : start + block].data
            filled = 0
            while filled < len(view):
                got = f.readinto(view[filled:])
                if not got:
                    raise CacheDamaged(f"it ends at byte {start + filled:,}, before its {nbytes:,} bytes")
                filled += got
            crcs.append(pool.submit(zlib.crc32, view))
        for b, crc in enumerate(crcs):
            if crc.result() != sums[b]:
                raise CacheDamaged(f"block {b + 1} of {len(sums)} does not match its checksum")
    checked[:] = True
    return meta, pixels, "memory", checked


class BuildStopped(KeyboardInterrupt):
    """A build stopped by ``signum`` (:func:`stopped_by_signals`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """While the block runs, SIGINT, SIGTERM and SIGHUP (:data:`STOP_SIGNALS`, those not ignored: under ``nohup``
    SIGHUP stays ignored) raise :class:`BuildStopped` at once, for the block to clean up, then pass the signal on:
    :func:`pass_on` does what the signal would have done (a signal's default stops the process with its exit
    code, 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP; a handler of the caller's is called). A second signal
    while the first is handled is noted, not raised again. Outside the main thread, signals are left alone."""
    stopping: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        if not stopping:
            stopping.append(signum)
            raise BuildStopped(signum)

    try:
        previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def pass_on(stopped: BuildStopped) -> None:
    """What ``stopped``'s signal would have done without :func:`stopped_by_signals` (its handlers restored): its
    default ends the process with the shell's code for it (``SystemExit``, so that what encloses the build
    still cleans up: a run folder's lock), Python's SIGINT handler raises ``KeyboardInterrupt``, a handler of
    the caller's is called; then ``stopped`` is raised."""
    handler = signal.getsignal(stopped.signum)
    if handler is signal.SIG_DFL:
        raise SystemExit(128 + stopped.signum) from None
    if callable(handler):
        handler(stopped.signum, None)
    raise stopped


def remove_stopped_builds(folder: Path, pattern: str) -> None:
    """Remove the partial files (``<key>.u8.<pid>.partial``) named ``pattern`` in ``folder`` that no build is
    writing: their process is gone (a build killed outright, ``kill -9``, a crash), or they have not changed in
    :data:`STALE_PARTIAL_S` seconds; one line says so."""
    removed = []
    for path in folder.glob(f"{pattern}.*.partial"):
        pid_text = path.name.split(".")[-2]
        try:
            age = time.time() - path.stat().st_mtime
        except OSError:
            continue
        if pid_text.isdigit() and process_alive(int(pid_text)) and age < STALE_PARTIAL_S:
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    if removed:
        log.info(
            "image cache: %s of a build stopped before it finished removed from %s (e.g. %s)",
            counted(len(removed), "partial file"), folder, removed[0].name,
        )  # fmt: skip


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    except OSError:
        return False
    return True


def left_out_line(left_out: list[tuple[str, str]]) -> str:
    """``3 images left out (2 not an image Pillow can identify, 1 over Pillow's decompression-bomb limit), e.g.
    a/x.png: <why>``: counted by reason (its words before a parenthesis), the first named with its whole reason."""
    kinds = Counter(why.split(" (")[0] for _, why in left_out)
    said = ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())
    return f"{counted(len(left_out), 'image')} left out ({said}), e.g. {left_out[0][0]}: {left_out[0][1]}"


def _write_cache(images: ImageList, side: int, exact: bool, folder: Path, key: str, summary: dict[str, Any]) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        names = names_key(images)
        remove_older_formats(folder, folder_key(images.root))
        remove_stopped_builds(folder, f"{folder_key(images.root)}-*")
        same_side = f"{folder_key(images.root)}-*-{key.split('-', 2)[2]}"
        remove_old_caches(folder, same_side, KEEP_PER_FOLDER - 1, key, names)
        expected = int(3 * stored_sizes(np.asarray(summary["sizes"]), side, exact).prod(axis=1).sum())
        free = shutil.disk_usage(folder).free
        if expected > free:
            raise ValueError(
                f"the image cache of {len(images)} images would take {human_bytes(expected)}, more than the "
                f"{human_bytes(free)} free in {folder}; set data.cache_dir, a smaller data.cache_size, or "
                "data.pipeline=workers"
            )
    except OSError as err:
        raise ValueError(f"cannot write the image cache in {folder} ({err.strerror}); set data.cache_dir") from err
    partial = folder / f"{key}.u8.{os.getpid()}.partial"  # runs that build the same cache at once do not mix
    log.info("Data: decoding %d images of %s into the image cache in %s", len(images), images.root, folder)
    kept: list[int] = []
    stored: list[list[int]] = []
    left_out: list[list[Any]] = []
    digest = BlockDigest()
    try:
        with (
            stopped_by_signals(),
            open(partial, "wb") as out,
            contextlib.closing(
                decoded_in_order(images.paths, side, exact, max_decoding_workers(), expected // max(1, len(images)))
            ) as decoded,
        ):
            for i, (pixels, why) in enumerate(decoded):
                if pixels is None:
                    left_out.append([i, why])
                    continue
                data = pixels.tobytes()
                out.write(data)
                digest.update(data)
                kept.append(i)
                stored.append(list(pixels.shape[1:]))
    except BuildStopped as stopped:
        partial.unlink(missing_ok=True)
        log.warning(
            "%s: the image cache build stopped after %d of %d images; its partial file is removed, nothing is "
            "kept (the same command decodes them again)",
            stopped.args[0], len(kept) + len(left_out), len(images),
        )  # fmt: skip
        pass_on(stopped)
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise ValueError(f"cannot write the image cache in {folder} ({err.strerror}); set data.cache_dir") from err
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    named = [(images.paths[i], why) for i, why in left_out]
    if not kept:
        partial.unlink(missing_ok=True)
        raise ValueError(f"no readable image under {images.root} ({left_out_line(named)})")
    if left_out:
        log.warning("image cache: %s", left_out_line(named))
    os.replace(partial, folder / f"{key}.u8")
    meta = {
        "version": CACHE_VERSION, "root": images.root, "side": side, "exact": exact, "names": names,
        "sizes": summary, "kept": kept, "stored": stored, "left_out": left_out,
        "bytes": int(3 * np.asarray(stored, dtype=np.int64).reshape(-1, 2).prod(axis=1).sum()),
        "block": digest.block, "crc32": digest.digest(),
    }  # fmt: skip
    partial_meta = folder / f"{key}.json.{os.getpid()}.partial"
    partial_meta.write_text(json.dumps(meta))
    os.replace(partial_meta, folder / f"{key}.json")  # last: a cache with its list of images is complete


def remove_older_formats(folder: Path, folder_prefix: str) -> None:
    """Remove the caches of a folder (``folder_prefix``, :func:`folder_key`) written in an older format than
    :data:`CACHE_VERSION` (never read: their keys differ), saying so in one line."""
    old: dict[str, Any] = {}
    for meta in folder.glob(f"{folder_prefix}-*.json"):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            version = json.loads(meta.read_text()).get("version")
            if version != CACHE_VERSION:
                old[meta.name[: -len(".json")]] = version
    if old:
        log.info(
            "image cache: %s of this folder in an older format (version %s) removed from %s; it is "
            "rebuilt as version %d (whole images)",
            counted(len(old), "cache"), ", ".join(sorted({str(v) for v in old.values()})), folder, CACHE_VERSION,
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
        except (OSError, ValueError, AttributeError):
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
