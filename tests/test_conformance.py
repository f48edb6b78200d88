"""The conformance kit over every first-party backend, one pytest item per check.

Run one backend:  .venv/bin/python -m pytest tests/test_conformance.py -k "torch:"
The same kit runs from the CLI:  aiperf conformance --backend torch
"""

import pytest

from aiperf_conformance.pytest_support import conformance_cases, run_case

BACKENDS = ("numpy", "torch", "tensorflow", "jax", "mindspore")


@pytest.mark.parametrize("case", conformance_cases(BACKENDS), ids=str)
def test_conformance(case):
    run_case(case)
