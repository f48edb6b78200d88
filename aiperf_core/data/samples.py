"""Small ImageNet-layout trees built from real images that ship with scikit-learn, for tests,
benchmarks and trying the pipeline offline.

- digits: the 8x8 digit scans, upscaled and saved as JPEGs, one class per digit.
- photos: crops of scikit-learn's two sample photographs (china.jpg, flower.jpg) at random
  positions and sizes, re-encoded as JPEGs, ImageNet-sized; one class per photograph.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from aiperf_core.atomic import write_bytes_atomic
from aiperf_core.errors import AiperfError

PHOTOS = ("china.jpg", "flower.jpg")


def _jpeg(pixels: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _write_tree(root: Path, images: dict[str, dict[str, list[bytes]]]) -> Path:
    """images[split][class] = encoded images; written as root/<split>/<class>/<class>_<i>.JPEG."""
    for split, classes in images.items():
        for name, encoded in classes.items():
            for i, data in enumerate(encoded):
                write_bytes_atomic(root / split / name / f"{name}_{i:05d}.JPEG", data)
    return root


def digits_tree(root, train_per_class: int = 8, val_per_class: int = 2, size: int = 32,
                classes: int = 10) -> Path:
    """An ImageFolder tree of digit scans: classes '0'..'9' (the first `classes`)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise AiperfError("sample trees need scikit-learn: pip install 'aiperf[search]'") from None
    bunch = load_digits()
    pixels = (bunch.images * (255.0 / 16.0)).astype(np.uint8)
    factor = max(1, size // 8)
    images: dict[str, dict[str, list[bytes]]] = {"train": {}, "val": {}}
    for c in range(classes):
        members = np.flatnonzero(bunch.target == c)[:train_per_class + val_per_class]
        if len(members) < train_per_class + val_per_class:
            raise AiperfError(f"digits has only {len(members)} images of class {c}")
        scans = [np.repeat(np.repeat(pixels[i], factor, 0), factor, 1) for i in members]
        encoded = [_jpeg(np.repeat(s[..., None], 3, axis=2)) for s in scans]
        images["train"][str(c)] = encoded[:train_per_class]
        images["val"][str(c)] = encoded[train_per_class:]
    return _write_tree(Path(root), images)


def photo_tree(root, train_per_class: int = 8, val_per_class: int = 2, size: tuple[int, int] = (375, 500),
               seed: int = 0) -> Path:
    """An ImageFolder tree of crops of the sample photos, about ImageNet's typical 500x375."""
    try:
        from sklearn.datasets import load_sample_images
    except ImportError:
        raise AiperfError("sample trees need scikit-learn: pip install 'aiperf[search]'") from None
    rng = np.random.default_rng(seed)
    samples = load_sample_images()
    images: dict[str, dict[str, list[bytes]]] = {"train": {}, "val": {}}
    for name, photo in zip(PHOTOS, samples.images):
        label = Path(name).stem
        encoded = []
        for _ in range(train_per_class + val_per_class):
            h = min(photo.shape[0], int(size[0] * rng.uniform(0.6, 1.0)))
            w = min(photo.shape[1], int(size[1] * rng.uniform(0.6, 1.0)))
            top = int(rng.integers(0, photo.shape[0] - h + 1))
            left = int(rng.integers(0, photo.shape[1] - w + 1))
            encoded.append(_jpeg(np.ascontiguousarray(photo[top:top + h, left:left + w])))
        images["train"][label] = encoded[:train_per_class]
        images["val"][label] = encoded[train_per_class:]
    return _write_tree(Path(root), images)
