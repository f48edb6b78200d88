"""Image preprocessing with Pillow: the usual ImageNet recipe, at any square resolution.

Training: random-resized crop (area 8%-100% of the image, aspect ratio 3/4-4/3, ten tries, then a
central crop) to size x size, and a horizontal flip with probability 1/2.
Validation: resize the shorter side to size / 0.875, then a central size x size crop.
Both give uint8 RGB pixels (HxWx3). Normalisation, per channel with the ImageNet mean and standard
deviation, is not done here: each backend runs it on its device inside its step, as
`(float32(x) - MEAN) * INV_STD`, so that a quarter of the bytes crosses worker IPC and PCIe.
`normalise` is that arithmetic on the host (the NumPy backend, tests, the transitional float32
delivery).

JPEGs are decoded at a reduced scale (Pillow's draft mode, libjpeg's DCT scaling) whenever the
crop still has at least `size` pixels each way: that is most of the decoding time saved on
ImageNet-sized photos, with no visible change after the final resize.

The randomness of an image's augmentation comes from a generator seeded by (seed, epoch, index),
so an epoch's batches are the same whatever the number of workers and whichever worker decodes.
"""

from __future__ import annotations

import io
import math
from functools import lru_cache

import numpy as np

from aiperf_core.errors import AiperfError

# The one definition of the normalisation constants (0-255 scale); every backend reads them here.
MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255.0
STD = np.array([0.229, 0.224, 0.225], np.float32) * 255.0
INV_STD = (1.0 / STD).astype(np.float32)
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
CROP_TRIES = 10
VAL_CROP_FRACTION = 0.875  # the validation crop covers 87.5% of the shorter side


class CorruptImage(AiperfError):
    """An image that cannot be decoded (truncated, not an image, bad checksum)."""


@lru_cache(maxsize=8)
def _tiled(pixels: int) -> tuple[np.ndarray, np.ndarray]:
    """MEAN and INV_STD repeated over `pixels` RGB pixels, as flat arrays."""
    return np.tile(MEAN, pixels), np.tile(INV_STD, pixels)


def normalise(pixels: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 pixels (an image HxWx3 or a batch NxHxWx3) -> float32 `(float32(x) - MEAN) * INV_STD`
    per channel, the arithmetic every backend runs on its device; written into `out` when given.
    The arithmetic runs per image on flat arrays against tiled constants: broadcasting over a last
    axis of 3 makes NumPy's inner loop three elements long, several times slower."""
    if pixels.dtype != np.uint8 or pixels.ndim not in (3, 4) or pixels.shape[-1] != 3:
        raise AiperfError(f"normalise: expected uint8 pixels (..., H, W, 3), got {pixels.dtype} {pixels.shape}")
    src = np.ascontiguousarray(pixels)
    if out is None:
        out = np.empty(src.shape, np.float32)
    per_image = src.shape[-3] * src.shape[-2]
    mean, inv_std = _tiled(per_image)
    rows = src.reshape(-1, per_image * 3)
    flat = out.reshape(rows.shape)  # a view: `out` is contiguous
    np.subtract(rows, mean, out=flat)
    flat *= inv_std
    return out


def model_input(x: np.ndarray) -> np.ndarray:
    """A batch as a model takes it on the host: streamed uint8 pixels normalised (`normalise`),
    in-memory float32 arrays (a Dataset, already normalised) as they are, token ids (int32 or int64,
    never uint8, which is pixels) as int64."""
    if x.dtype == np.uint8:
        return normalise(x)
    if x.dtype in (np.int32, np.int64):
        return x.astype(np.int64, copy=False)
    if x.dtype != np.float32:
        raise AiperfError(f"batch: expected uint8 pixels, float32 arrays or int32/int64 token ids, got {x.dtype}")
    return x


def augmentation_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, epoch, index])


def random_crop_box(width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(left, top, crop width, crop height) of a random-resized crop."""
    area = width * height
    log_ratio = (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))
    for _ in range(CROP_TRIES):
        target = area * rng.uniform(*CROP_SCALE)
        ratio = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * ratio)))
        h = int(round(math.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    # Fallback: the largest central crop whose ratio is within range.
    ratio = width / height
    if ratio < CROP_RATIO[0]:
        w, h = width, int(round(width / CROP_RATIO[0]))
    elif ratio > CROP_RATIO[1]:
        w, h = int(round(height * CROP_RATIO[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def _open(encoded: bytes, where: str):
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(encoded))
    except Exception as exc:  # Pillow raises several types for unreadable data
        raise CorruptImage(f"{where}: not a readable image ({type(exc).__name__})") from None
    return image


def _load(image, where: str):
    try:
        image.load()  # a truncated file raises here (ImageFile.LOAD_TRUNCATED_IMAGES stays False)
        return image.convert("RGB") if image.mode != "RGB" else image
    except Exception as exc:
        raise CorruptImage(f"{where}: cannot decode ({type(exc).__name__}: {exc})".splitlines()[0]) from None


def verify_image(encoded: bytes, where: str = "image") -> None:
    """Raise CorruptImage unless the image decodes completely (at full resolution)."""
    _load(_open(encoded, where), where)


def _draft(image, want_w: int, want_h: int) -> None:
    """Ask a JPEG decoder for the smallest scale that still gives want_w x want_h pixels."""
    if image.format == "JPEG":
        image.draft("RGB", (max(want_w, 1), max(want_h, 1)))


def _pixels(image, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return np.asarray(image)
    out[...] = np.asarray(image)
    return out


def train_image(encoded: bytes, size: int, rng: np.random.Generator, where: str = "image",
                out: np.ndarray | None = None) -> np.ndarray:
    """Decode, random-resized crop to size x size, random flip: uint8 HxWx3 (into `out`)."""
    from PIL import Image

    image = _open(encoded, where)
    width, height = image.size
    left, top, w, h = random_crop_box(width, height, rng)
    flip = rng.random() < 0.5
    # Decode only as finely as the crop needs: the crop must keep >= size pixels each way.
    _draft(image, math.ceil(width * size / w), math.ceil(height * size / h))
    image = _load(image, where)
    sx, sy = image.size[0] / width, image.size[1] / height  # < 1 when decoded at a reduced scale
    box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
    resized = image.resize((size, size), Image.BILINEAR, box=box)
    if flip:
        resized = resized.transpose(Image.FLIP_LEFT_RIGHT)
    return _pixels(resized, out)


def val_image(encoded: bytes, size: int, where: str = "image", out: np.ndarray | None = None) -> np.ndarray:
    """Decode, resize the shorter side to size / 0.875, central crop: uint8 HxWx3 (into `out`)."""
    from PIL import Image

    image = _open(encoded, where)
    width, height = image.size
    short = max(int(round(size / VAL_CROP_FRACTION)), size)
    factor = short / min(width, height)
    new_w, new_h = max(size, int(round(width * factor))), max(size, int(round(height * factor)))
    _draft(image, new_w, new_h)
    image = _load(image, where)
    # The central size x size window of the resized image, in the decoded image's coordinates.
    left, top = (new_w - size) / 2, (new_h - size) / 2
    sx, sy = image.size[0] / new_w, image.size[1] / new_h
    box = (left * sx, top * sy, (left + size) * sx, (top + size) * sy)
    resized = image.resize((size, size), Image.BILINEAR, box=box)
    return _pixels(resized, out)


def check_size(size: int) -> int:
    if not isinstance(size, int) or size < 8:
        raise AiperfError(f"dataset.image_size: must be an integer >= 8, got {size!r}")
    return size
