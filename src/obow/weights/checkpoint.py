"""Checkpoint files: written atomically, read back with a clear error when they are not ours.

A pretraining checkpoint is a ``torch.save`` dictionary of tensors and plain values only, so that
``torch.load(path, weights_only=True)`` reads it (and every other file obow writes):

=================  ==========================================================================================
``format``         ``"obow-checkpoint"``
``version``        2 (1: before the random states were stored as tensors; still read)
``config``         the resolved recipe (:func:`obow.config.to_dict`), so the run can be rebuilt
``model``          the method's ``state_dict``; for :class:`~obow.methods.obow.OBoW`: ``student.*`` and
                   ``teacher.*`` (torchvision ResNet names), ``extractors.<level>.*`` (vocabulary and
                   statistics), ``predictor.*``, ``iteration``
``optimizer``      the optimiser's ``state_dict``
``epoch``          completed epochs; ``batch_in_epoch``: batches done in the epoch under way (0 at epoch ends)
``iteration``      optimiser steps done
``rng``            random states (Python, NumPy, torch CPU and CUDA), one per process in rank order
``epoch_progress`` the epoch under way: ``steps`` summed, ``seconds`` spent, and ``sums`` of the step metrics
                   averaged in the epoch record, one per process in rank order (so that a resumed epoch's
                   record equals an uninterrupted one's)
``skipped_images`` unreadable files met so far
``tiny_images``    tiny images met so far (used, upscaled more than 4x: :data:`obow.data.folders.TINY_UPSCALE`)
``data``           the training images: ``images``, ``bytes`` and ``digest`` (:mod:`obow.data.identity`)
``history``        per-epoch summaries
``scaler``         the fp16 gradient scaler's state
``imported_from``  the authors' file, for a checkpoint written by ``obow import-official``
``sha256``         the checksum of all the above (:mod:`obow.weights.checksum`), checked on every read and taken
                   out of the dictionary read; absent from checkpoints written before it (still read)
=================  ==========================================================================================

Only ``format``, ``version``, ``config`` and ``model`` are needed to evaluate or export; the rest to resume.
:func:`build_checkpoint` is the one place the dictionary is put together.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import pickle
import re
import shutil
import tempfile
import uuid
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from PIL import Image

from obow.files import as_write_error, file_mode, sync_folder, writing
from obow.notices import ObowWarning
from obow.weights.checksum import seal, verify

FORMAT = "obow-checkpoint"
VERSION = 2  # 2: random states as tensors and plain values (weights_only loads), the epoch in progress

#: What a weights-only load must also accept to read the NumPy arrays in version-1 checkpoints' random states:
#: the array constructor under the names NumPy 1 and NumPy 2 pickle it with, the array and dtype classes.
_RECONSTRUCT = np.empty(0).__reduce__()[0]
NUMPY_GLOBALS: list[Any] = [
    (_RECONSTRUCT, "numpy.core.multiarray._reconstruct"),
    (_RECONSTRUCT, "numpy._core.multiarray._reconstruct"),
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]


class UnreadableFile(ValueError):
    """A file ``torch.load`` cannot read (missing, empty, damaged, not PyTorch's, holding code): the message is
    one line; ``why`` says what is wrong in a few words."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


def previous_path(path: str | Path) -> Path:
    """Where :func:`save_atomic` with ``keep_previous`` keeps the file it replaces: ``checkpoint.prev.pt`` beside
    ``checkpoint.pt``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def save_atomic(
    obj: Any, path: str | Path, keep_previous: bool = False, dump: Callable[[Any, BinaryIO], Any] = torch.save
) -> None:
    """``dump(obj, file)`` (``torch.save`` unless given) to a temporary file in the same folder, then rename it over
    ``path``.

    The previous file stays whole until the new one is complete: a crash, a kill, a second Ctrl-C or a failed
    write (full disk, file size limit) during the write leaves it intact and removes the temporary file. A
    failed write raises :class:`~obow.files.WriteError` (one line: the file and the cause).

    With ``keep_previous``, the file replaced becomes :func:`previous_path` (a hard link made before the rename,
    a copy where the file system has none): ``path`` and the previous copy are each whole at every moment, so a
    checkpoint damaged after it was written (a disk fault, a copy cut short) leaves the one before it.

    The file gets the mode of every other file obow writes, ``0o666`` less the umask (:func:`obow.files.file_mode`,
    ``0o644`` under the usual umask ``022``), not ``mkstemp``'s private ``0o600``: a checkpoint is as readable as
    the run's ``config.yaml`` and logs beside it, and ``umask 077`` makes all of them private.
    """
    with writing(path) as path:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with contextlib.suppress(OSError):  # a file system without modes keeps its own
            os.fchmod(fd, file_mode())
        try:
            with os.fdopen(fd, "wb") as f:
                dump(obj, f)
                f.flush()
                os.fsync(f.fileno())
            if keep_previous and path.is_file():
                place_copy(path, previous_path(path))
            os.replace(tmp, path)
        except BaseException as err:
            # judged before the partial file is removed: it is what filled the disk
            failure = as_write_error(path, err) if isinstance(err, (OSError, RuntimeError)) else None
            Path(tmp).unlink(missing_ok=True)
            if failure is not None and failure is not err:
                raise failure from err
            raise
    sync_folder(path.parent)


def place_copy(source: Path, target: Path) -> None:
    """``target`` becomes a copy of ``source`` at once (a hard link, or a copy where links are refused), never a
    half-made file: made under a temporary name, then renamed."""
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        try:
            os.link(source, tmp)
        except OSError:  # a file system without hard links (some network and FAT ones)
            shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_torch_file(
    path: str | Path, what: str, *, numpy_arrays: bool = False, map_location: str | torch.device = "cpu"
) -> Any:
    """``torch.load(path, weights_only=True)``, or a one-line ``ValueError`` saying what ``path``
    is not: missing, empty, not a PyTorch file, damaged, or holding Python objects that a weights-only load
    refuses (such files can run code when read; obow writes none). ``numpy_arrays`` also accepts NumPy
    arrays, which version-1 checkpoints hold in their random states."""
    path = Path(path)
    if not path.is_file():
        raise UnreadableFile(f"{what} {str(path)!r} does not exist", "it does not exist")
    allowed = NUMPY_GLOBALS if numpy_arrays else []
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(allowed):
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the error below says it better
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets one line saying why
        why = why_unreadable(path, err)
        raise UnreadableFile(f"cannot read {what} {str(path)!r}: {why}", why) from None


def why_unreadable(path: Path, err: Exception) -> str:
    """What is wrong with a file ``torch.load`` refused, in a few words (PyTorch's own message is paragraphs)."""
    text = str(err)
    if path.stat().st_size == 0:
        return "the file is empty"
    if damage := zip_damage(path):  # before what its unpickled bytes look like: damaged bytes can look like anything
        return damage
    if kind := other_kind_of_file(path):
        return f"it is not a file written by torch.save but {kind}"
    if isinstance(err, pickle.UnpicklingError):
        found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"but got <class '([\w.]+)'>", text)
        what = f" ({found.group(1)})" if found else ""
        return (
            f"it holds Python objects{what} besides tensors and plain values, which obow does not load (they "
            "can run code when read); it was not written by obow or torch.save of a state_dict"
        )
    if isinstance(err, PermissionError):
        return err.strerror or text
    if "PytorchStreamReader" in text or isinstance(err, (OSError, EOFError)):  # reading past a cut-short file
        first = text.split(". ")[0].strip() if text else type(err).__name__
        return f"the file is damaged or cut short ({err.strerror if isinstance(err, OSError) else first})"
    return f"it is not a file written by torch.save ({type(err).__name__}: {text.splitlines()[0] if text else ''})"


def zip_damage(path: Path) -> str | None:
    """What is damaged in ``path`` when it is a zip archive (``torch.save``'s format) one of whose files does not
    match the CRC-32 checksum the archive records for it, or whose header is damaged; ``None`` when every file
    matches, or when ``path`` is not read as a zip archive."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    with archive:
        for info in archive.infolist():
            try:
                with archive.open(info) as f:
                    while f.read(1 << 22):  # to its end, where the CRC-32 is checked
                        pass
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError) as err:
                if isinstance(err, NotImplementedError):  # a compression this Python does not read: not damage
                    return None
                check = "does not match its CRC-32 checksum" if "CRC" in str(err) else "has a damaged header"
                return f"the file is damaged: {info.filename} in it {check}"
    return None


def other_kind_of_file(path: Path) -> str | None:
    """What ``path`` is when it cannot be a ``torch.save`` file (a zip archive, or a pickle for the legacy format,
    whole or cut short): an image PIL recognises, or text; ``None`` when it may be one, or is nothing known."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(b"PK") or head.startswith(b"\x80"):
        return None
    if path.suffix.lower() == ".onnx" and head.startswith(b"\x08"):  # a protobuf ModelProto: ir_version first
        return "an ONNX graph (for ONNX Runtime and the like; obow reads checkpoints and .pth or .safetensors exports)"
    try:
        with Image.open(path) as image:
            return f"a {image.format} image"
    except Exception:  # noqa: BLE001 - PIL raises many types for what is not an image
        pass
    try:  # a character cut at the end of the head is no sign of a binary file
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return None
    return "a text file" if b"\0" not in head else None


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a pretraining checkpoint written by ``obow pretrain`` or ``obow import-official``; raise a one-line
    ``ValueError`` for anything else, saying what the file is when it is something obow knows, and naming the
    previous checkpoint beside a file that cannot be read (:func:`previous_path`) when there is one."""
    try:
        return _load_checkpoint(path, map_location)
    except UnreadableFile as err:
        previous = previous_path(path)
        if previous.is_file():
            raise UnreadableFile(f"{err}; the run's previous checkpoint is {str(previous)!r}", err.why) from None
        raise


def load_resumable(path: str | Path) -> tuple[dict[str, Any], Path] | None:
    """The checkpoint a run resumes from and its file: ``path``'s, or where it cannot be read its previous copy
    (:func:`previous_path`), with an :class:`~obow.notices.ObowWarning` saying so (which file, which iteration);
    ``None`` when neither exists. When neither reads, a one-line ``ValueError`` naming both files and what to do."""
    path = Path(path)
    previous = previous_path(path)
    if not path.exists() and not previous.exists():
        return None
    try:
        return _load_checkpoint(path), path
    except UnreadableFile as err:
        damage = err
    try:
        ckpt = _load_checkpoint(previous)
    except UnreadableFile as err:
        older = sorted((path.parent / "checkpoints").glob("epoch_*.pt"))
        copy = f", or copy {older[-1]} over {path} to resume from that epoch" if older else ""
        kept = f"{previous.name}: {err.why}" if previous.exists() else f"no previous copy ({previous.name}) is kept"
        raise ValueError(
            f"cannot resume the run in {path.parent}: {path.name}: {damage.why}; {kept}. Start the run again with "
            f"another --out, or delete {path.parent} to start it over in the same folder{copy}"
        ) from None
    warnings.warn(
        f"{path} cannot be read ({damage.why}): resuming from the previous checkpoint {previous}, iteration "
        f"{ckpt['iteration']}",
        ObowWarning,
        stacklevel=2,
    )
    return ckpt, previous


def _load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    ckpt = read_torch_file(path, "checkpoint", numpy_arrays=True, map_location=map_location)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not an obow pretraining checkpoint: {describe(ckpt)}")
    if ckpt.get("version", 0) > VERSION:
        if why := verify(dict(ckpt), path):  # a damaged version number, not a newer obow's file
            raise UnreadableFile(f"cannot read checkpoint {str(path)!r}: {why}", why)
        raise ValueError(f"{str(path)!r} has checkpoint version {ckpt['version']}; this obow reads up to {VERSION}")
    if why := verify(ckpt, path):
        raise UnreadableFile(f"cannot read checkpoint {str(path)!r}: {why}", why)
    return ckpt


def describe(obj: Any) -> str:
    """What a loaded file holds, for an error message about a file that is not what was asked for."""
    if isinstance(obj, dict):
        if obj.get("format") == FORMAT:
            return "it is already an obow pretraining checkpoint (obow eval, export and show read it as it is)"
        if "network" in obj and isinstance(obj["network"], dict):
            return (
                "it looks like a checkpoint of the authors' code (a 'network' entry): convert it with obow "
                "import-official"
            )
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return (
                f"it holds a state_dict of {len(obj)} tensors (a backbone written by obow export, or another "
                "library's weights; obow eval takes one with --backbone, load_backbone with backbone_file=)"
            )
        keys = ", ".join(map(repr, list(obj)[:5]))
        return f"it holds a dictionary with the entries {keys}{' ...' if len(obj) > 5 else ''}"
    return f"it holds a {type(obj).__name__}, not a dictionary"


def build_checkpoint(
    config: dict[str, Any],
    model: dict[str, Any],
    *,
    epoch: int | None,
    iteration: int,
    batch_in_epoch: int = 0,
    optimizer: dict[str, Any] | None = None,
    scaler: dict[str, Any] | None = None,
    rng: list[dict[str, Any]] | None = None,
    epoch_progress: dict[str, Any] | None = None,
    skipped_images: list[str] | None = None,
    history: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The checkpoint dictionary (see the module docstring): ``config`` is the plain recipe
    (:func:`obow.config.to_dict`), ``model`` the method's ``state_dict``. The training state (``optimizer``,
    ``scaler``, ``rng``, ...) is left out when not given: such a checkpoint evaluates and exports but does not
    resume. ``extra`` entries (e.g. ``imported_from``) are kept as they are; the checksum is added last
    (:func:`obow.weights.checksum.seal`)."""
    ckpt: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "config": config,
        "model": model,
        "epoch": epoch,
        "iteration": iteration,
    }
    if optimizer is not None:
        ckpt.update(
            optimizer=optimizer,
            batch_in_epoch=batch_in_epoch,
            rng=rng if rng is not None else [],
            epoch_progress=epoch_progress or {"steps": 0, "seconds": 0.0, "sums": []},
            skipped_images=list(skipped_images or []),
            history=list(history or []),
        )
    if scaler is not None:
        ckpt["scaler"] = scaler
    ckpt.update(extra)
    return seal(ckpt)
