"""A large JPEG decoded at a reduced scale (libjpeg's, through PIL's ``draft``) that keeps its shorter side at least
the recipe's sharp side: the same image to a fraction of a level, the same views in distribution, a fraction of the
work (a phone photo's epoch went from 9.1 s to 1.7 s in ``imagenette_fast``)."""

import numpy as np
import pytest
import torch
from PIL import Image, JpegImagePlugin
from scipy import stats
from sklearn.datasets import load_sample_image

from obow import OBoWViews, load_config
from obow.data.cache import build_cache, stored_sizes
from obow.data.decode import load_rgb, load_rgb_resized
from obow.data.eval_sets import eval_dataset, views_from_dict
from obow.data.folders import ImageDataset, scan_images
from obow.methods import cache_side
from obow.training.build import build_data

ALPHA = 1e-3


def photo(width: int, height: int) -> Image.Image:
    """scikit-learn's photo of a temple, resized (detail at every scale, as a real photo has)."""
    return Image.fromarray(load_sample_image("china.jpg")).resize((width, height), Image.Resampling.LANCZOS)


@pytest.fixture(scope="module")
def jpeg(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft") / "IMG_0001.jpg"
    photo(1600, 1200).save(path, quality=92)
    return path


@pytest.mark.parametrize(
    ("side", "size"),
    [(300, (400, 300)), (100, (200, 150)), (150, (200, 150)), (601, (1600, 1200)), (0, (1600, 1200))],
)
def test_the_scale_is_the_smallest_that_keeps_the_shorter_side(jpeg, side, size):
    """1/4 for 300 px (1/8 would give 150); 1/8 at most (libjpeg's smallest); none when 1/2 would go under the side
    (600 < 601), nor for 0."""
    assert load_rgb(jpeg, side).size == size


def test_the_reduced_image_is_the_whole_one_averaged(jpeg):
    """Against an independent reference: the full decode averaged over 4x4 blocks (PIL's box filter), to a
    fraction of a level on average and a few levels at most."""
    reduced = np.asarray(load_rgb(jpeg, 300), dtype=float)
    averaged = np.asarray(load_rgb(jpeg).resize((400, 300), Image.Resampling.BOX), dtype=float)
    assert np.abs(reduced - averaged).mean() < 1.0 and np.percentile(np.abs(reduced - averaged), 99) < 6


def test_other_kinds_small_jpegs_and_orientation(tmp_path):
    photo(1600, 1200).save(tmp_path / "big.png")
    assert load_rgb(tmp_path / "big.png", 300).size == (1600, 1200)  # PNG has no reduced decoding
    photo(500, 400).save(tmp_path / "small.jpg")
    assert load_rgb(tmp_path / "small.jpg", 300).size == (500, 400)
    img = photo(1600, 1200)
    exif = img.getexif()
    exif[0x0112] = 6  # stored sideways: shown rotated a quarter turn
    img.save(tmp_path / "sideways.jpg", exif=exif)
    upright = load_rgb(tmp_path / "sideways.jpg", 300)
    assert upright.size == (300, 400)
    expected = load_rgb(tmp_path / "sideways.jpg").resize((300, 400), Image.Resampling.BOX)
    assert np.abs(np.asarray(upright, dtype=float) - np.asarray(expected, dtype=float)).mean() < 1.0


def sharpness_stats(views: torch.Tensor) -> dict[str, np.ndarray]:
    """Per view: each channel's mean, the spread, and the mean step between neighbouring pixels (what a view made
    from too few pixels, upsampled, loses)."""
    out = {f"mean {c}": views[:, i].mean(dim=(1, 2)).numpy() for i, c in enumerate("RGB")}
    out["spread"] = views.std(dim=(1, 2, 3)).numpy()
    out["sharpness"] = (views[..., 1:] - views[..., :-1]).abs().mean(dim=(1, 2, 3)).numpy()
    return out


@pytest.mark.slow
def test_the_views_of_the_reduced_image_follow_those_of_the_whole_one(tmp_path):
    """``imagenette_fast``'s views of one 640x480 photo, decoded whole and at its sharp side (1/2, 320x240): the
    crops' and patches' colours, spread and sharpness have the same distributions (two-sample KS); an image
    reduced to 1/8 (80x60, upsampled into every view) is told apart by its sharpness."""
    cfg = load_config("imagenette_fast")
    side = cache_side(cfg)
    path = tmp_path / "photo.jpg"
    photo(640, 480).save(path, quality=92)
    whole, reduced, too_small = load_rgb(path), load_rgb(path, side), load_rgb(path, 60)
    assert reduced.size == (320, 240) and too_small.size == (80, 60) and min(reduced.size) >= side
    views = OBoWViews(cfg.views)
    n = 300

    def made(img: Image.Image, seed: int) -> dict[str, dict[str, np.ndarray]]:
        torch.manual_seed(seed)
        made = [views(img) for _ in range(n)]
        return {k: sharpness_stats(torch.cat([m[k] for m in made])) for k in ("crops", "patches")}

    a, b, c = made(whole, 0), made(reduced, 1), made(too_small, 2)
    for kind in ("crops", "patches"):
        for stat in a[kind]:
            assert stats.ks_2samp(a[kind][stat], b[kind][stat]).pvalue > ALPHA, (kind, stat)
        assert stats.ks_2samp(a[kind]["sharpness"], c[kind]["sharpness"]).pvalue < 1e-6, kind


def test_training_decodes_at_its_sharp_side_and_evaluation_whole(tmp_path):
    """The training loader's images keep the recipe's sharp side; an evaluation's are decoded whole."""
    (tmp_path / "a").mkdir()
    photo(1600, 1200).save(tmp_path / "a" / "0.jpg")
    cfg = load_config("imagenette_fast", [f"data.path={tmp_path}", "data.batch_size=1", "data.num_workers=0"])
    _, _, loader = build_data(cfg, torch.device("cpu"), pipeline="workers")
    dataset = loader.dataset
    assert isinstance(dataset, ImageDataset) and dataset.draft_side == cache_side(cfg) == 233
    dataset.transform = None  # the decoded image itself, not its views
    assert dataset[0]["image"].size == (400, 300)
    evaluated = eval_dataset(tmp_path, views_from_dict(None), labels="folders")
    assert evaluated.draft_side == 0  # decoded whole: an export's usage lines compute obow's features exactly


def filter_spread(path, size: tuple[int, int]) -> tuple[float, float]:
    """How far the image cache's reduced decode of ``path`` at ``size`` is from the whole decode resized to it by
    the cache's filter (bilinear, antialiased), and how far PIL's box filter of the whole decode is from that: the
    mean absolute difference in levels of each."""
    whole = load_rgb(path)
    bilinear = np.asarray(whole.resize(size, Image.Resampling.BILINEAR, reducing_gap=None), dtype=float)
    box = np.asarray(whole.resize(size, Image.Resampling.BOX), dtype=float)
    reduced = np.asarray(load_rgb_resized(path, lambda w, h: size), dtype=float)
    return float(np.abs(reduced - bilinear).mean()), float(np.abs(box - bilinear).mean())


@pytest.mark.parametrize(("width", "height", "side"), [(1001, 803, 100), (1001, 803, 300), (1600, 1200, 300)])
def test_a_reduced_decode_resized_is_as_close_to_the_whole_one_as_another_filter(tmp_path, width, height, side):
    """:func:`load_rgb_resized`: the reduced pixels' box (the part the image covers: libjpeg rounds 1001/8 up to 126)
    resized to the size differs from the whole decode resized no more than the box filter of the whole decode does
    (1.1x at most). Resizing the reduced pixels without that box (126 columns taken for 125.125) is 2.4x further
    (6.1 levels against 2.5 at 1001x803 to 125x100: measured)."""
    photo(width, height).save(tmp_path / "a.jpg", quality=92)
    size = (round(width * side / height), side)
    assert load_rgb_resized(tmp_path / "a.jpg", lambda w, h: size).size == size
    reduced, other_filter = filter_spread(tmp_path / "a.jpg", size)
    assert reduced <= 1.1 * other_filter, (reduced, other_filter)
    whole = load_rgb_resized(tmp_path / "a.jpg", lambda w, h: size, reduced=False)
    expected = load_rgb(tmp_path / "a.jpg").resize(size, Image.Resampling.BILINEAR, reducing_gap=None)
    assert np.array_equal(np.asarray(whole), np.asarray(expected))  # not reduced: as before, pixel for pixel


@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_reduced_decode_is_made_upright_by_every_exif_orientation(tmp_path, orientation):
    """The size is asked of the whole upright image (width and height swapped for a quarter turn), and the reduced
    pixels are turned as the whole ones are: within a few levels of the whole decode resized (a turn or flip
    missed would be tens of levels off)."""
    img = photo(1001, 803)
    exif = img.getexif()
    exif[0x0112] = orientation
    img.save(tmp_path / "a.jpg", exif=exif, quality=92)
    asked = []

    def size_of(width: int, height: int) -> tuple[int, int]:
        asked.append((width, height))
        return round(width * 100 / min(width, height)), round(height * 100 / min(width, height))

    got = load_rgb_resized(tmp_path / "a.jpg", size_of)
    whole = load_rgb(tmp_path / "a.jpg")
    assert asked == [whole.size] == [(803, 1001) if orientation >= 5 else (1001, 803)]
    expected = whole.resize(got.size, Image.Resampling.BILINEAR, reducing_gap=None)
    assert got.size == size_of(*whole.size)
    assert np.abs(np.asarray(got, dtype=float) - np.asarray(expected, dtype=float)).mean() < 3


def test_the_image_cache_decodes_large_jpegs_reduced_at_the_whole_images_stored_size(tmp_path, monkeypatch):
    """The device pipeline's cache: a JPEG of at least twice its stored size is decoded at a reduced scale (``draft``
    called), stored at the size its whole decode is stored at (:func:`stored_sizes` of the whole upright size),
    close to the whole decode resized (see above); a PNG and a JPEG under twice the size are decoded whole and
    resized, pixel for pixel as before."""
    folder = tmp_path / "photos"
    folder.mkdir()
    photo(1001, 803).save(folder / "a.jpg", quality=92)
    sideways = photo(1001, 803)
    exif = sideways.getexif()
    exif[0x0112] = 8
    sideways.save(folder / "b.jpg", exif=exif, quality=92)
    photo(300, 180).save(folder / "c.jpg", quality=92)  # under twice the size: whole, resized
    photo(1001, 803).save(folder / "d.png")  # no reduced decoding for a PNG
    drafts = []
    draft = JpegImagePlugin.JpegImageFile.draft
    monkeypatch.setattr(
        JpegImagePlugin.JpegImageFile, "draft", lambda img, *args: drafts.append(img.size) or draft(img, *args)
    )
    side = 100
    cache = build_cache(scan_images(folder, labels="none"), side, cache_dir=tmp_path / "cache")
    assert drafts == [(1001, 803), (1001, 803)]  # the header's size, b's stored sideways
    for position, path in enumerate(cache.images.paths):
        whole = load_rgb(path)
        height, width = stored_sizes(np.array([whole.height, whole.width]), side, exact=False)[0]
        assert tuple(cache.sizes[position]) == (height, width), path
        got = cache.batch(torch.tensor([position]))[0].numpy().transpose(1, 2, 0).astype(float)
        expected = np.asarray(whole.resize((width, height), Image.Resampling.BILINEAR, reducing_gap=None), dtype=float)
        if path.endswith(("c.jpg", "d.png")):
            assert np.array_equal(got, expected), path
        else:
            assert 0 < np.abs(got - expected).mean() < 3, path
