"""Datasets. `load_dataset(spec)` is the one way the workflow opens one; `spec` is run.json's
`dataset` entry, `{"name": ..., "path": ..., "image_size": ...}` (plus, for synthetic data,
optional `classes`, `train_images`, `val_images`).

- digits: scikit-learn's digits, embedded (ships offline), in memory: an aiperf_core.backend.Dataset.
- imagenet: a folder in the ImageFolder or the TFRecord layout (detected), streamed: a
  StreamingDataset (aiperf_core.data.stream) decoded and augmented while training.
- synthetic: ImageNet-shaped random data, streamed; for throughput only, never scored as valid.

`describe(spec)` opens a dataset and returns its counts without loading images: the check the
workflow runs before training (a missing or empty split, or train and val class sets that differ,
raise AiperfError naming the split or the classes).
"""

from __future__ import annotations

from typing import Any, Mapping

from aiperf_core.errors import AiperfError

NAMES = ("digits", "imagenet", "synthetic")
DEFAULT_IMAGE_SIZE = {"digits": 32, "imagenet": 224, "synthetic": 224}


def _image_size(spec: Mapping[str, Any], name: str) -> int:
    from aiperf_core.data.preprocess import check_size

    value = spec.get("image_size") or DEFAULT_IMAGE_SIZE[name]
    try:
        return check_size(int(value))
    except (TypeError, ValueError):
        raise AiperfError(f"dataset.image_size: must be an integer, got {value!r}") from None


def _workers(spec: Mapping[str, Any], workers: int | None) -> int:
    value = workers if workers is not None else spec.get("data_workers", 1)
    try:
        value = int(value)
    except (TypeError, ValueError):
        raise AiperfError(f"data_workers: must be an integer, got {value!r}") from None
    if value < 0:
        raise AiperfError(f"data_workers: must be >= 0, got {value}")
    return value


def load_dataset(spec: Mapping[str, Any], workers: int | None = None, loader: str | None = None):
    """The dataset `spec` names: a Dataset (digits) or a StreamingDataset (imagenet, synthetic).
    `workers` (the --data-workers setting) overrides spec['data_workers'] (default 1); `loader`
    (the policy item data_loader: native or dali) overrides spec['data_loader'] (default native)."""
    from aiperf_core.data.stream import LOADERS, NATIVE

    name = spec.get("name")
    loader = loader or spec.get("data_loader") or NATIVE
    if loader not in LOADERS:
        raise AiperfError(f"data_loader: must be one of {', '.join(LOADERS)}, got {loader!r}")
    if name == "digits":
        from aiperf_core.data.digits import load_digits

        if loader != NATIVE:
            raise AiperfError(f"data_loader: {loader} decodes stored images; the digits dataset is in memory "
                              f"(use data_loader = \"native\")")
        return load_digits(size=_image_size(spec, name))
    if name not in NAMES:
        raise AiperfError(f"dataset.name: unknown dataset {name!r} (known: {', '.join(NAMES)})")
    from aiperf_core.data.stream import StreamingDataset

    if name == "imagenet":
        from aiperf_core.data.imagenet import open_imagenet

        path = spec.get("path")
        if not path:
            raise AiperfError("dataset.path: imagenet needs the path of its folder")
        source = open_imagenet(path)
    else:
        from aiperf_core.data import synthetic

        source = synthetic.SyntheticSource(int(spec.get("classes") or synthetic.IMAGENET_CLASSES),
                                           int(spec.get("train_images") or synthetic.IMAGENET_TRAIN_IMAGES),
                                           int(spec.get("val_images") or synthetic.IMAGENET_VAL_IMAGES))
    return StreamingDataset(source, _image_size(spec, name), _workers(spec, workers), loader=loader)


def describe(spec: Mapping[str, Any]) -> dict:
    """{name, path, layout, classes, train_images, val_images, image_size} of the dataset `spec`
    names, for run.json and the check before training. Raises AiperfError on a missing or empty
    split or a train/val class mismatch."""
    data = load_dataset(spec, workers=0)
    if hasattr(data, "describe"):
        return data.describe()
    return {"name": spec.get("name"), "path": None, "layout": "embedded", "classes": int(data.classes),
            "train_images": len(data.y_train), "val_images": len(data.y_val),
            "image_size": int(data.x_train.shape[1])}
