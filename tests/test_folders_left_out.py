"""What a scan of ``--data`` leaves out, each kind counted in one line (issue 66, items 5 and 9): symbolic links
that lead nowhere (a loop: ``Too many levels of symbolic links``, which stopped ``pretrain`` and ``eval`` before
they started; a missing target), and files of a kind not listed (an animated GIF, a text file), counted by
extension."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from PIL import Image

from obow.data.eval_sets import eval_dataset, views_from_dict
from obow.data.folders import scan_images


def write_png(path, value: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, dtype=np.uint8)).save(path)


def left_out_lines(caught) -> list[str]:
    return [str(w.message) for w in caught]


@pytest.fixture
def folder(tmp_path):
    """Two classes of two images, with two links in a loop, a link to itself, a dangling link, an animated GIF, a
    text file and a hidden file."""
    root = tmp_path / "data"
    for c in ("a", "b"):
        for i in range(2):
            write_png(root / c / f"{i}.png", 60 * i)
    os.symlink("loop_2.png", root / "a" / "loop_1.png")
    os.symlink("loop_1.png", root / "a" / "loop_2.png")
    os.symlink("self", root / "b" / "self")
    os.symlink("missing.jpg", root / "b" / "gone.jpg")
    frames = [Image.new("RGB", (8, 8), (i * 80, 0, 0)) for i in range(3)]
    frames[0].save(root / "a" / "moving.gif", save_all=True, append_images=frames[1:])
    (root / "b" / "labels.txt").write_text("not an image")
    (root / "b" / ".hidden.txt").write_text("not counted: hidden")
    return root


@pytest.mark.parametrize("labels", ["folders", "none", "auto"])
def test_links_that_lead_nowhere_and_other_files_are_left_out_in_one_line_each(folder, labels):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        images = scan_images(folder, labels)
    assert sorted(os.path.relpath(p, folder) for p in images.paths) == ["a/0.png", "a/1.png", "b/0.png", "b/1.png"]
    lines = left_out_lines(caught)
    assert lines == [
        f"under {folder}, 2 files left out: not images of a listed kind (.gif 1, .txt 1)",
        f"under {folder}, 4 symbolic links skipped: they lead nowhere (a loop or a missing target, e.g. "
        f"{folder / 'a' / 'loop_1.png'})",
    ]


def test_a_symlink_loop_does_not_stop_an_evaluation_set(folder):
    """``obow eval`` scans its folders through the same scan (:func:`obow.data.eval_sets.eval_dataset`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = eval_dataset(folder, views_from_dict(None, size=8))
    assert len(dataset) == 4 and dataset.images.classes == ["a", "b"]
    assert any("4 symbolic links skipped" in line for line in left_out_lines(caught))


def test_a_folder_of_only_left_out_files_says_what_it_left_out(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    os.symlink("x.png", root / "x.png")
    Image.new("RGB", (8, 8)).save(root / "only.gif")
    with pytest.raises(ValueError, match=r"no images found under .*1 file left out: not images of a listed kind "
                       r"\(\.gif 1\); 1 symbolic link skipped"):  # fmt: skip
        scan_images(root, "none")


def test_a_folder_with_nothing_left_out_says_nothing(tmp_path):
    write_png(tmp_path / "data" / "a" / "0.png")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scan_images(tmp_path / "data")
    assert left_out_lines(caught) == []
