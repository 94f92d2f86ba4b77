from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from obow.config import ViewsConfig
from obow.data.decode import load_rgb
from obow.data.folders import (
    EpochSampler,
    ImageDataset,
    ImageList,
    _kill_daemonic_children,
    build_loader,
    collate,
    ignore_interrupt,
    scan_images,
)
from obow.data.transforms import OBoWViews, eval_transform


def save_image(path: Path, size: tuple[int, int] = (20, 16), seed: int = 0, **save_args) -> Path:
    """A random RGB image of ``size`` (width, height) saved at ``path`` in the format its suffix names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path, **save_args)
    return path


def write_bytes(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def relative(images: ImageList) -> list[str]:
    return [Path(p).relative_to(images.root).as_posix() for p in images.paths]


def small_views() -> ViewsConfig:
    return ViewsConfig(
        teacher_resize=40,
        teacher_size=32,
        num_crops=2,
        crop_size=24,
        num_patches=5,
        patch_size=16,
        patch_jitter=6,
        patch_grid_size=44,
    )


# --- scanning folders --------------------------------------------------------------------------------------


def test_class_folders_give_sorted_labels_and_nested_images(tmp_path):
    save_image(tmp_path / "zebra" / "b.jpg")
    save_image(tmp_path / "zebra" / "A.PNG")
    save_image(tmp_path / "ant" / "x.webp")
    save_image(tmp_path / "ant" / "deep" / "er" / "y.tiff")
    save_image(tmp_path / "moth" / "m.bmp")
    (tmp_path / "README.txt").write_text("not an image, allowed next to the class folders")
    (tmp_path / "moth" / "notes.csv").write_text("a,b")
    for mode in ("auto", "folders"):
        images = scan_images(tmp_path, labels=mode)
        assert images.labelled and len(images) == 5
        assert images.classes == ["ant", "moth", "zebra"]
        assert relative(images) == ["ant/deep/er/y.tiff", "ant/x.webp", "moth/m.bmp", "zebra/A.PNG", "zebra/b.jpg"]
        assert images.labels == [0, 0, 1, 2, 2]
        assert all(os.path.isfile(p) for p in images.paths)


def test_unlabelled_folders(tmp_path):
    save_image(tmp_path / "top.jpg")
    save_image(tmp_path / "sub" / "inner.png")
    save_image(tmp_path / "sub" / "more" / "deeper.JPEG")
    images = scan_images(tmp_path)  # an image at the top level: not class folders
    assert not images.labelled and images.labels is None and images.classes is None
    assert relative(images) == ["sub/inner.png", "sub/more/deeper.JPEG", "top.jpg"]
    forced = scan_images(tmp_path / "sub", labels="none")
    assert relative(forced) == ["inner.png", "more/deeper.JPEG"]
    flat = tmp_path / "flat"
    for name in ("c.png", "a.png", "b.png"):
        save_image(flat / name)
    assert relative(scan_images(flat)) == ["a.png", "b.png", "c.png"] and not scan_images(flat).labelled


def test_hidden_files_and_folders_are_skipped(tmp_path):
    save_image(tmp_path / "cat" / "ok.png")
    save_image(tmp_path / "cat" / ".hidden.png")
    save_image(tmp_path / "cat" / ".git" / "inside.png")
    save_image(tmp_path / ".cache" / "thumb.png")
    images = scan_images(tmp_path)
    assert images.classes == ["cat"] and relative(images) == ["cat/ok.png"]
    assert relative(scan_images(tmp_path, labels="none")) == ["cat/ok.png"]


def test_symbolic_links_are_followed_without_looping(tmp_path):
    outside = tmp_path / "outside"
    save_image(outside / "linked.png")
    root = tmp_path / "root"
    save_image(root / "real" / "r.png")
    (root / "linked").symlink_to(outside, target_is_directory=True)
    (root / "real" / "loop").symlink_to(root / "real", target_is_directory=True)
    images = scan_images(root)
    assert images.classes == ["linked", "real"] and relative(images) == ["linked/linked.png", "real/r.png"]


def test_images_per_class_keeps_the_first_in_sorted_order(tmp_path):
    for cls in ("a", "b"):
        for name in ("3.png", "1.png", "2.png"):
            save_image(tmp_path / cls / name)
    save_image(tmp_path / "c" / "only.png")
    images = scan_images(tmp_path, images_per_class=2)
    assert relative(images) == ["a/1.png", "a/2.png", "b/1.png", "b/2.png", "c/only.png"]
    assert images.labels == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="images_per_class=2 needs class folders"):
        scan_images(tmp_path, labels="none", images_per_class=2)
    with pytest.raises(ValueError, match="images_per_class must be an integer >= 1"):
        scan_images(tmp_path, images_per_class=0)


def test_scan_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        scan_images(tmp_path / "missing")
    file = save_image(tmp_path / "file.png")
    with pytest.raises(ValueError, match="is not a folder"):
        scan_images(file)
    empty = tmp_path / "empty"
    empty.mkdir()
    for mode in ("auto", "folders", "none"):
        with pytest.raises(ValueError, match=r"no images found under .*\.jpg, \.jpeg, \.png"):
            scan_images(empty, labels=mode)
    no_images = tmp_path / "text_only"
    (no_images / "sub").mkdir(parents=True)
    (no_images / "notes.txt").write_text("hello")
    (no_images / "sub" / "image.jpg.txt").write_text("not an image either")
    with pytest.raises(ValueError, match="no images found"):
        scan_images(no_images)
    with pytest.raises(ValueError, match="no images found under .* in any class sub-folder"):
        scan_images(no_images, labels="folders")
    with pytest.raises(ValueError, match="'auto', 'folders', 'none'"):
        scan_images(tmp_path, labels="classes")
    mixed = tmp_path / "mixed"
    save_image(mixed / "loose.png")
    save_image(mixed / "cls" / "a.png")
    with pytest.raises(ValueError, match="image files directly in it .*loose.png"):
        scan_images(mixed, labels="folders")


# --- decoding every format and mode ------------------------------------------------------------------------


def smooth_image(width: int = 24, height: int = 16) -> np.ndarray:
    """A gradient: lossy codecs keep it close, unlike noise."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 10, y * 15, 255 - x * 10], axis=-1).clip(0, 255).astype(np.uint8)


@pytest.mark.parametrize(
    ("suffix", "max_error"), [(".jpg", 8.0), (".png", 0.0), (".webp", 8.0), (".bmp", 0.0), (".tif", 0.0)]
)
def test_load_rgb_reads_every_format(tmp_path, suffix, max_error):
    pixels = smooth_image()
    path = tmp_path / f"image{suffix}"
    Image.fromarray(pixels).save(path)
    img = load_rgb(path)
    assert img.mode == "RGB" and img.size == (24, 16)
    assert np.abs(np.asarray(img, dtype=float) - pixels).mean() <= max_error


def test_load_rgb_converts_grayscale_high_depth_and_palette(tmp_path):
    Image.new("L", (3, 2), 77).save(tmp_path / "l.png")
    assert np.all(np.asarray(load_rgb(tmp_path / "l.png")) == 77)

    # PIL's own convert("RGB") would clip every 16-bit value above 255 to white
    Image.fromarray(np.array([[0, 32768, 65535]], dtype=np.uint16)).save(tmp_path / "i16.png")
    img = load_rgb(tmp_path / "i16.png")
    assert img.mode == "RGB" and np.asarray(img)[0, :, 0].tolist() == [0, 128, 255]
    Image.fromarray(np.array([[0, 32768, 65535]], dtype=np.int32)).save(tmp_path / "i32.tif")
    assert np.asarray(load_rgb(tmp_path / "i32.tif"))[0, :, 1].tolist() == [0, 128, 255]
    Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32)).save(tmp_path / "f.tif")
    assert np.asarray(load_rgb(tmp_path / "f.tif"))[0, :, 2].tolist() == [0, 128, 255]

    palette = Image.new("P", (2, 1))
    palette.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    palette.putpixel((1, 0), 1)
    palette.save(tmp_path / "p.png")
    assert np.asarray(load_rgb(tmp_path / "p.png")).tolist() == [[[10, 20, 30], [200, 100, 50]]]
    palette.save(tmp_path / "p_transparent.png", transparency=0)
    assert np.asarray(load_rgb(tmp_path / "p_transparent.png")).tolist() == [[[255, 255, 255], [200, 100, 50]]]


def test_load_rgb_converts_cmyk_jpeg(tmp_path):
    Image.new("CMYK", (16, 16), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")
    img = load_rgb(tmp_path / "cmyk.jpg")
    assert img.mode == "RGB"
    assert np.abs(np.asarray(img, dtype=float) - [255, 0, 0]).max() <= 6  # pure red, up to JPEG error


def test_alpha_is_composited_onto_white(tmp_path):
    rgba = Image.new("RGBA", (3, 1))
    rgba.putdata([(10, 200, 30, 0), (10, 200, 30, 255), (0, 0, 0, 128)])
    rgba.save(tmp_path / "rgba.png")
    pixels = np.asarray(load_rgb(tmp_path / "rgba.png")).astype(int)
    assert pixels[0, 0].tolist() == [255, 255, 255]  # fully transparent: white, not its stored colour
    assert pixels[0, 1].tolist() == [10, 200, 30]  # opaque: unchanged
    assert np.all(np.abs(pixels[0, 2] - 127) <= 1)  # half-transparent black over white: mid grey
    la = Image.new("LA", (2, 1))
    la.putdata([(0, 0), (50, 255)])
    la.save(tmp_path / "la.png")
    assert np.asarray(load_rgb(tmp_path / "la.png")).tolist() == [[[255, 255, 255], [50, 50, 50]]]


def test_exif_orientation_is_applied(tmp_path):
    pixels = np.zeros((20, 40, 3), dtype=np.uint8)
    pixels[:, :20] = (255, 0, 0)  # left half red
    pixels[:, 20:] = (0, 0, 255)  # right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    Image.fromarray(pixels).save(tmp_path / "phone.jpg", exif=exif, quality=95)
    img = load_rgb(tmp_path / "phone.jpg")
    assert img.size == (20, 40)
    shown = np.asarray(img).astype(int)
    assert shown[5, 10, 0] > 200 and shown[5, 10, 2] < 60  # the left half is now on top
    assert shown[35, 10, 2] > 200 and shown[35, 10, 0] < 60


# --- unreadable files --------------------------------------------------------------------------------------


@pytest.fixture
def damaged_folder(tmp_path):
    """a_good, b_corrupt (random bytes), c_truncated (half a JPEG), d_empty (0 bytes), e_good, f_corrupt."""
    save_image(tmp_path / "a_good.png", seed=1)
    rng = np.random.default_rng(0)
    write_bytes(tmp_path / "b_corrupt.jpg", rng.integers(0, 256, 4000, dtype=np.uint8).tobytes())
    full = save_image(tmp_path / "full.jpeg", size=(64, 64), quality=95).read_bytes()
    (tmp_path / "full.jpeg").unlink()
    write_bytes(tmp_path / "c_truncated.jpg", full[: len(full) // 2])
    write_bytes(tmp_path / "d_empty.jpg", b"")
    save_image(tmp_path / "e_good.png", seed=2)
    write_bytes(tmp_path / "f_corrupt.png", rng.integers(0, 256, 500, dtype=np.uint8).tobytes())
    return tmp_path


def test_load_rgb_raises_on_damaged_files(damaged_folder):
    for name in ("b_corrupt.jpg", "c_truncated.jpg", "d_empty.jpg", "f_corrupt.png"):
        with pytest.raises(OSError):
            load_rgb(damaged_folder / name)


def test_dataset_skips_unreadable_files_and_reports_them(damaged_folder):
    with pytest.warns(UserWarning, match="skipped 1 zero-byte image file under"):  # d_empty never becomes an image
        images = scan_images(damaged_folder)
    names = [Path(p).name for p in images.paths]
    assert names == ["a_good.png", "b_corrupt.jpg", "c_truncated.jpg", "e_good.png", "f_corrupt.png"]
    dataset = ImageDataset(images, transform=eval_transform(16, 16, (0.5,) * 3, (0.5,) * 3))
    first = dataset[0]
    assert first["index"] == 0 and first["skipped"] == () and first["label"] == -1
    assert first["image"].shape == (3, 16, 16)
    item = dataset[1]
    assert item["index"] == 3
    assert [Path(p).name for p in item["skipped"]] == ["b_corrupt.jpg", "c_truncated.jpg"]
    assert torch.equal(item["image"], dataset[3]["image"])
    again = dataset[(2, 11)]  # files already known to be unreadable are still reported
    assert again["index"] == 3 and [Path(p).name for p in again["skipped"]] == ["c_truncated.jpg"]
    wrapped = dataset[4]  # the last file is damaged: wrap around to the first
    assert wrapped["index"] == 0 and [Path(p).name for p in wrapped["skipped"]] == ["f_corrupt.png"]

    batch = collate([dataset[1], dataset[0], dataset[2]])
    assert batch["image"].shape == (3, 3, 16, 16)
    assert batch["index"].tolist() == [3, 0, 3] and batch["label"].tolist() == [-1, -1, -1]
    names = [Path(p).name for p in batch["skipped"]]
    assert names == ["b_corrupt.jpg", "c_truncated.jpg", "c_truncated.jpg"]


def test_all_unreadable_raises_naming_the_folder(tmp_path):
    for i in range(3):
        write_bytes(tmp_path / "broken" / f"{i}.jpg", b"not a jpeg at all")
    dataset = ImageDataset(scan_images(tmp_path / "broken"), transform=None)
    with pytest.raises(RuntimeError, match=r"3 images in a row could not be read under .*broken"):
        dataset[1]


def test_dataset_returns_pil_without_transform_and_class_labels(tmp_path):
    save_image(tmp_path / "a" / "x.png", size=(9, 7))
    save_image(tmp_path / "b" / "y.png")
    dataset = ImageDataset(scan_images(tmp_path), transform=None)
    assert len(dataset) == 2
    item = dataset[0]
    assert isinstance(item["image"], Image.Image) and item["image"].size == (9, 7) and item["label"] == 0
    assert dataset[1]["label"] == 1
    with pytest.raises(IndexError):
        dataset[2]


# --- seeded determinism ------------------------------------------------------------------------------------


def test_the_same_key_gives_the_same_views(tmp_path):
    save_image(tmp_path / "img.png", size=(60, 50))
    dataset = ImageDataset(scan_images(tmp_path), OBoWViews(small_views()))
    state = torch.get_rng_state()
    first = dataset[(0, 7)]["image"]
    torch.rand(5)  # whatever happened in between, the key alone decides the views
    second = dataset[(0, 7)]["image"]
    other = dataset[(0, 8)]["image"]
    for name in ("teacher", "crops", "patches"):
        assert torch.equal(first[name], second[name])
    assert not torch.equal(first["crops"], other["crops"])
    assert not torch.equal(first["patches"], other["patches"])
    # the caller's generator is left as it was (the loader may run in the training process)
    torch.set_rng_state(state)
    expected = torch.rand(3)
    torch.set_rng_state(state)
    dataset[(0, 7)]
    assert torch.equal(torch.rand(3), expected)


def test_a_seed_also_fixes_python_random_and_restores_it(tmp_path):
    save_image(tmp_path / "img.png")

    def draws(img):  # a transform that uses both generators, as third-party augmentations may
        return (random.random(), torch.rand(()).item())

    dataset = ImageDataset(scan_images(tmp_path), draws)
    random.seed(0)
    first = dataset[(0, 3)]["image"]
    after = random.random()
    random.seed(1)
    assert dataset[(0, 3)]["image"] == first
    assert dataset[(0, 4)]["image"][0] != first[0]
    random.seed(0)
    assert random.random() == after  # the sample did not consume the caller's Python generator


# --- the epoch sampler -------------------------------------------------------------------------------------


def keys(sampler: EpochSampler, epoch: int, start_batch: int = 0) -> list[tuple[int, int]]:
    sampler.set_epoch(epoch, start_batch)
    return list(sampler)


def chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def test_sampler_order_depends_on_seed_and_epoch():
    sampler = EpochSampler(50, 5, seed=3)
    assert keys(sampler, 1) == keys(EpochSampler(50, 5, seed=3), 1)
    assert [i for i, _ in keys(sampler, 1)] != [i for i, _ in keys(sampler, 2)]
    assert [i for i, _ in keys(sampler, 1)] != [i for i, _ in keys(EpochSampler(50, 5, seed=4), 1)]
    assert sorted(i for i, _ in keys(sampler, 1)) == list(range(50))
    seeds = [s for _, s in keys(sampler, 1)]
    assert len(set(seeds)) == 50 and not set(seeds) & {s for _, s in keys(sampler, 2)}
    in_order = EpochSampler(12, 4, shuffle=False)
    assert [i for i, _ in keys(in_order, 5)] == list(range(12))


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("num_samples", "batch_size", "world_size"), [(23, 2, 1), (23, 2, 3), (25, 4, 3), (24, 3, 4)])
def test_ranks_together_make_the_single_process_batches(num_samples, batch_size, world_size, drop_last):
    global_batch = batch_size * world_size
    single = EpochSampler(num_samples, global_batch, seed=5, drop_last=drop_last)
    want = chunks(keys(single, 2), global_batch)
    per_rank = []
    for rank in range(world_size):
        sampler = EpochSampler(num_samples, batch_size, seed=5, rank=rank, world_size=world_size, drop_last=drop_last)
        rank_keys = keys(sampler, 2)
        assert len(sampler) == len(rank_keys)
        per_rank.append(chunks(rank_keys, batch_size))
    assert max(len(b) for b in per_rank) == len(want)
    for i, batch in enumerate(want):
        together = [key for batches in per_rank for key in (batches[i] if i < len(batches) else [])]
        assert together == batch  # indices and seeds
    indices = [i for batches in per_rank for batch in batches for i, _ in batch]
    assert len(indices) == len(set(indices))  # no image twice in an epoch
    expected = (num_samples // global_batch) * global_batch if drop_last else num_samples
    assert len(indices) == expected


def test_last_partial_batch_is_split_evenly():
    shares = [len(keys(EpochSampler(25, 4, rank=r, world_size=3, drop_last=False), 0)) for r in range(3)]
    assert shares == [8, 8, 9]  # two full batches of 4 each, then the last 1 image goes to the last rank
    shares = [len(keys(EpochSampler(23, 2, rank=r, world_size=3, drop_last=False), 0)) for r in range(3)]
    assert shares == [7, 8, 8]  # 3 full batches of 2, then 5 images split 1, 2, 2


def test_start_batch_skips_exactly_those_batches():
    sampler = EpochSampler(30, 4, seed=1, rank=1, world_size=2)
    full = keys(sampler, 4)
    assert len(full) == 3 * 4 and sampler.batches_per_epoch == 3
    resumed = keys(sampler, 4, start_batch=2)
    assert resumed == full[2 * 4 :] and len(sampler) == 4
    assert keys(sampler, 4, start_batch=3) == [] and len(sampler) == 0
    with pytest.raises(ValueError, match="start_batch"):
        sampler.set_epoch(4, start_batch=4)


def test_sampler_errors():
    with pytest.raises(ValueError, match=r"data.batch_size \(12\) is larger than the number of images \(10\)"):
        EpochSampler(10, 4, world_size=3)
    assert len(EpochSampler(10, 4, world_size=3, drop_last=False)) == 3  # rank 0: 10 // 3 of the partial batch
    with pytest.raises(ValueError, match="rank"):
        EpochSampler(10, 2, rank=2, world_size=2)


def test_loader_with_workers_matches_loader_without(tmp_path):
    for i in range(6):
        save_image(tmp_path / ("even" if i % 2 == 0 else "odd") / f"{i}.png", size=(48, 40), seed=i)
    dataset = ImageDataset(scan_images(tmp_path), OBoWViews(small_views()))
    sampler = EpochSampler(len(dataset), 3, seed=1)
    in_process = build_loader(dataset, sampler, batch_size=3, num_workers=0)
    with_workers = build_loader(dataset, sampler, batch_size=3, num_workers=2)
    for epoch in (0, 1):  # the second epoch checks that persistent workers follow set_epoch
        sampler.set_epoch(epoch)
        want = list(in_process)
        sampler.set_epoch(epoch)
        got = list(with_workers)
        assert len(want) == len(got) == 2
        for a, b in zip(want, got, strict=True):
            assert a["image"]["teacher"].shape == (3, 3, 32, 32)
            assert a["image"]["crops"].shape == (3, 2, 3, 24, 24)
            assert a["image"]["patches"].shape == (3, 5, 3, 16, 16)
            for name in ("teacher", "crops", "patches"):
                assert torch.equal(a["image"][name], b["image"][name])
            assert torch.equal(a["index"], b["index"]) and torch.equal(a["label"], b["label"])
            assert a["skipped"] == b["skipped"] == []
        if epoch == 0:
            first_epoch = want
    assert not torch.equal(first_epoch[0]["image"]["crops"], want[0]["image"]["crops"])


def _sleep_ignoring_sigterm() -> None:
    ignore_interrupt(0)
    time.sleep(60)


@pytest.mark.slow
def test_a_worker_ignores_sigterm_and_is_still_ended_at_exit():
    """Workers ignore SIGTERM (a signal to the whole job is the main process's to handle); the exit hook that
    multiprocessing's own SIGTERM-then-join relies on must kill them, or an error exit would wait forever."""
    ctx = multiprocessing.get_context("fork")
    worker = ctx.Process(target=_sleep_ignoring_sigterm, daemon=True)
    worker.start()
    time.sleep(0.3)  # let it install its handlers
    worker.terminate()  # what multiprocessing does at exit
    worker.join(1.0)
    assert worker.is_alive()
    _kill_daemonic_children()
    assert not worker.is_alive() and worker.exitcode == -signal.SIGKILL


_OPEN_LOADERS: list = []  # what keeps a loader open on the way out, as an exception's traceback can


class _Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict:
        return {"index": index, "skipped": []}


def _exit_with_a_loader_open(started: str) -> None:
    loader = build_loader(_Numbers(), range(8), 2, num_workers=1)
    batches = iter(loader)
    next(batches)  # the worker runs, ignoring SIGTERM
    _OPEN_LOADERS.append(batches)
    Path(started).write_text("worker started")
    raise SystemExit(3)


@pytest.mark.slow
def test_a_process_started_by_multiprocessing_ends_with_its_loader_open(tmp_path):
    """``obow tables run --jobs`` trains in processes that ``multiprocessing`` started, which run no ``atexit``
    handler before waiting for their daemonic children: the workers must still be killed, or a run stopped by
    SIGTERM (its loader left open) would hang after writing its checkpoint."""
    started = tmp_path / "started"
    process = multiprocessing.get_context("spawn").Process(target=_exit_with_a_loader_open, args=(str(started),))
    process.start()
    process.join(90)
    alive = process.is_alive()
    if alive:
        process.kill()
        process.join()
    assert started.read_text() == "worker started"
    assert not alive and process.exitcode == 3


_SIGNAL_WHILE_WORKERS_START = """
import os, signal, sys, threading, time, multiprocessing
import torch
from obow.data.folders import build_loader


class Padded(torch.utils.data.Dataset):
    def __init__(self):
        self.pad = b"x" * 300_000  # more than a pipe holds: starting a worker writes it to the worker's pipe

    def __setstate__(self, state):  # in the spawned worker, before its init function
        self.__dict__.update(state)
        time.sleep(1.0)

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return {"index": index, "skipped": []}


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")  # as inside `obow tables run --jobs`' processes
    received = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    # a signal to the whole group (Ctrl-C, timeout, a scheduler) while the workers import torch
    threading.Timer(0.3, os.killpg, (os.getpgid(0), signal.SIGTERM)).start()
    batches = iter(build_loader(Padded(), range(8), 4, num_workers=2))
    indices = sorted(int(i) for batch in batches for i in batch["index"])
    print(indices, received == [signal.SIGTERM])
"""


@pytest.mark.slow
def test_a_signal_to_the_group_while_spawned_workers_start_kills_no_worker(tmp_path):
    """A spawned worker takes seconds to reach its init function (which makes it ignore SIGINT and SIGTERM); a
    signal to the process group in that window used to kill it, and the training process then blocked for good
    writing the dataset to the dead worker's pipe (seen with `obow tables run --jobs 2` under `timeout`). The
    workers start with both signals blocked: they survive, every sample arrives, and the main process still
    receives its signal once."""
    import subprocess
    import sys

    script = tmp_path / "signal_while_workers_start.py"
    script.write_text(_SIGNAL_WHILE_WORKERS_START)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # its own process group, which the script signals
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[0, 1, 2, 3, 4, 5, 6, 7] True"


def test_the_worker_safe_loader_with_the_default_start_method_restores_the_signal_mask():
    """With the default start method (fork on Linux) the loader blocks SIGINT and SIGTERM only while its workers
    start: every sample arrives and the main thread's signal mask is as it was."""
    n = sum(len(batch["index"]) for batch in build_loader(_Numbers(), range(8), 2, num_workers=1))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert (n, multiprocessing.get_start_method(), mask) == (8, multiprocessing.get_all_start_methods()[0], set())


def test_tiny_images_are_named_in_their_items(tmp_path):
    """An image whose shorter side is under ``tiny_below`` is used as it is, and its item names it with that side
    (``tiny``), for the training loop to report once; ``collate`` gathers a batch's; ``tiny_below`` follows
    :data:`TINY_UPSCALE` (a quarter of the side the views are made from, rounded up)."""
    from obow.data.folders import TINY_UPSCALE, tiny_below

    folder = tmp_path / "a"
    folder.mkdir()
    for name, size in (("big.png", (32, 32)), ("one.png", (1, 1)), ("strip.png", (2, 50)), ("edge.png", (7, 9))):
        Image.new("RGB", size, (90, 90, 90)).save(folder / name)
    images = scan_images(str(tmp_path), labels="folders")
    assert TINY_UPSCALE == 4 and (tiny_below(28), tiny_below(32), tiny_below(256)) == (7, 8, 64)
    dataset = ImageDataset(images, tiny_below=7)
    items = {Path(path).name: dataset[i] for i, path in enumerate(images.paths)}
    assert {name: item["tiny"] for name, item in items.items()} == {
        "big.png": (), "edge.png": (), "one.png": ((str(folder / "one.png"), 1),),
        "strip.png": ((str(folder / "strip.png"), 2),),
    }  # fmt: skip
    assert items["one.png"]["image"].size == (1, 1)  # used, not skipped
    batch = collate([{**item, "image": 0} for item in items.values()])
    assert sorted(side for _, side in batch["tiny"]) == [1, 2] and batch["skipped"] == []
    assert all(item["tiny"] == () for item in map(ImageDataset(images).__getitem__, range(4)))  # by default none


@pytest.mark.parametrize("recipe", ["demo", "demo_fp32", "cifar10_fast", "cifar10_resnet18", "imagenette_fast"])
def test_the_recipes_own_images_are_not_tiny_and_a_pixel_is(recipe):
    """The side the views are made from counts the patch grid only where there are patches: the demo's 32 px
    mosaics (no patches, a 28 px teacher resize, a 256 px default grid size) were all reported tiny, one warning
    each, when the grid's size counted; CIFAR-10's 32 px images are not tiny for its recipes either."""
    from obow.config import load_config
    from obow.data.folders import tiny_below
    from obow.methods import used_side

    views = load_config(recipe, []).views
    own = 32 if recipe != "imagenette_fast" else 160
    assert own >= tiny_below(used_side(views)) > 1
