"""Cross-backend agreement: the same graph with the same weights gives the same outputs on every
first-party backend, pairwise, within the sum of the two backends' declared graph tolerances.

Each backend is held to the NumPy reference by the kit; this checks the pairs directly, so that
two backends erring in opposite directions within their own tolerances still agree with each other
as the tolerances promise. The graph is the small ResNet with trained-looking weights (non-trivial
batch-norm statistics), in inference mode.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from aiperf_core.builders import resnet_small
from aiperf_core.registry import load_backend
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.expectations import load_expectations
from aiperf_conformance.kit import relative_error

BACKENDS = ("numpy", "torch", "tensorflow", "jax", "mindspore")


@pytest.fixture(scope="module")
def outputs() -> dict[str, tuple[np.ndarray, float]]:
    """Each backend's output for one batch and its declared graph tolerance; a backend that cannot
    load fails the test (never a skip)."""
    graph = resnet_small((32, 32, 3), 10)
    weights = trained_looking_weights(graph, 4)
    x = np.random.default_rng(4).normal(0, 1, (3,) + graph.input_shape).astype(np.float32)
    out = {}
    for name in BACKENDS:
        backend = load_backend(name)
        tolerance = load_expectations(name, backend).tolerance("graph")
        out[name] = (np.asarray(backend.predict(backend.lower(graph, weights), x)), tolerance)
    return out


@pytest.mark.parametrize("pair", list(itertools.combinations(BACKENDS, 2)), ids="-".join)
def test_backends_agree_pairwise(outputs, pair):
    (out_a, tol_a), (out_b, tol_b) = outputs[pair[0]], outputs[pair[1]]
    tolerance = tol_a + tol_b
    assert out_a.shape == out_b.shape
    err = relative_error(out_a, out_b)
    assert err <= tolerance, f"{pair[0]} vs {pair[1]}: relative error {err:.3g} > {tolerance:g}"
