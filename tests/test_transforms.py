from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from obow.config import ViewsConfig
from obow.data.transforms import (
    GaussianBlur,
    OBoWViews,
    PatchGrid,
    crop_transform,
    eval_transform,
    patch_transform,
    teacher_transform,
)

MEAN = (0.2, 0.3, 0.4)
STD = (0.5, 0.25, 0.125)


def small_views(**overrides) -> ViewsConfig:
    """Tiny views: teacher 40 -> 32, two 24 px crops, five 16 px patches from a 44 px grid with jitter 6."""
    values = dict(
        teacher_resize=40,
        teacher_size=32,
        num_crops=2,
        crop_size=24,
        num_patches=5,
        patch_size=16,
        patch_jitter=6,
        patch_grid_size=44,
        mean=MEAN,
        std=STD,
    )
    values.update(overrides)
    return ViewsConfig(**values)


def no_randomness(**overrides) -> ViewsConfig:
    """Every probability 0 and crop scales (1, 1): only the (unconfigurable) horizontal flip stays random."""
    values = dict(
        color_jitter_prob=0.0, grayscale_prob=0.0, blur_prob=0.0, crop_scale=(1.0, 1.0), patch_scale=(1.0, 1.0)
    )
    values.update(overrides)
    return small_views(**values)


def noise_image(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# --- independent float64 NumPy reference -------------------------------------------------------------------


def resample_matrix(in_size: int, out_size: int) -> np.ndarray:
    """PIL's antialiased bilinear resampling along one axis as an [out, in] matrix.

    Output pixel o is centred at (o + 0.5) * scale in input coordinates; the triangle filter is stretched by
    the scale when shrinking (antialiasing), truncated at the image border and renormalised to sum to 1.
    """
    scale = in_size / out_size
    stretch = max(scale, 1.0)
    matrix = np.zeros((out_size, in_size))
    for o in range(out_size):
        centre = (o + 0.5) * scale
        lo, hi = max(int(centre - stretch + 0.5), 0), min(int(centre + stretch + 0.5), in_size)
        x = np.arange(lo, hi)
        weights = np.clip(1.0 - np.abs((x - centre + 0.5) / stretch), 0.0, None)
        matrix[o, lo:hi] = weights / weights.sum()
    return matrix


def reference_resize(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, 3] -> [height, width, 3] in float64 (no intermediate rounding, unlike PIL's two uint8 passes)."""
    rows, cols = resample_matrix(pixels.shape[0], height), resample_matrix(pixels.shape[1], width)
    return np.einsum("oh,hwc,pw->opc", rows, pixels.astype(np.float64), cols)


def reference_normalize(pixels: np.ndarray, mean=MEAN, std=STD) -> np.ndarray:
    """[H, W, 3] in 0..255 -> normalised [3, H, W]."""
    return ((pixels / 255.0 - np.asarray(mean)) / np.asarray(std)).transpose(2, 0, 1)


# PIL rounds to uint8 after each of its two passes and at the end: at most ~1 grey level, divided by std.
TOLERANCE = 1.5 / 255 / min(STD)


def matches_up_to_flip(got: torch.Tensor, want: np.ndarray) -> str | None:
    """'plain' or 'flipped' when ``got`` equals ``want`` or its mirror image within TOLERANCE, else None."""
    got = got.double().numpy()
    if np.allclose(got, want, rtol=0, atol=TOLERANCE):
        return "plain"
    if np.allclose(got, want[..., ::-1], rtol=0, atol=TOLERANCE):
        return "flipped"
    return None


# --- tests -------------------------------------------------------------------------------------------------


def test_reference_resampler_is_pil_bilinear():
    # the NumPy reference must itself agree with PIL before it can judge the transforms
    img = noise_image(60, 90)
    ours = reference_resize(np.asarray(img), 40, 60)
    pil = np.asarray(img.resize((60, 40), Image.Resampling.BILINEAR), dtype=np.float64)
    assert np.abs(ours - pil).max() <= 1.5


def test_teacher_view_is_resize_centre_crop_normalise_up_to_flip():
    cfg = small_views()
    img = noise_image(60, 90)
    # short side 60 -> 40, so 90 -> 60; centre crop 32 starts at ((40 - 32) / 2, (60 - 32) / 2) = (4, 14)
    want = reference_normalize(reference_resize(np.asarray(img), 40, 60)[4:36, 14:46])
    transform = teacher_transform(cfg)
    outcomes = set()
    for seed in range(12):
        torch.manual_seed(seed)
        view = transform(img)
        assert type(view) is torch.Tensor and view.dtype == torch.float32 and view.shape == (3, 32, 32)
        outcome = matches_up_to_flip(view, want)
        assert outcome is not None
        outcomes.add(outcome)
    assert outcomes == {"plain", "flipped"}  # the teacher's only augmentation is the flip


def test_eval_transform_is_deterministic_resize_centre_crop_normalise():
    img = noise_image(90, 60, seed=1)
    want = reference_normalize(reference_resize(np.asarray(img), 60, 40)[14:46, 4:36])
    transform = eval_transform(40, 32, MEAN, STD)
    for seed in range(4):
        torch.manual_seed(seed)
        assert matches_up_to_flip(transform(img), want) == "plain"


def test_views_have_the_configured_shapes():
    img = noise_image(60, 50)
    views = OBoWViews(small_views())(img)
    assert set(views) == {"teacher", "crops", "patches"}
    assert views["teacher"].shape == (3, 32, 32)
    assert views["crops"].shape == (2, 3, 24, 24)
    assert views["patches"].shape == (5, 3, 16, 16)
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in views.values())
    assert set(OBoWViews(small_views(num_crops=0))(img)) == {"teacher", "patches"}
    only_crops = OBoWViews(small_views(num_patches=0, num_crops=1))(img)
    assert set(only_crops) == {"teacher", "crops"} and only_crops["crops"].shape == (1, 3, 24, 24)


def test_views_of_the_wrong_things_are_one_clear_error():
    """A recipe (or its model section) for the views' settings, a NumPy array for an image: one line saying what
    to give instead, not an AttributeError inside the constructor or torchvision's "No image ... was found"."""
    from obow.config import load_config

    with pytest.raises(
        TypeError, match=r"takes the views' settings, a ViewsConfig \(a recipe's: its \.views\), got Config"
    ):
        OBoWViews(load_config("cifar10_fast"))
    with pytest.raises(TypeError, match=r"a ViewsConfig, got ModelConfig$"):
        OBoWViews(load_config("cifar10_fast").model)
    pixels = np.asarray(noise_image(60, 50))
    with pytest.raises(TypeError, match=r"got a NumPy array of shape \(60, 50, 3\): PIL.Image.fromarray"):
        OBoWViews(small_views())(pixels)
    assert OBoWViews(small_views())(Image.fromarray(pixels))["teacher"].shape == (3, 32, 32)


def test_normalisation_uses_the_configured_mean_and_std():
    colour = np.array([200, 100, 30])
    img = Image.fromarray(np.broadcast_to(colour.astype(np.uint8), (48, 48, 3)).copy())
    want = (colour / 255.0 - np.asarray(MEAN)) / np.asarray(STD)
    views = OBoWViews(no_randomness())(img)
    for name, view in views.items():
        per_channel = view.double().numpy().reshape(-1, 3, *view.shape[-2:])
        np.testing.assert_allclose(
            per_channel, np.broadcast_to(want[None, :, None, None], per_channel.shape), atol=1e-5, err_msg=name
        )


def test_crop_with_no_randomness_is_the_resized_image():
    img = noise_image(48, 48, seed=2)
    want = reference_normalize(reference_resize(np.asarray(img), 24, 24))
    transform = crop_transform(no_randomness())
    outcomes = {matches_up_to_flip(transform(img), want) for _ in range(12)}
    assert outcomes == {"plain", "flipped"}
    # and colour jitter, when applied, does change the crop
    jittered = crop_transform(no_randomness(color_jitter_prob=1.0))
    assert matches_up_to_flip(jittered(img), want) is None


def test_patches_with_no_randomness_are_slices_of_the_resized_image():
    img = noise_image(48, 48, seed=3)
    resized = reference_normalize(reference_resize(np.asarray(img), 44, 44))
    patches = patch_transform(no_randomness())(img).double().numpy()
    assert patches.shape == (5, 3, 16, 16)

    def position(patch: np.ndarray, view: np.ndarray) -> tuple[int, int] | None:
        for y in range(44 - 16 + 1):
            for x in range(44 - 16 + 1):
                if np.allclose(patch, view[:, y : y + 16, x : x + 16], rtol=0, atol=TOLERANCE):
                    return y, x
        return None

    # the whole patch view is flipped (or not) once, before the grid is cut
    for view in (resized, resized[..., ::-1]):
        found = [position(p, view) for p in patches]
        if all(found):
            break
    assert all(found), "every patch must be a slice of the resized (possibly flipped) image"
    assert len(set(found)) == 5


def test_grayscale_probability_one_gives_equal_channels():
    img = noise_image(48, 48, seed=4)
    crop = crop_transform(no_randomness(grayscale_prob=1.0))(img)
    pixels = crop * torch.tensor(STD)[:, None, None] + torch.tensor(MEAN)[:, None, None]
    torch.testing.assert_close(pixels[0], pixels[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(pixels[1], pixels[2], rtol=0, atol=1e-5)
    plain = crop_transform(no_randomness())(img)
    plain_pixels = plain * torch.tensor(STD)[:, None, None] + torch.tensor(MEAN)[:, None, None]
    assert (plain_pixels[0] - plain_pixels[1]).abs().max() > 0.1


def test_patch_grid_cuts_jittered_cells():
    size, jitter, side = 16, 6, 44
    step = (side - size - jitter) // 2  # 11 > jitter, so a start position names its cell unambiguously
    grid = PatchGrid(size, jitter, num_patches=5)
    image = torch.arange(3 * side * side, dtype=torch.float32).reshape(3, side, side)
    cells_seen, y_offsets, x_offsets = set(), set(), set()
    for seed in range(40):
        torch.manual_seed(seed)
        patches = grid(image)
        assert patches.shape == (5, 3, size, size)
        cells = []
        for patch in patches:
            y, x = divmod(int(patch[0, 0, 0]), side)  # every pixel value is unique: it names its position
            assert torch.equal(patch, image[:, y : y + size, x : x + size])
            (i, ry), (j, rx) = divmod(y, step), divmod(x, step)
            assert 0 <= i < 3 and 0 <= j < 3 and 0 <= ry <= jitter and 0 <= rx <= jitter
            cells.append((i, j))
            y_offsets.add(ry)
            x_offsets.add(rx)
        assert len(set(cells)) == 5, "patches must come from distinct grid cells"
        cells_seen.update(cells)
    assert len(cells_seen) == 9
    assert y_offsets == x_offsets == set(range(jitter + 1))  # both axes are jittered over the whole range


def test_patch_grid_on_a_rectangle_and_its_errors():
    grid = PatchGrid(10, 0, num_patches=9)
    height, width = 30, 40  # steps 10 and 15
    image = torch.arange(height * width, dtype=torch.float32).reshape(1, height, width)
    starts = sorted(divmod(int(p[0, 0, 0]), width) for p in grid(image))
    assert starts == [(y, x) for y in (0, 10, 20) for x in (0, 15, 30)]
    with pytest.raises(ValueError, match="at least patch_size"):
        PatchGrid(16, 6, 5)(torch.zeros(3, 21, 40))
    with pytest.raises(ValueError, match="num_patches"):
        PatchGrid(16, 6, 10)


def test_blur_radius_is_drawn_in_the_configured_range(monkeypatch):
    radii = []
    pil_blur = ImageFilter.GaussianBlur

    def recording_blur(radius):
        radii.append(radius)
        return pil_blur(radius=radius)

    monkeypatch.setattr(ImageFilter, "GaussianBlur", recording_blur)
    img = noise_image(24, 24, seed=5)
    blur = GaussianBlur((0.3, 0.7))
    for _ in range(200):
        out = blur(img)
    assert len(radii) == 200 and all(0.3 <= r <= 0.7 for r in radii)
    assert min(radii) < 0.35 and max(radii) > 0.65
    assert np.array_equal(np.asarray(out), np.asarray(img.filter(pil_blur(radius=radii[-1]))))

    radii.clear()
    crop_transform(small_views(blur_prob=1.0, blur_sigma=(0.5, 1.5)))(img)
    assert len(radii) == 1 and 0.5 <= radii[0] <= 1.5
    radii.clear()
    crop_transform(small_views(blur_prob=0.0))(img)
    patch_transform(small_views())(noise_image(48, 48))
    assert radii == []  # no blur when its probability is 0, and never on the patches


def test_seeding_torch_makes_the_views_reproducible():
    img = noise_image(60, 50, seed=6)
    views = OBoWViews(small_views())
    torch.manual_seed(123)
    first = views(img)
    torch.manual_seed(123)
    second = views(img)
    torch.manual_seed(124)
    other = views(img)
    for name in first:
        assert torch.equal(first[name], second[name])
    assert not torch.equal(first["crops"], other["crops"])
    assert not torch.equal(first["patches"], other["patches"])
