"""The device pipeline's cache checked, not trusted (issue 66, item 1): a truncated file, a quarter of it written over
with 0xff (its size kept) or metadata that does not read is found when the cache is opened, or for a memory-mapped
cache when a batch first reads the damaged block, and rebuilt in one line; a build stopped by a signal (real
processes, real signals) removes its partial file and says so in one line, and the partial file of a build killed
outright is removed by the next build."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from obow.data import cache as cache_module
from obow.data.cache import BlockDigest, block_checksums, build_cache, human_bytes
from obow.data.device_loader import resident_copy
from obow.data.folders import scan_images


def write_images(folder, n: int, side: int = 12, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(folder / f"{i:03d}.png")


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """A cache of 40 random 12 px squares in blocks of 1,000 bytes (18 blocks: a block is many images here, as a
    real cache's 4 MiB are) and the pixels it must hold."""
    monkeypatch.setattr(cache_module, "BLOCK_BYTES", 1000)
    write_images(tmp_path / "data" / "a", 40)
    images = scan_images(str(tmp_path / "data"), labels="folders")
    cache = build_cache(images, 24, cache_dir=tmp_path / "cache")
    return images, cache, np.array(cache.pixels)


def test_file_names_in_no_utf8_are_cached_and_read_back(tmp_path):
    """A folder copied from an old archive, its names in Latin-1 (Python reads them as surrogates): the cache's keys
    digest the names' bytes (encoding them as UTF-8 stopped the run), and a second run reads the same cache back."""
    folder = os.path.join(os.fsencode(tmp_path / "data"), b"caf\xe9")
    os.makedirs(folder)
    for i in range(3):
        Image.new("RGB", (12, 10), (40 * i, 0, 0)).save(os.fsdecode(os.path.join(folder, b"\xe9t\xe9%d.png" % i)))
    images = scan_images(str(tmp_path / "data"), labels="folders")
    assert images.classes == ["caf\udce9"] and images.paths[0].endswith("/caf\udce9/\udce9t\udce90.png")
    cache = build_cache(images, 24, cache_dir=tmp_path / "cache")
    again = build_cache(images, 24, cache_dir=tmp_path / "cache")
    assert again.file == cache.file and len(list((tmp_path / "cache").glob("*.u8"))) == 1
    assert np.array_equal(np.asarray(again.pixels), np.asarray(cache.pixels)) and cache.sizes.tolist() == [[10, 12]] * 3


def rebuilt_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]


def test_block_checksums_are_crc32_of_each_block_however_the_bytes_come():
    data = np.random.default_rng(0).integers(0, 256, 2500, dtype=np.uint8).tobytes()
    expected = [zlib.crc32(data[0:1000]), zlib.crc32(data[1000:2000]), zlib.crc32(data[2000:])]
    assert block_checksums(data, 1000) == expected
    digest = BlockDigest(1000)
    for piece in (data[:7], data[7:1500], data[1500:2000], data[2000:2001], data[2001:]):
        digest.update(piece)
    assert digest.digest() == expected


def test_a_truncated_cache_is_rebuilt_in_one_line_not_a_traceback(cached, tmp_path, caplog):
    images, cache, pixels = cached
    with open(cache.file, "r+b") as f:
        f.truncate(cache.nbytes // 2)
    with caplog.at_level(logging.WARNING, logger="obow"):
        again = build_cache(images, 24, cache_dir=tmp_path / "cache")
    lines = rebuilt_lines(caplog)
    assert len(lines) == 1 and "truncated or written over" in lines[0] and "rebuilt" in lines[0]
    np.testing.assert_array_equal(again.pixels, pixels)
    assert torch.equal(again.batch(torch.arange(40)), torch.from_numpy(pixels).view(40, 3, 12, 12))


@pytest.mark.parametrize("where", ["memory", "memory-mapped"])
def test_a_quarter_written_over_with_0xff_is_found_and_rebuilt_never_trained_on(
    cached, tmp_path, caplog, monkeypatch, where
):
    """Its size kept: found by the checksums, when the cache is opened (read into memory) or when a batch first
    reads the block (memory-mapped), then rebuilt in one line, and the batch holds the images' own pixels."""
    images, cache, pixels = cached
    quarter = cache.nbytes // 4
    with open(cache.file, "r+b") as f:
        f.seek(quarter)
        f.write(b"\xff" * quarter)
    assert os.path.getsize(cache.file) == cache.nbytes
    with caplog.at_level(logging.WARNING, logger="obow"):
        if where == "memory-mapped":
            monkeypatch.setattr(cache_module, "available_memory", lambda: 100)  # less than twice the cache
            opened = build_cache(images, 24, cache_dir=tmp_path / "cache")
            assert opened.where == "memory-mapped" and not rebuilt_lines(caplog)  # nothing read yet
            first = opened.batch(torch.tensor([0, 1]))  # bytes before the damage: no rebuild yet
            assert not rebuilt_lines(caplog)
            batch = opened.batch(torch.arange(40))  # reads the damaged blocks
            assert torch.equal(first, torch.from_numpy(pixels).view(40, 3, 12, 12)[[0, 1]])
        else:
            opened = build_cache(images, 24, cache_dir=tmp_path / "cache")
            batch = opened.batch(torch.arange(40))
    lines = rebuilt_lines(caplog)
    assert len(lines) == 1 and "does not match its checksum" in lines[0] and "rebuilt" in lines[0], lines
    assert torch.equal(batch, torch.from_numpy(pixels).view(40, 3, 12, 12))
    assert not (np.fromfile(opened.file, np.uint8) == 0xFF).all()


def test_a_copy_to_the_gpu_checks_each_block_as_it_reads_it(cached, tmp_path, caplog, monkeypatch):
    """The loader's resident copy of a memory-mapped cache (on a GPU; here the CPU stands in): one read, each
    block checked on the way, a damaged one rebuilding the cache first."""
    images, cache, pixels = cached
    assert len(cache.checksums) == 18 and cache.block == 1000
    with open(cache.file, "r+b") as f:
        f.seek(cache.nbytes - 10)
        f.write(b"\xff" * 10)  # the last block only
    monkeypatch.setattr(cache_module, "available_memory", lambda: 100)
    opened = build_cache(images, 24, cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="obow"):
        copy = resident_copy(opened, torch.device("cpu"))
    assert len(rebuilt_lines(caplog)) == 1 and "block 18 of 18" in rebuilt_lines(caplog)[0]
    np.testing.assert_array_equal(copy.numpy(), pixels)
    assert opened.checked.all()


def test_metadata_that_does_not_read_is_rebuilt_in_one_line(cached, tmp_path, caplog):
    images, cache, pixels = cached
    meta = cache.file.with_suffix(".json")
    meta.write_text(meta.read_text()[:50])
    with caplog.at_level(logging.WARNING, logger="obow"):
        again = build_cache(images, 24, cache_dir=tmp_path / "cache")
    assert len(rebuilt_lines(caplog)) == 1 and "does not read" in rebuilt_lines(caplog)[0]
    np.testing.assert_array_equal(again.pixels, pixels)
    assert json.loads(meta.read_text())["bytes"] == cache.nbytes


def test_the_partial_file_of_a_build_killed_outright_is_removed_by_the_next_build(tmp_path, caplog):
    write_images(tmp_path / "data" / "a", 4)
    images = scan_images(str(tmp_path / "data"), labels="folders")
    first = build_cache(images, 24, cache_dir=tmp_path / "cache")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = first.file.with_name(f"{first.file.name}.{int(dead.stdout)}.partial")  # a dead build of the same key
    alive = first.file.with_name(f"{first.file.name}.{os.getppid()}.partial")  # a live one: left alone
    left.write_bytes(b"half")
    alive.write_bytes(b"half")
    first.file.unlink()  # to be built again
    with caplog.at_level(logging.INFO, logger="obow"):
        build_cache(images, 24, cache_dir=tmp_path / "cache")
    assert not left.exists() and alive.exists()
    lines = [r.getMessage() for r in caplog.records if "partial file" in r.getMessage()]
    assert len(lines) == 1 and left.name in lines[0]


@pytest.mark.parametrize(
    ("size", "said"),
    [
        (100, "100 bytes"),
        (12_288, "12.0 KiB"),
        (39_321_600, "37.5 MiB"),
        (694 * 2**20 + 1000, "694 MiB"),
        (1.5 * 2**30, "1.5 GiB"),
    ],
)
def test_sizes_are_said_in_the_unit_a_reader_expects(size, said):
    assert human_bytes(size) == said


# ---- a build stopped by a signal: real processes


BUILD = textwrap.dedent(
    """
    import logging, signal, sys, time
    from obow.cli import main

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever this test runs under
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    from obow.data import cache

    decode = cache._decode

    def slowly(*args):  # a build of a few hundred tiny images that lasts long enough to be signalled
        time.sleep(0.02)
        return decode(*args)

    cache._decode = slowly  # the forked decoding processes inherit it too
    if sys.argv[1] == "build-processes":  # the decoding pool however few the images, in chunks of 8
        cache.PROCESS_MIN_IMAGES, cache.CHUNK_IMAGES = 1, 8
        sys.argv[1] = "build"
    if sys.argv[1] == "build":  # the build alone, as `obow pretrain` calls it (cheaper: no recipe, no model)
        from obow.data.folders import scan_images

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        cache.build_cache(scan_images(sys.argv[2]), 24, cache_dir=sys.argv[3])
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
    """
)


def start_build(tmp_path, tiny_recipe, via: str = "cli") -> tuple[subprocess.Popen, object]:
    """A process building a cache of 300 tiny images, through `obow pretrain` (``via="cli"``) or the build alone
    (``"build"``), once it has started writing its partial file."""
    write_images(tmp_path / "data" / "a", 300, side=8)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    data, folder = str(tmp_path / "data"), str(tmp_path / "cache")
    command = [sys.executable, "-c", BUILD, via, data, folder] if via.startswith("build") else [
        sys.executable, "-c", BUILD, "pretrain", "--config", str(tiny_recipe), "--data", data,
        "--out", str(tmp_path / "run"), "data.pipeline=device", f"data.cache_dir={folder}",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "cache").glob("*.partial")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    return proc, tmp_path / "cache"


@pytest.mark.parametrize(
    ("signum", "code", "via"),
    [
        (signal.SIGTERM, 143, "build"),
        (signal.SIGTERM, 143, "build-processes"),
        pytest.param(signal.SIGTERM, 143, "cli", marks=pytest.mark.slow),
        pytest.param(signal.SIGINT, 130, "cli", marks=pytest.mark.slow),
        pytest.param(signal.SIGHUP, 129, "cli", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_a_build_stopped_by_a_signal_leaves_nothing_and_says_so_in_one_line(tmp_path, tiny_recipe, signum, code, via):
    proc, folder = start_build(tmp_path, tiny_recipe, via)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    name = signal.Signals(signum).name
    assert proc.returncode == code, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "image cache build stopped" in line]
    assert len(lines) == 1 and f"{name}: the image cache build stopped after" in lines[0], err
    assert "of 300 images; its partial file is removed" in lines[0]
    assert not list(folder.iterdir()), "a stopped build leaves nothing behind"


def test_a_stop_while_the_sizes_are_read_says_one_line_and_writes_nothing(tmp_path, monkeypatch, caplog):
    """Reading the headers of a large folder takes minutes: a signal then stops the build in one line too, and is
    passed on to the handler that was there before (here one of the caller's; a signal's default ends the
    process, as the tests with real processes above check), its handlers handed back."""

    class CallersStop(Exception):
        pass

    def callers_handler(signum, frame):
        raise CallersStop(signum)

    write_images(tmp_path / "data" / "a", 4)
    previous = signal.signal(signal.SIGTERM, callers_handler)
    try:

        def signalled(images):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
            raise AssertionError("not stopped")

        monkeypatch.setattr(cache_module, "sizes_summary", signalled)
        with caplog.at_level(logging.WARNING, logger="obow"), pytest.raises(CallersStop):
            build_cache(scan_images(str(tmp_path / "data"), labels="folders"), 24, cache_dir=tmp_path / "cache")
        assert signal.getsignal(signal.SIGTERM) is callers_handler  # handed back
    finally:
        signal.signal(signal.SIGTERM, previous)
    said = "SIGTERM: the image cache build stopped while reading the images' sizes; nothing was written"
    assert caplog.messages == [said]
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


@pytest.mark.slow
def test_a_build_killed_outright_leaves_a_partial_file_the_next_build_removes(tmp_path, tiny_recipe, caplog):
    proc, folder = start_build(tmp_path, tiny_recipe)
    proc.kill()
    proc.communicate(timeout=60)
    (left,) = folder.glob("*.partial")
    with caplog.at_level(logging.INFO, logger="obow"):
        cache = build_cache(scan_images(str(tmp_path / "data"), labels="folders"), 24, cache_dir=folder)
    assert not left.exists() and len(cache.images) == 300
    assert any("partial file" in r.getMessage() and left.name in r.getMessage() for r in caplog.records)
    assert sorted(p.suffix for p in folder.iterdir()) == [".json", ".u8"]


def test_a_signal_during_a_rebuild_under_a_run_stops_it_at_a_checkpoint_not_as_a_second_signal(
    tmp_path, tiny_recipe, obow_cli, monkeypatch
):
    """A memory-mapped cache found damaged as the run reads a batch is rebuilt under the run; a Ctrl-C during that
    rebuild stopped it (its one line) and then the run, said as "a second signal" after only one. Now the run
    stops there, between two steps, with its checkpoint written, and the same command ends the run."""
    monkeypatch.setattr(cache_module, "BLOCK_BYTES", 1000)
    for name in ("a", "b"):
        write_images(tmp_path / "data" / name, 16, seed=ord(name))
    args = ("pretrain", "--config", tiny_recipe, "--data", tmp_path / "data", "--out", tmp_path / "run",
            "data.pipeline=device", f"data.cache_dir={tmp_path / 'cache'}", "train.knn_every=0")  # fmt: skip
    assert obow_cli(*args, "optim.epochs=1").code == 0
    (file,) = (tmp_path / "cache").glob("*.u8")
    with open(file, "r+b") as f:
        f.seek(file.stat().st_size // 2)
        f.write(b"\xff" * (file.stat().st_size // 2))
    monkeypatch.setattr(cache_module, "available_memory", lambda: 100)  # memory-mapped: each block checked on read
    real = cache_module.decoded_in_order

    def signalled(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        yield from real(*a, **k)

    monkeypatch.setattr(cache_module, "decoded_in_order", signalled)
    written = (tmp_path / "run" / "checkpoint.pt").stat().st_mtime_ns
    result = obow_cli(*args, "optim.epochs=2", check=False)
    assert result.code == 130, result.err
    assert "a second signal" not in result.err and "Traceback" not in result.err
    assert "SIGINT: the image cache build stopped after" in result.err
    iteration = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["iteration"]
    assert iteration == 4  # one epoch of 32 images in batches of 8, the second epoch not begun
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    assert checkpoint.stat().st_mtime_ns != written  # written again where the signal stopped the run
    assert (
        f"SIGINT: the run stops with the image cache's rebuild, between two steps; the last checkpoint, {checkpoint} "
        "(iteration 4), is kept"
    ) in result.err
    monkeypatch.setattr(cache_module, "decoded_in_order", real)
    assert obow_cli(*args, "optim.epochs=2").code == 0
    assert torch.load(checkpoint, weights_only=False)["iteration"] == 8


def test_worker_processes_decode_what_one_thread_does_in_order_unreadable_files_included(tmp_path, monkeypatch):
    """A large folder is decoded by forked worker processes in chunks (here every folder, in chunks of 4): the same
    pixels, sizes and reasons, in the folder's order, as one by one in this thread; the whole cache file is the same
    bytes either way."""
    write_images(tmp_path / "data" / "a", 21, side=14)
    (tmp_path / "data" / "a" / "010.png").write_bytes(b"not a png")  # unreadable: left out, its reason kept
    images = scan_images(str(tmp_path / "data"), labels="folders")
    one_by_one = list(cache_module.decoded_in_order(images.paths, 10, False, workers=1))
    monkeypatch.setattr(cache_module, "PROCESS_MIN_IMAGES", 1)
    monkeypatch.setattr(cache_module, "CHUNK_IMAGES", 4)
    pooled = list(cache_module.decoded_in_order(images.paths, 10, False, workers=2))
    assert len(pooled) == len(one_by_one) == 21
    for (a, why_a), (b, why_b) in zip(one_by_one, pooled, strict=True):
        assert why_a == why_b and (a is None) == (b is None)
        assert a is None or (a.shape == b.shape == (3, 10, 10) and np.array_equal(a, b))
    assert pooled[10][0] is None and pooled[10][1]
    monkeypatch.setattr(cache_module.os, "cpu_count", lambda: 2)
    by_pool = build_cache(images, 10, cache_dir=tmp_path / "pooled")
    monkeypatch.setattr(cache_module, "PROCESS_MIN_IMAGES", 10**9)
    by_thread = build_cache(images, 10, cache_dir=tmp_path / "thread")
    assert np.array_equal(by_pool.pixels, by_thread.pixels) and len(by_pool.images) == 20


def test_a_decoding_task_holds_at_most_256_images_and_about_16_mib():
    """By the mean decoded image: CIFAR-10's 32 px (3,072 bytes): 256 a task; Imagenette's 160 px (76,800 bytes):
    16 MiB / 76,800 = 218; an ImageNet image kept at 500 x 375 (562,500 bytes): 29; one larger than 16 MiB: one."""
    assert cache_module.chunk_images(3 * 32 * 32) == 256
    assert cache_module.chunk_images(3 * 160 * 160) == 218
    assert cache_module.chunk_images(3 * 500 * 375) == 29
    assert cache_module.chunk_images(3 * 4000 * 3000) == 1
