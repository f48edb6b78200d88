"""Datasets. `digits` is the embedded real dataset that ships offline with scikit-learn.

`load_dataset(spec)` is the one way the workflow opens a dataset: `spec` is run.json's `dataset`
entry, `{"name": ..., "path": ..., "image_size": ...}`.
"""

from __future__ import annotations

from typing import Any, Mapping

from aiperf_core.errors import AiperfError


def load_dataset(spec: Mapping[str, Any]):
    name = spec.get("name")
    if name == "digits":
        from aiperf_core.data.digits import load_digits
        return load_digits(size=int(spec.get("image_size") or 32))
    raise AiperfError(f"dataset.name: unknown dataset {name!r} (known: digits)")
