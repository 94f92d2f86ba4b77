"""Image folders, a dataset that survives bad files and a seeded, resumable, rank-aware sampler (official notes
section 4).

- :func:`scan_images` lists a folder of images, as class folders (like ``torchvision.datasets.ImageFolder``,
  used by the official code) or as one unlabelled pile.
- Each file is decoded by :func:`obow.data.decode.load_rgb` (any common file: JPEG, PNG, WebP, BMP, TIFF;
  grayscale, 16-bit, palette, CMYK, alpha, EXIF-rotated, into an RGB PIL image).
- :class:`ImageDataset` skips unreadable files instead of crashing a long run, names the tiny images it uses
  (:data:`TINY_UPSCALE`), and applies its transform under a per-sample seed, so that a sample's views depend only
  on ``(index, seed)``.
- :class:`EpochSampler` yields those ``(index, seed)`` keys: a per-epoch permutation, split between processes
  so that the ranks' batches together are exactly the single-process batch, and resumable mid-epoch.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.resource_tracker
import multiprocessing.util
import operator
import os
import random
import signal
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from obow.checks import check_choice
from obow.config.choices import LABEL_MODES
from obow.data.decode import load_rgb, unreadable_reason
from obow.notices import ObowWarning, counted

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
#: How many consecutive unreadable files a sample may skip before the dataset gives up.
MAX_READ_TRIES = 32
#: The most worker processes that decode a set of images once (the image cache, an evaluation set's one pass).
MAX_DECODING_WORKERS = 16
#: An evaluation set of at least this many images is decoded by one process per core (:func:`decoding_workers`); a
#: smaller one by the workers asked for, where forking more would cost more than it saves.
DECODING_WORKERS_MIN_IMAGES = 4096
#: An image is *tiny* when the views would upscale it more than this: its shorter side is under a quarter of the
#: side the views are made from (:func:`obow.methods.views_side`), e.g. under 64 px for the ImageNet recipes (256 px)
#: and under 12 px for the CIFAR-10 ones (46 px). A run uses it as it is and reports it once (``tiny_images``): a
#: 1 px image is one flat colour in every view, a 2x50 px strip a few stretched pixels.
TINY_UPSCALE = 4


def forks_workers() -> bool:
    """Whether this platform's decoding workers are forked from the calling process: Linux only (a spawned worker
    imports everything again and runs a script's ``__main__`` without a guard; macOS can fork, but its system
    libraries are not safe in a forked child)."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def max_decoding_workers() -> int:
    """One decoding process per core this process may run on, at most :data:`MAX_DECODING_WORKERS`; 0 where worker
    processes are not forked (:func:`forks_workers`)."""
    if not forks_workers():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_DECODING_WORKERS, cores)


def decoding_workers(images: int, asked: int = 0) -> int:
    """Loader workers for one pass over ``images`` evaluation images (the kNN monitor's first pass, an evaluation's
    features): ``asked`` (the recipe's ``data.num_workers``, often 1 or 0 where the views are made on the GPU), raised
    to :func:`max_decoding_workers` for a set of :data:`DECODING_WORKERS_MIN_IMAGES` or more. The decoding is the
    same in any process, so the result is too. Measured on an H200's machine (16 cores, 2026-11-30): the claim's kNN
    monitor spent 56-57 s on its first pass (CIFAR-10's 60,000 images decoded by one worker) and 1-2 s on each
    later one."""
    if images < DECODING_WORKERS_MIN_IMAGES:
        return asked
    return max(asked, max_decoding_workers())


def tiny_below(views_side: int) -> int:
    """The shorter side under which an image is tiny for views made from ``views_side`` px images."""
    return -(-views_side // TINY_UPSCALE)


@dataclass
class ImageList:
    """Image paths under ``root`` with their class indices (``None`` when unlabelled) and class names."""

    root: str
    paths: list[str]
    labels: list[int] | None = None
    classes: list[str] | None = None

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def labelled(self) -> bool:
        return self.labels is not None


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


@dataclass
class _Found:
    """What a scan left out besides the images it lists, for one warning line each: zero-byte image files
    (``empty``), files not of a listed kind (``other``, by extension) and symbolic links that lead nowhere
    (``broken``: a loop, ``Too many levels of symbolic links``, or a missing target)."""

    empty: list[str] = field(default_factory=list)
    other: Counter = field(default_factory=Counter)
    broken: list[str] = field(default_factory=list)


def _visible_entries(folder: str) -> list[os.DirEntry]:
    """The entries of ``folder`` sorted by name, without hidden ones (``.DS_Store``, ``.git``, ...)."""
    with os.scandir(folder) as entries:
        return sorted((e for e in entries if not e.name.startswith(".")), key=lambda e: e.name)


def _kind(entry: os.DirEntry, found: _Found) -> str | None:
    """``"dir"``, ``"file"`` or ``None`` (anything else) for ``entry``, following symbolic links; a link that leads
    nowhere (a loop, a missing target) goes to ``found.broken`` as ``None``."""
    try:
        if entry.is_dir():
            return "dir"
        if entry.is_file():
            return "file"
        if entry.is_symlink():  # a dangling link: is_dir and is_file are False, not errors
            os.stat(entry.path)
    except OSError:
        found.broken.append(entry.path)
        return None
    return None


def _is_image_file(entry: os.DirEntry, found: _Found, kind: str | None = "") -> bool:
    """An image file with content; a zero-byte file (an interrupted copy or download) goes to ``found.empty``, a
    file of another kind to ``found.other``. ``kind``: the entry's :func:`_kind`, when known."""
    if (_kind(entry, found) if kind == "" else kind) != "file":
        return False
    if not _is_image(entry.name):
        found.other[os.path.splitext(entry.name)[1].lower() or "no extension"] += 1
        return False
    if entry.stat().st_size == 0:
        found.empty.append(entry.path)
        return False
    return True


def _find_images(folder: str, found: _Found, _ancestors: frozenset[str] = frozenset()) -> list[str]:
    """Every non-empty image file under ``folder``, recursively, in sorted order, following symbolic links;
    what is left out is noted in ``found``."""
    real = os.path.realpath(folder)
    if real in _ancestors:  # a link back to an enclosing folder would otherwise recurse forever
        return []
    images = []
    for entry in _visible_entries(folder):
        kind = _kind(entry, found)
        if kind == "dir":
            images.extend(_find_images(entry.path, found, _ancestors | {real}))
        elif _is_image_file(entry, found, kind):
            images.append(entry.path)
    return images


def _no_images_error(root: str, where: str = "", found: _Found | None = None) -> ValueError:
    also = ""
    if found is not None:
        if found.empty:
            also += f"; {counted(len(found.empty), 'zero-byte image file')} skipped"
        also += "".join(f"; {line}" for line in _left_out_lines(found))
    return ValueError(
        f"no images found under {root}{where} (looked for files ending in {', '.join(IMAGE_EXTENSIONS)}, "
        f"in any letter case, skipping hidden files and folders{also})"
    )


def _left_out_lines(found: _Found) -> list[str]:
    """What :func:`scan_images` says of the files of other kinds and the links it left out."""
    lines = []
    if found.other:
        kinds = ", ".join(f"{ext} {n}" for ext, n in sorted(found.other.items(), key=lambda kv: (-kv[1], kv[0])))
        lines.append(f"{counted(sum(found.other.values()), 'file')} left out: not images of a listed kind ({kinds})")
    if found.broken:
        lines.append(
            f"{counted(len(found.broken), 'symbolic link')} skipped: they lead nowhere (a loop or a missing target, "
            f"e.g. {found.broken[0]})"
        )
    return lines


def _warn_left_out(root: str, found: _Found) -> None:
    """One warning line for each kind of file the scan of ``root`` left out."""
    if found.empty:
        warnings.warn(
            f"skipped {counted(len(found.empty), 'zero-byte image file')} under {root} (e.g. {found.empty[0]}): "
            "they hold no image",
            ObowWarning,
            stacklevel=3,
        )
    for line in _left_out_lines(found):
        warnings.warn(f"under {root}, {line}", ObowWarning, stacklevel=3)


def scan_images(root: str | os.PathLike, labels: str = "auto", images_per_class: int | None = None) -> ImageList:
    """List the images under ``root``.

    ``labels``:

    - ``"folders"``: every immediate sub-folder of ``root`` is a class (sorted names give indices 0..C-1) and
      holds its images at any depth, as in ``ImageFolder`` (official notes 4);
    - ``"none"``: every image anywhere under ``root``, unlabelled;
    - ``"auto"``: ``"folders"`` when ``root`` has a sub-folder with images and no image file of its own,
      otherwise ``"none"``.

    The order is sorted and deterministic; hidden files and folders are skipped; symbolic links are followed.
    Zero-byte image files (an interrupted copy) are skipped with a warning that counts them, so that they do
    not count as images when the batch size is checked; so are symbolic links that lead nowhere (a loop, a
    missing target), and files of a kind not listed (:data:`IMAGE_EXTENSIONS`: a GIF, animated or not, a
    ``.txt``) are counted by extension in one warning line.
    ``images_per_class`` keeps the first N images of each class in that order, the way the official
    ImageNet-20% subset is drawn (official notes 4). Raises ``ValueError`` with the reason.
    """
    check_choice("labels", labels, LABEL_MODES)
    root = os.fspath(root)
    if not os.path.exists(root):
        raise ValueError(f"image folder {root} does not exist")
    if not os.path.isdir(root):
        raise ValueError(f"{root} is not a folder; give the folder that holds the images")
    if images_per_class is not None and (isinstance(images_per_class, bool) or images_per_class < 1):
        raise ValueError(f"images_per_class must be an integer >= 1, got {images_per_class!r}")

    found = _Found()  # what is left out, one warning line per kind
    top = _visible_entries(root)
    top_images = [e.path for e in top if _is_image_file(e, found)]
    top_dirs = [e for e in top if e.path not in top_images and _kind(e, _Found()) == "dir"]
    if labels == "auto" and top_images:
        labels = "none"
    class_images = {e.name: _find_images(e.path, found) for e in top_dirs} if labels != "none" else {}
    if labels == "auto":
        labels = "folders" if any(class_images.values()) else "none"

    if labels == "none":
        if images_per_class is not None:
            raise ValueError(
                f"images_per_class={images_per_class} needs class folders, but the images under {root} are "
                "read as unlabelled (labels='none', or 'auto' found no class sub-folders)"
            )
        found = _Found()  # the whole tree is scanned again
        paths = _find_images(root, found)
        if not paths:
            raise _no_images_error(root, found=found)
        _warn_left_out(root, found)
        return ImageList(root=root, paths=paths, labels=None, classes=None)

    if top_images:
        raise ValueError(
            f"{root} has image files directly in it (e.g. {os.path.basename(top_images[0])}); with "
            "labels='folders' every image must be inside a class sub-folder: move them or use labels='none'"
        )
    if not any(class_images.values()):
        raise _no_images_error(root, " in any class sub-folder", found)
    classes = sorted(class_images)
    paths, targets = [], []
    for label, name in enumerate(classes):
        kept = class_images[name][:images_per_class]
        paths.extend(kept)
        targets.extend([label] * len(kept))
    _warn_left_out(root, found)
    return ImageList(root=root, paths=paths, labels=targets, classes=classes)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator and Python's ``random`` for one sample, then restore the caller's states.

    Restoring matters with ``num_workers=0``, where the dataset runs in the training process: its generators
    must not be reseeded by every sample. Only the CPU generator is touched because the transforms run on the
    CPU.
    """
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)


class ImageDataset(Dataset):
    """The images of an :class:`ImageList` through ``transform``, robust to unreadable files.

    ``dataset[i]`` uses torch's current random state; ``dataset[(i, seed)]`` (the keys of
    :class:`EpochSampler`) seeds torch and ``random`` with ``seed`` first, so the sample depends only on
    ``(i, seed)``, whichever worker process produces it. A file that cannot be read (corrupt, truncated,
    empty, not an image) is remembered and replaced by the next index, up to ``MAX_READ_TRIES`` in a row;
    a large JPEG is decoded at a reduced scale that keeps its shorter side at least ``draft_side`` (:func:`load_rgb`);
    the sample reports the paths it skipped, each with why (:func:`unreadable_reason`). An image whose shorter side
    is under ``tiny_below`` is used as it is and named in the sample with that side. Items are ``{"image", "label"
    (-1 when unlabelled), "index" (the index actually used), "skipped" (a tuple of paths), "reasons" (``((path,
    why),)`` for each skipped path), "tiny" (``((path, shorter side),)`` or ``()``)}``.
    """

    def __init__(
        self,
        images: ImageList,
        transform: Callable[[Image.Image], Any] | None = None,
        tiny_below: int = 0,
        draft_side: int = 0,
    ) -> None:
        if len(images) == 0:
            raise ValueError(f"no images to build a dataset from under {images.root}")
        self.images = images
        self.transform = transform
        self.tiny_below = tiny_below
        self.draft_side = draft_side
        #: Paths found unreadable by this process, not opened again, with why (:func:`unreadable_reason`).
        self.unreadable: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        index, seed = key if isinstance(key, tuple) else (key, None)
        index = operator.index(index)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} images")
        img, index, skipped = self._read(index)
        reasons = tuple((path, self.unreadable[path]) for path in skipped)
        side = min(img.size)
        tiny = ((self.images.paths[index], side),) if side < self.tiny_below else ()
        if self.transform is not None:
            if seed is None:
                img = self.transform(img)
            else:
                with _seeded(operator.index(seed)):
                    img = self.transform(img)
        label = self.images.labels[index] if self.images.labels is not None else -1
        return {"image": img, "label": label, "index": index, "skipped": skipped, "reasons": reasons, "tiny": tiny}

    def _read(self, index: int) -> tuple[Image.Image, int, tuple[str, ...]]:
        """The first readable image from ``index`` on, the index it came from and the paths skipped."""
        skipped: list[str] = []
        error: Exception | None = None
        for _ in range(min(MAX_READ_TRIES, len(self))):
            path = self.images.paths[index]
            if path not in self.unreadable:
                try:
                    return load_rgb(path, self.draft_side), index, tuple(skipped)
                # a damaged file makes PIL raise many types (OSError, SyntaxError, ValueError, struct.error,
                # DecompressionBombError, ...); any of them means "this file cannot be used"
                except Exception as err:
                    self.unreadable[path] = unreadable_reason(err)
                    error = err
            skipped.append(path)
            index = (index + 1) % len(self)
        raise RuntimeError(
            f"{len(skipped)} images in a row could not be read under {self.images.root} "
            f"(first: {skipped[0]}); check or remove the damaged files"
        ) from error


def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack a list of :class:`ImageDataset` items; ``"skipped"``, ``"reasons"`` and ``"tiny"`` become flat lists.

    Views from :class:`~obow.data.transforms.OBoWViews` collate to ``{"teacher": [B, 3, T, T], "crops":
    [B, n, 3, c, c], "patches": [B, 5, 3, p, p]}`` (official notes 4).
    """
    listed = {key: [entry for item in batch for entry in item.get(key, ())] for key in ("skipped", "reasons", "tiny")}
    out = default_collate([{k: v for k, v in item.items() if k not in listed} for item in batch])
    return {**out, **listed}


def _epoch_seed(seed: int, epoch: int) -> int:
    return (seed * 1_000_003 + epoch) % 2**63


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """The augmentation seed of the sample at ``position`` of the epoch's order: a function of these alone."""
    return (_epoch_seed(seed, epoch) * 1_000_000_007 + position) % 2**63


class EpochSampler(Sampler[tuple[int, int]]):
    """Per-epoch ``(index, seed)`` keys for :class:`ImageDataset`, split between ``world_size`` processes.

    Each epoch is a permutation of the images drawn from ``(seed, epoch)`` (the identity without shuffle).
    Global batch ``i`` is positions ``[i*G, (i+1)*G)`` of it, with ``G = batch_size * world_size``, and rank
    ``r`` takes the ``r``-th block of ``batch_size`` positions in it; so the ranks' ``i``-th batches, in rank
    order, are exactly the single-process batch ``i`` of size ``G``, and a run behaves the same on any number
    of processes. Sample seeds depend only on ``(seed, epoch, position)``.

    With ``drop_last`` the last incomplete global batch is dropped (as in the official loader, notes 4).
    Without it, the last global batch of ``m < G`` positions is split into contiguous shares whose sizes
    differ by at most one (rank ``r`` gets positions ``[r*m//W, (r+1)*m//W)`` of it); a rank whose share is
    empty then yields one batch fewer than the others.

    ``set_epoch(epoch, start_batch)`` selects the epoch and skips its first ``start_batch`` batches without
    reading their images, to resume mid-epoch with the same order and seeds.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if num_samples < 1 or batch_size < 1 or world_size < 1:
            raise ValueError(
                f"EpochSampler needs num_samples, batch_size and world_size >= 1, got {num_samples}, "
                f"{batch_size} and {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        global_batch = batch_size * world_size
        if drop_last and global_batch > num_samples:
            raise ValueError(f"data.batch_size ({global_batch}) is larger than the number of images ({num_samples})")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.global_batch_size = global_batch
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.start_batch = 0

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in a whole epoch (``start_batch`` not subtracted)."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return math.ceil(self.num_samples / self.global_batch_size)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Use ``epoch``'s order and seeds, starting at its batch ``start_batch``."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch must be in [0, {self.batches_per_epoch}], got {start_batch}")
        self.epoch = epoch
        self.start_batch = start_batch

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def _local_positions(self, batch: int) -> range:
        """This rank's positions in global batch ``batch``: its ``batch_size`` block, or its share of a last,
        partial batch (for a full batch both formulas agree)."""
        start = batch * self.global_batch_size
        size = min(self.global_batch_size, self.num_samples - start)
        return range(start + self.rank * size // self.world_size, start + (self.rank + 1) * size // self.world_size)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = self._order()
        for batch in range(self.start_batch, self.batches_per_epoch):
            for position in self._local_positions(batch):
                yield order[position], sample_seed(self.seed, self.epoch, position)

    def __len__(self) -> int:
        return sum(len(self._local_positions(b)) for b in range(self.start_batch, self.batches_per_epoch))

    def batches(self) -> Iterator[tuple[int, list[int], int, int]]:
        """This rank's batches of the epoch from ``start_batch``, whole: ``(global batch number, image indices,
        this rank's first position within the global batch, the global batch's size)`` (for a pipeline that
        makes a batch's views at once, :class:`obow.data.device_loader.DeviceLoader`)."""
        order = self._order()
        for batch in range(self.start_batch, self.batches_per_epoch):
            positions = self._local_positions(batch)
            start = batch * self.global_batch_size
            if len(positions):
                size = min(self.global_batch_size, self.num_samples - start)
                yield batch, [order[p] for p in positions], positions.start - start, size


def build_loader(
    dataset: Dataset, sampler: Sampler, batch_size: int, num_workers: int = 0, pin_memory: bool = False
) -> DataLoader:
    """A ``DataLoader`` over ``dataset`` in ``sampler``'s order, batched by ``batch_size`` (per process).

    ``drop_last`` is off because the sampler already decides which samples an epoch holds; workers persist
    between epochs to avoid re-forking them (the sampler still runs in this process, so ``set_epoch`` applies).
    """
    if num_workers > 0:
        end_workers_at_exit()
    return _WorkerSafeLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=pin_memory,
        drop_last=False,
        persistent_workers=num_workers > 0,
        # A private generator: otherwise every new iterator draws its worker seed from the global torch RNG,
        # and a resumed run would consume that RNG at a different point than an uninterrupted one. Worker
        # seeds do not matter here, since every sample is seeded from its key.
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=ignore_interrupt,
    )


#: The signals a data worker leaves to the main process (:func:`ignore_interrupt`): SIGHUP too, which a closed
#: terminal sends its whole foreground process group.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _WorkerSafeLoader(DataLoader):
    """A ``DataLoader`` whose workers start with SIGINT and SIGTERM blocked, until :func:`ignore_interrupt`
    ignores them: a worker is otherwise killed by a signal to the process group (Ctrl-C, ``timeout``, a
    scheduler) in the window between its start and its init function, which lasts seconds for a spawned worker
    (it imports torch and unpickles the dataset first; workers are spawned inside ``obow tables run --jobs``'
    processes). A killed worker fails the run without a checkpoint, or leaves the training process blocked for
    good writing the dataset to the dead worker's pipe. The training process keeps its own handlers: the mask is
    set only while the workers start (they inherit it, through ``exec`` too) and restored at once, and a signal
    that came meanwhile is delivered then."""

    def _get_iterator(self):  # DataLoader's own hook, which starts the workers
        if self.num_workers == 0 or not hasattr(signal, "pthread_sigmask"):
            return super()._get_iterator()
        # the start method the workers will use, without fixing it (the first listed is the default)
        method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
        if method != "fork":
            # started now, not inside the first worker's start: starting it unblocks SIGINT and SIGTERM
            multiprocessing.resource_tracker.ensure_running()
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            return super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_interrupt(worker_id: int) -> None:
    """Ctrl-C reaches every process of the terminal's group, and SIGTERM every process of a job that a scheduler
    cancels or a user stops with ``pkill -f`` / ``docker stop``: the workers leave both to the main process,
    which finishes the step under way and writes a checkpoint (a worker ended by the signal would fail the next
    batch, and the run would stop without that checkpoint). A worker still ends when the main process is gone
    (PyTorch's watchdog), when the loader shuts it down, or at exit (:func:`end_workers_at_exit`)."""
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # started blocked (_WorkerSafeLoader): a pending signal is dropped
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


_ending_workers_at_exit: int | None = None  # the process that registered the exit hook


def end_workers_at_exit() -> None:
    """Once per process: at exit, kill (SIGKILL) the daemonic child processes still alive.

    ``multiprocessing`` ends daemonic children at exit with SIGTERM and then waits for them; data workers ignore
    SIGTERM (:func:`ignore_interrupt`), so a run that leaves a loader open on its way out (an error, an
    interrupt) would wait forever. The hook is one of ``multiprocessing``'s own exit finalizers, which run just
    before that SIGTERM-and-wait: in the main process (at interpreter exit) and also in a process that
    ``multiprocessing`` started (``obow tables run --jobs``' runs), where ``atexit`` handlers never run before
    the wait. Loaders closed normally have already joined their workers, which are no longer children by then."""
    global _ending_workers_at_exit
    if _ending_workers_at_exit != os.getpid():  # a forked child inherits the flag but not the registration
        multiprocessing.util.Finalize(None, _kill_daemonic_children, exitpriority=100)
        _ending_workers_at_exit = os.getpid()


def _kill_daemonic_children() -> None:
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join()
