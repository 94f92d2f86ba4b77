"""obow show words / run / neighbours: patches are the expected crops, the streamed top-8 is the brute-force
one, and the pictures hold what they should."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import one_error_line
from PIL import Image
from torch import nn

from obow.backbones import BackboneOutput
from obow.cli import common as cli_common
from obow.config import ViewsConfig
from obow.data.eval_sets import eval_dataset
from obow.show.neighbours import nearest
from obow.show.run_plots import panels_for, read_run
from obow.show.words import (
    TITLE_HEIGHT,
    LevelVocabulary,
    RunningTopK,
    choose_words,
    collect_word_statistics,
    cut_patches,
    receptive_box,
    write_grid,
    write_html,
)
from obow.weights.load import NETWORKS

STRIDE = 8
VIEWS = ViewsConfig(teacher_resize=32, teacher_size=32, crop_size=24, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))


class PoolBackbone(nn.Module):
    """conv5 = the image averaged over STRIDE x STRIDE cells: a map whose words are known colours."""

    def forward(self, x, levels=()):
        return BackboneOutput(pool5=x.mean(dim=(2, 3)), maps={level: F.avg_pool2d(x, STRIDE) for level in levels})


def pixels_of(image_path):
    return np.asarray(Image.open(image_path).convert("RGB"))


def test_cli_networks_are_the_library_ones():
    assert cli_common.NETWORKS == NETWORKS


def test_receptive_box_by_hand():
    # 4x4 map of a 32 px view (stride 8), border 1: interior (0, 0) is cell (1, 1), widened by one cell
    assert receptive_box(0, 0, (4, 4), (32, 32), border=1) == (0, 0, 24, 24)
    assert receptive_box(1, 0, (4, 4), (32, 32), border=1) == (8, 0, 32, 24)
    assert receptive_box(1, 1, (4, 4), (32, 32), border=1, context=0) == (16, 16, 24, 24)
    # a non-integer stride (30 px over 4 cells: 7.5): rows -7.5..15 and columns 7.5..30, outward, clipped
    assert receptive_box(0, 2, (4, 4), (30, 30), border=0) == (0, 7, 15, 30)


def test_a_patch_is_the_crop_of_the_word_location(tmp_path):
    rng = np.random.default_rng(0)
    pixels = rng.integers(60, 120, (32, 32, 3), dtype=np.uint8)
    pixels[16:24, 8:16] = (230, 20, 20)  # cell (2, 1) of the stride-8 grid: interior location (1, 0)
    (tmp_path / "img").mkdir()
    Image.fromarray(pixels).save(tmp_path / "img" / "a.png")
    Image.fromarray(rng.integers(60, 120, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "img" / "b.png")
    dataset = eval_dataset(tmp_path / "img", VIEWS, labels="none")
    red = (torch.tensor([230.0, 20.0, 20.0]) / 255 - 0.5) / 0.25  # the red cell's conv5 feature
    words = torch.stack([red, torch.zeros(3)])
    vocabulary = LevelVocabulary("conv5", words, delta=0.1, border=1)
    stats = collect_word_statistics(PoolBackbone(), vocabulary, dataset, batch_size=2)
    assert (int(stats.images[0, 0]), int(stats.rows[0, 0]), int(stats.cols[0, 0])) == (0, 1, 0)
    assert stats.map_size == (4, 4) and stats.view_size == (32, 32) and stats.total == 8
    patches = cut_patches(stats, dataset, [0], VIEWS.mean, VIEWS.std, border=1)
    best = patches[0][0]
    assert best["box"] == (8, 0, 32, 24)
    np.testing.assert_array_equal(best["pixels"], pixels[8:32, 0:24])
    write_html(patches, stats.usage(), tmp_path / "out", "test")
    np.testing.assert_array_equal(pixels_of(tmp_path / "out" / "patches" / "word0_0.png"), pixels[8:32, 0:24])
    assert len(patches[0]) == 8  # 2 images x 4 locations: every location is some word's candidate


def brute_force_top(maps, words, delta, n):
    """Codes of every location of every image in float64 NumPy, and each word's n best (image, location)."""
    b, c, h, w = maps.shape
    features = maps[:, :, 1:-1, 1:-1].reshape(b, c, -1).transpose(0, 2, 1)  # [B, N, C]
    dist = ((features[:, :, None, :] - words[None, None]) ** 2).sum(-1)
    logits = -dist / delta
    codes = np.exp(logits - logits.max(-1, keepdims=True))
    codes /= codes.sum(-1, keepdims=True)
    flat = codes.reshape(-1, words.shape[0]).T  # [K, B*N]
    order = np.argsort(-flat, axis=1, kind="stable")[:, :n]
    counts = np.bincount(dist.argmin(-1).ravel(), minlength=words.shape[0])
    return np.take_along_axis(flat, order, 1), order // features.shape[1], order % features.shape[1], counts


def test_streamed_top8_equals_numpy_brute_force(tmp_path):
    rng = np.random.default_rng(1)
    (tmp_path / "img").mkdir()
    for i in range(7):
        Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(tmp_path / "img" / f"{i}.png")
    views = ViewsConfig(teacher_resize=40, teacher_size=40, crop_size=28, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    dataset = eval_dataset(tmp_path / "img", views, labels="none")
    words = torch.randn(6, 3) * 0.3
    vocabulary = LevelVocabulary("conv5", words, delta=0.05, border=1)
    stats = collect_word_statistics(PoolBackbone(), vocabulary, dataset, batch_size=3)  # 5x5 maps, 9 locations
    maps = F.avg_pool2d(torch.stack([dataset[i]["image"] for i in range(7)]), STRIDE).double().numpy()
    scores, images, locations, counts = brute_force_top(maps, words.double().numpy(), 0.05, 8)
    np.testing.assert_allclose(stats.scores.numpy(), scores, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(stats.images.numpy(), images)
    np.testing.assert_array_equal((stats.rows * 3 + stats.cols).numpy(), locations)
    np.testing.assert_array_equal(stats.counts.numpy(), counts)
    assert stats.total == 63 and int(stats.counts.sum()) == 63
    most = choose_words(stats, "most-used", 3)
    assert [int(counts[w]) for w in most] == sorted(counts, reverse=True)[:3]
    assert choose_words(stats, "2,5", 3) == [2, 5]
    assert choose_words(stats, "random", 4, seed=3) == choose_words(stats, "random", 4, seed=3)
    with pytest.raises(ValueError, match=r"word indices must be in \[0, 5\]"):
        choose_words(stats, "1,6")
    with pytest.raises(ValueError, match="give most-used or random, or word indices"):
        choose_words(stats, "often")


def test_streamed_top8_with_ties_keeps_the_earliest():
    # saturated codes (many exactly equal scores), streamed in uneven batches: the earliest locations win ties
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 3, (11, 4, 5)).astype(np.float64) / 2  # [B, N, K] in {0, 0.5, 1}
    top = RunningTopK(5, 8)
    for start, stop in ((0, 3), (3, 4), (4, 11)):
        top.update(torch.from_numpy(codes[start:stop]), torch.arange(start, stop))
    flat = codes.reshape(-1, 5).T
    order = np.argsort(-flat, axis=1, kind="stable")[:, :8]
    np.testing.assert_array_equal(top.scores.numpy(), np.take_along_axis(flat, order, 1))
    np.testing.assert_array_equal(top.images.numpy(), order // 4)
    np.testing.assert_array_equal(top.locations.numpy(), order % 4)


def count_tiles(grid, rows, n, tile=64, gap=4, label_width=110, top=0):
    """Tiles of the grid that hold a patch (not the white background), per row (below a title band of ``top``)."""
    pixels = np.asarray(grid)
    found = []
    for r in range(rows):
        y = top + gap + r * (tile + gap)
        found.append(
            sum(bool((pixels[y : y + tile, label_width + j * (tile + gap) :][:, :tile] != 255).any()) for j in range(n))
        )
    return found


def test_grid_and_html_hold_every_patch(tmp_path):
    rng = np.random.default_rng(2)
    patches = {
        w: [
            {"pixels": rng.integers(0, 200, (10, 12, 3), dtype=np.uint8), "box": (0, 0, 10, 12), "path": f"{w}_{j}.png"}
            | {"image": j, "name": f"c{w}/{w}_{j}.png", "row": 0, "col": j, "score": 0.5}
            for j in range(count)
        ]
        for w, count in ((4, 8), (1, 3))
    }
    usage = torch.zeros(5, dtype=torch.float64)
    usage[4], usage[1] = 0.25, 0.125
    write_grid(patches, usage, tmp_path / "words.png")
    grid = Image.open(tmp_path / "words.png")
    assert grid.size == (110 + 8 * 68, 2 * 68 + 4)
    assert count_tiles(grid, 2, 8) == [8, 3]
    page = write_html(patches, usage, tmp_path, "t").read_text()
    assert page.count("<img ") == 11 and page.count("<figcaption>") == 11
    assert re.findall(r"<h2>(.*?)</h2>", page) == [
        "word 4: usage 25.00% of locations, 8 patches",
        "word 1: usage 12.50% of locations, 3 patches",
    ]
    assert all((tmp_path / src).is_file() for src in re.findall(r'src="([^"]+)"', page))
    # a file name in no UTF-8 (an old archive's, read by Python with its bytes as surrogates): written escaped
    patches[4][0]["name"] = "c4/caf\udce9 <1>.png"
    page = write_html(patches, usage, tmp_path, "t").read_text()
    assert "c4/caf\\udce9 &lt;1&gt;.png, location" in page


@pytest.mark.slow
def test_show_run_plots_a_real_run_and_overlays_two(tiny_run, tmp_path, obow_cli):
    out = tiny_run.out
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert any("student/effective_rank" in r for r in records)  # a real run logs the collapse diagnostics
    plain = tmp_path / "run_without_student_metrics"  # the same run without them: their panels must not appear
    plain.mkdir()
    (plain / "log.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in r.items() if not k.startswith("student/")}) + "\n" for r in records)
    )
    run = read_run(plain)
    titles = [p.title for p in panels_for([run])]
    assert titles[0].startswith("loss per group") and "learning rate" in titles and "images/s" in titles
    assert "kNN top-1 per epoch (%)" in titles
    loss_panel = panels_for([run])[0]
    assert ("loss/group0/conv4", False) in loss_panel.series and ("conv4/kl_to_mean_bow", True) in loss_panel.series
    assert not any(t.startswith("student/") for t in titles)  # not logged by this run: no empty panel
    png = tmp_path / "curves.png"
    assert f"wrote {png}" in obow_cli("show", "run", plain, "--out", png).out
    assert titles == [
        "loss per group and level (dashed: kl_to_mean_bow)",
        "BoW perplexity (solid: batch, dashed: per image)",
        "spread of the student's predicted BoWs (solid: KL to their mean; dashed: the targets')",
        "mean cosine between the prediction weights",
        "share of words used",
        "learning rate",
        "kNN top-1 per epoch (%)",
        "images/s",
    ]
    assert Image.open(png).size == (3 * 550, 3 * 360)  # 8 panels on a 3-column grid at 100 dpi
    # a second run that also logged a student/ metric: the panels of both, the runs overlaid
    other = tmp_path / "run_with_student_metrics"
    other.mkdir()
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    for i, record in enumerate(lines):
        if record.get("type") != "epoch":
            record["student/effective_rank"] = 10.0 + i
    (other / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"cut short')
    both = [read_run(plain), read_run(other)]
    assert [p.title for p in panels_for(both)][5] == "student/effective_rank"
    obow_cli("show", "run", plain, other, "--out", tmp_path / "both.png")
    assert Image.open(tmp_path / "both.png").size == (3 * 550, 4 * 360)  # 10 panels
    with pytest.raises(ValueError, match="holds several runs .*run_with_student_metrics.*: give the ones to draw"):
        read_run(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no log.jsonl"):
        read_run(tmp_path / "empty")


@pytest.mark.slow
def test_show_run_takes_a_demo_folder_for_the_run_inside_it(tiny_run, tmp_path, obow_cli):
    """``obow demo`` trains in ``runs/demo/pretrain``: ``obow show run runs/demo`` draws that run (issue 39)."""
    demo = tmp_path / "demo"
    (demo / "data").mkdir(parents=True)  # the demo's images sit beside the run
    shutil.copytree(tiny_run.out, demo / "pretrain")
    run = read_run(demo)
    assert run.name == "demo" and run.steps == read_run(demo / "pretrain").steps
    png = tmp_path / "curves.png"
    assert f"wrote {png}" in obow_cli("show", "run", demo, "--out", png).out


def test_show_words_end_to_end(tiny_run, tmp_path, obow_cli):
    words_out = tmp_path / "words"
    argv = ["show", "words", "--checkpoint", tiny_run.checkpoint, "--data", tiny_run.data / "val"]
    # four chosen words (most-used would leave out the words this tiny run never uses)
    printed = obow_cli(*argv, "--out", words_out, "--words", "12,13,14,15", "--workers", 0, "--device", "cpu").out
    assert "conv4: 4 words over 6 images" in printed and "wrote" in printed
    grid = Image.open(words_out / "words.png")
    assert grid.size == (110 + 8 * 68, TITLE_HEIGHT + 4 * 68 + 4)
    assert count_tiles(grid, 4, 8, top=TITLE_HEIGHT) == [8, 8, 8, 8]
    page = (words_out / "index.html").read_text()
    assert page.count("<img ") == 32 and page.count("<figcaption>") == 32 and page.count("<h2>") == 4
    assert len(list((words_out / "patches").glob("*.png"))) == 32
    obow_cli(*argv, "--out", tmp_path / "w2", "--words", "0,15", "--level", "conv4")
    assert (tmp_path / "w2" / "index.html").read_text().count("<h2>word ") == 2
    refused = obow_cli(*argv, "--out", tmp_path / "w3", "--level", "conv5", check=False)
    assert refused.code == 2 and "no vocabulary for conv5; its levels: conv4" in refused.err


def test_nearest_is_cosine_brute_force():
    train, queries = torch.randn(20, 5), torch.randn(3, 5)
    a = queries.numpy() / np.linalg.norm(queries.numpy(), axis=1, keepdims=True)
    b = train.numpy() / np.linalg.norm(train.numpy(), axis=1, keepdims=True)
    expected = np.argsort(-(a @ b.T), axis=1)[:, :4]
    np.testing.assert_array_equal(nearest(train, queries, 4).numpy(), expected)


def test_show_neighbours_end_to_end(tiny_run, tmp_path, obow_cli):
    png = tmp_path / "nn.png"
    argv = ["show", "neighbours", "--checkpoint", tiny_run.checkpoint, "--data", tiny_run.data]
    printed = obow_cli(*argv, "--out", png, "--queries", 3, "--k", 4, "--workers", 0, "--device", "cpu").out
    assert "neighbours of the query's class: learned" in printed
    image = np.asarray(Image.open(png).convert("RGB"))
    cell = 64 + 6 + 6
    assert image.shape == (16 + 3 * cell, cell * 9 + 12, 3)
    # every neighbour has a green or red frame: 3 rows x 8 neighbours
    frames = 0
    for r in range(3):
        y = 16 + r * cell + 1
        for x0 in [cell + 6 + j * cell for j in range(4)] + [cell * 5 + 12 + j * cell for j in range(4)]:
            colour = tuple(image[y, x0 + 1])
            frames += colour in ((30, 170, 60), (210, 40, 40))
    assert frames == 24


def test_a_picture_out_is_checked_before_the_work_and_a_folder_gets_the_picture(tiny_run, tmp_path, obow_cli):
    """``show run`` and ``show neighbours`` write one picture: a name without a picture's ending, or with one the
    writer (matplotlib, Pillow) does not know, is one line before any work and nothing is written (matplotlib
    used to add ``.png`` to a name obow then reported without it; Pillow failed after the work); an existing
    folder gets ``curves.png`` / ``neighbours.png`` inside it, and a known ending is written in that format."""
    neighbours = ["show", "neighbours", "--checkpoint", tiny_run.checkpoint, "--data", tiny_run.data]
    for argv in (["show", "run", tiny_run.out], neighbours):
        command = argv[1]
        line = one_error_line(obow_cli(*argv, "--out", tmp_path / "pictures", check=False))
        assert line == (
            f"obow: error: --out {tmp_path / 'pictures'}: obow show {command} writes one picture; give e.g. --out "
            f"{tmp_path / 'pictures'}.png, or an existing folder"
        )
        line = one_error_line(obow_cli(*argv, "--out", tmp_path / "curves.xyz", check=False))
        assert line.startswith(f"obow: error: --out {tmp_path / 'curves.xyz'}: obow show {command} cannot write a .xyz")
        assert ".jpg" in line and ".png" in line and ".webp" in line
        assert sorted(os.listdir(tmp_path)) == []
    folder = tmp_path / "pictures"
    folder.mkdir()
    assert obow_cli("show", "run", tiny_run.out, "--out", folder).out.strip() == f"wrote {folder / 'curves.png'}"
    assert Image.open(folder / "curves.png").format == "PNG"
    assert f"wrote {tmp_path / 'c.pdf'}" in obow_cli("show", "run", tiny_run.out, "--out", tmp_path / "c.pdf").out
    assert (tmp_path / "c.pdf").read_bytes().startswith(b"%PDF")
    out = obow_cli(*neighbours, "--out", folder, "--queries", 2, "--k", 2, "--workers", 0, "--device", "cpu").out
    assert f"wrote {folder / 'neighbours.png'}" in out and Image.open(folder / "neighbours.png").format == "PNG"
