"""How an image file becomes the 8-bit RGB pixels every pipeline uses: :func:`load_rgb` (the loader workers, an
evaluation's decoding, :class:`obow.ImageFolder`), :func:`load_rgb_resized` (the device pipeline's image cache) and
:func:`unreadable_reason` (the few words each pipeline names a skipped file with).

Every route applies the EXIF orientation, converts grayscale, palette, CMYK, 16-bit and float images to RGB on their
own scales, composites transparency onto white and decodes the whole file at once (a truncated file raises here);
a large JPEG may be decoded at libjpeg's reduced scale where the caller asks (training's views, the cache), never
under the size asked for.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

#: Modes whose pixels do not fit 8 bits; PIL's own convert("RGB") would clip them to 255.
_HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


def load_rgb(path: str | os.PathLike, draft_side: int = 0) -> Image.Image:
    """Decode an image file fully and return it as an 8-bit RGB PIL image.

    ``draft_side``: a JPEG whose shorter side is at least twice this is decoded at 1/2, 1/4 or 1/8 of its size by
    libjpeg's scaled decoding (PIL's ``draft``), the smallest scale that keeps its shorter side at least
    ``draft_side``: a 12-megapixel phone photo decoded in 13 ms instead of 84, and no view made from an image of that
    side is upsampled when ``draft_side`` is the recipe's sharp side (:func:`obow.methods.cache_side`). A smaller
    JPEG and every other kind are decoded whole (0, the default: every image).

    EXIF orientation is applied (phone photos are stored sideways). Grayscale, palette, CMYK and 16-bit or
    float images are converted; 16-bit and 32-bit integer pixels are read on a 0..65535 scale and float pixels
    on a 0..1 scale (PIL's own conversion would clip them to 255). Images with transparency are composited
    onto white: the colour of a transparent pixel is arbitrary (whatever the encoder kept, often black), so
    it must not reach the network. The whole file is decoded here, so truncated or corrupt files raise now
    rather than inside a transform.
    """
    with Image.open(path) as img:
        if draft_side > 0 and img.format == "JPEG" and min(img.size) >= 2 * draft_side:
            img.draft(None, (draft_side, draft_side))  # the scale keeps both sides >= draft_side
        return upright_rgb(img)


def upright_rgb(img: Image.Image) -> Image.Image:
    """``img`` turned by its EXIF orientation and converted to 8-bit RGB (:func:`_to_rgb`), decoded: a copy detached
    from the file its caller's context manager closes."""
    rgb = _to_rgb(ImageOps.exif_transpose(img))
    rgb.load()
    return rgb


#: EXIF orientations that turn an image a quarter: its width and height swap when it is made upright
QUARTER_TURNS = {5, 6, 7, 8}


def load_rgb_resized(
    path: str | os.PathLike, size_of: Callable[[int, int], tuple[int, int]], reduced: bool = True
) -> Image.Image:
    """:func:`load_rgb`'s image resized to ``size_of(width, height)`` of its whole upright size (PIL's bilinear
    filter, antialiased; not resized when that is its size). ``reduced``: a JPEG at least twice that size is decoded
    at libjpeg's reduced scale (1/2, 1/4 or 1/8) that keeps it at least that size, and the part of the reduced
    pixels the image covers (libjpeg rounds each side up) is resized, as Pillow's ``thumbnail`` does: the same size,
    a 12 MP photo decoded several times faster. Any other image is decoded whole, then resized."""
    with Image.open(path) as img:
        quarter = img.getexif().get(ExifTags.Base.Orientation) in QUARTER_TURNS
        width, height = img.size[::-1] if quarter else img.size
        target = size_of(width, height)
        stored = target[::-1] if quarter else target  # in the file's own orientation
        if reduced and img.format == "JPEG" and min(img.size[0] // stored[0], img.size[1] // stored[1]) >= 2:
            drafted = img.draft(None, stored)
            if drafted is not None:
                img.load()
                return upright_rgb(img.resize(stored, Image.Resampling.BILINEAR, box=drafted[1], reducing_gap=None))
        rgb = upright_rgb(img)
    return rgb if rgb.size == target else rgb.resize(target, Image.Resampling.BILINEAR, reducing_gap=None)


def unreadable_reason(err: BaseException) -> str:
    """Why an image file cannot be used, in a few words, from the error decoding it raised (:func:`load_rgb`): both
    pipelines name each image they skip with it."""
    if isinstance(err, Image.DecompressionBombError):
        return (
            f"over Pillow's decompression-bomb limit ({err}; the limit is PIL.Image.MAX_IMAGE_PIXELS, "
            f"{Image.MAX_IMAGE_PIXELS} pixels, and twice that refuses an image)"
        )
    if isinstance(err, UnidentifiedImageError):
        return "not an image Pillow can identify (damaged, or another kind of file under an image's name)"
    if isinstance(err, OSError):  # the system's error (a file gone, no permission), else Pillow's (truncated, ...)
        return f"cannot be read ({err.strerror})" if err.strerror else f"damaged ({err})"
    return f"unreadable ({type(err).__name__}: {err})" if str(err) else f"unreadable ({type(err).__name__})"


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in _HIGH_DEPTH_MODES:
        return _high_depth_to_rgb(img)
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if img.mode == "RGB":
        return img
    return img.convert("RGB")


def _high_depth_to_rgb(img: Image.Image) -> Image.Image:
    pixels = np.asarray(img, dtype=np.float64)
    scale = 255.0 if img.mode == "F" else 255.0 / 65535.0
    gray = np.clip(np.rint(np.nan_to_num(pixels * scale)), 0, 255).astype(np.uint8)
    return Image.fromarray(gray).convert("RGB")
