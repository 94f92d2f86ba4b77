"""The demo's data: digit mosaics (generated) and the CIFAR-10 subset (downloaded by torchvision)."""

import functools
import hashlib
import http.server
import io
import pickle
import socket
import tarfile
import threading
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torchvision.datasets.cifar as cifar_module
from PIL import Image
from sklearn.datasets import load_digits
from torchvision.datasets import CIFAR10

from obow.cli import DEMO_DATASETS, main
from obow.experiments.demo import (
    DATASETS,
    DIGIT_ROTATION,
    DIGIT_SIDE,
    DIGITS_PER_MOSAIC,
    DemoDataUnavailable,
    digit_mosaic,
    paint_glyphs,
    plan_mosaics,
    render_digit,
    write_cifar10,
)


def test_the_command_offers_the_demos_datasets():
    assert DEMO_DATASETS == tuple(DATASETS)


def test_a_digit_rendered_at_its_own_size_is_the_scan_in_8_bits():
    scan = load_digits().images[7]
    expected = np.round(scan * (255.0 / 16.0)).astype(np.uint8)  # float64 reference of the 0-16 -> 0-255 scale
    np.testing.assert_array_equal(render_digit(scan, side=8, angle=0.0, size=8), expected)


def test_a_digit_turned_half_a_turn_is_the_array_rotated_twice():
    scan = load_digits().images[5]
    upright = render_digit(scan, side=32, angle=0.0, size=32)
    np.testing.assert_array_equal(render_digit(scan, side=32, angle=180.0, size=32), np.rot90(upright, 2))
    assert upright.max() > 200 and upright.min() == 0  # white strokes on black


def test_glyphs_are_painted_where_placed_and_the_brighter_pixel_wins():
    a = np.array([[10, 200], [0, 50]], dtype=np.uint8)
    b = np.array([[100, 100], [100, 100]], dtype=np.uint8)
    canvas = paint_glyphs([a, b], [(0, 0), (1, 1)], size=4)  # b's top-left pixel lies on a's bottom-right
    expected = np.array([[10, 200, 0, 0], [0, 100, 100, 0], [0, 100, 100, 0], [0, 0, 0, 0]], dtype=np.uint8)
    np.testing.assert_array_equal(canvas, expected)
    with pytest.raises(ValueError, match="a 2 px glyph at \\(3, 0\\) does not fit a 4 px image"):
        paint_glyphs([a], [(3, 0)], size=4)


def test_mosaics_hold_their_split_and_class_only():
    labels = load_digits().target
    rng = np.random.default_rng(0)
    split = rng.permutation(len(labels))[:300]
    plans = plan_mosaics(labels, split, copies=3, rng=rng)
    assert len(plans) == 900
    assert [int(p[0]) for p in plans] == list(np.repeat(split, 3))  # each scan leads its own mosaics
    assert {len(p) for p in plans} == set(range(DIGITS_PER_MOSAIC[0], DIGITS_PER_MOSAIC[1] + 1))
    for plan in plans:
        assert set(plan) <= set(split) and len(set(labels[plan])) == 1


def test_a_mosaic_shows_every_digit_it_holds():
    scans = load_digits().images[:4]
    rng = np.random.default_rng(3)
    mosaic = digit_mosaic(list(scans), rng, size=32)
    assert mosaic.shape == (32, 32) and mosaic.dtype == np.uint8
    rng = np.random.default_rng(3)  # the same draws again, one digit at a time
    for pixels in scans:
        side = int(rng.integers(DIGIT_SIDE[0], DIGIT_SIDE[1] + 1))
        glyph = render_digit(pixels, side, float(rng.uniform(-DIGIT_ROTATION, DIGIT_ROTATION)))
        x, y = rng.integers(0, 32 - side + 1, size=2)
        assert (mosaic[y : y + side, x : x + side] >= glyph).all()  # painted over only by brighter pixels
    assert (mosaic > 0).mean() < 0.9  # digits, not a filled square


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def write_cifar10_archive(path, rng, per_batch=12):
    """A CIFAR-10 archive in the format torchvision reads (``cifar-10-batches-py/`` of pickled dicts, rows of
    3,072 uint8 in channel-major order), small; returns the md5 of every member and of the archive, and
    the images of the training batches and the test batch as ``[N, 32, 32, 3]`` with their labels."""
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    members, images = {}, {}
    for name in names:
        pixels = rng.integers(0, 256, (per_batch, 32, 32, 3), dtype=np.uint8)
        labels = [int(c) for c in rng.permutation(np.arange(per_batch) % 10)]  # every class, in shuffled order
        rows = pixels.transpose(0, 3, 1, 2).reshape(per_batch, -1)
        members[name] = pickle.dumps({"data": rows, "labels": labels, "batch_label": name})
        images[name] = (pixels, np.array(labels))
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    members["batches.meta"] = pickle.dumps({"label_names": classes})
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    md5 = {name: _md5(data) for name, data in members.items()}
    md5["archive"] = _md5(path.read_bytes())
    return md5, images, classes


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # torchvision's redirect probe hangs up before the body is sent: the broken pipe is expected


@pytest.fixture
def local_cifar10(tmp_path, monkeypatch):
    """torchvision's CIFAR10 pointed at a small archive served over HTTP on the loopback interface (its URL
    and md5s patched on the class), so that torchvision's own downloader fetches it."""
    archive = tmp_path / "served" / "cifar-10-python.tar.gz"
    archive.parent.mkdir()
    md5, images, classes = write_cifar10_archive(archive, np.random.default_rng(0))
    server = QuietServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(archive.parent)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(CIFAR10, "url", f"http://127.0.0.1:{server.server_port}/{archive.name}")
    monkeypatch.setattr(CIFAR10, "tgz_md5", md5["archive"])
    monkeypatch.setattr(CIFAR10, "train_list", [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)])
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(CIFAR10, "meta", {"filename": "batches.meta", "key": "label_names", "md5": md5["batches.meta"]})
    yield archive, images, classes
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    """A loopback port that nothing listens on (bound, then released): connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cifar10_is_downloaded_and_written_as_class_folders(tmp_path, local_cifar10):
    archive, images, classes = local_cifar10
    train, val = write_cifar10(tmp_path / "data", tmp_path / "download", per_class=(2, 1))
    assert (tmp_path / "download" / archive.name).read_bytes() == archive.read_bytes()  # fetched from the URL
    assert sorted(p.name for p in train.iterdir()) == sorted(p.name for p in val.iterdir()) == sorted(classes)
    train_pixels = np.concatenate([images[f"data_batch_{i}"][0] for i in range(1, 6)])
    train_labels = np.concatenate([images[f"data_batch_{i}"][1] for i in range(1, 6)])
    for split, (pixels, labels), count in ((train, (train_pixels, train_labels), 2), (val, images["test_batch"], 1)):
        for label, name in enumerate(classes):
            files = sorted((split / name).glob("*.png"))
            first = np.flatnonzero(labels == label)[:count]  # the first images of each class, in file order
            assert [int(f.stem) for f in files] == list(first)
            for f, i in zip(files, first, strict=True):
                np.testing.assert_array_equal(np.asarray(Image.open(f)), pixels[i])


def test_cifar10_written_once_is_not_fetched_again(tmp_path, local_cifar10):
    archive, _, _ = local_cifar10
    write_cifar10(tmp_path / "data", tmp_path / "download", per_class=(1, 1))
    archive.unlink()  # the server has nothing more to give: what was written must do
    train, _ = write_cifar10(tmp_path / "data", tmp_path / "download", per_class=(1, 1))
    assert len(list(train.rglob("*.png"))) == 10


def test_without_a_network_the_cifar10_demo_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    url = f"http://127.0.0.1:{closed_port()}/cifar-10-python.tar.gz"  # no server: the connection is refused
    monkeypatch.setattr(CIFAR10, "url", url)
    with pytest.raises(DemoDataUnavailable, match=f"cannot download CIFAR-10 from {url}"):
        write_cifar10(tmp_path / "a", tmp_path / "download")
    assert main(["demo", "--dataset", "cifar10", "--out", str(tmp_path / "b")]) == 2
    assert list(tmp_path.iterdir()) == []  # no empty download folder left behind
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot download CIFAR-10" in err and "without --dataset" in err


def failing_download(partial: bytes):
    """A stand-in for torchvision's downloader that makes its folder, writes ``partial`` bytes of the archive
    (as a download cut off midway does) and fails as a refused connection does."""

    def download(url, root, filename=None, md5=None, **kwargs):
        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / filename).write_bytes(partial)
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    return download


def test_a_failed_download_leaves_none_of_the_folders_it_made(tmp_path, monkeypatch):
    monkeypatch.setattr(cifar_module, "download_and_extract_archive", failing_download(b"\x1f\x8b half"))
    out = tmp_path / "demo-cifar10"  # the demo's --out, not there yet
    with pytest.raises(DemoDataUnavailable, match="Connection refused"):
        write_cifar10(out / "data" / "cifar10", out / "data" / "download")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_download_into_an_existing_folder_removes_only_what_it_added(tmp_path, monkeypatch):
    monkeypatch.setattr(cifar_module, "download_and_extract_archive", failing_download(b"\x1f\x8b half"))
    download = tmp_path / "download"
    download.mkdir()
    (download / "notes.txt").write_text("the user's")
    with pytest.raises(DemoDataUnavailable):
        write_cifar10(tmp_path / "data", download)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["download"]
    assert [p.name for p in download.iterdir()] == ["notes.txt"]
