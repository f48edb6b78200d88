"""The conformance kit over every first-party backend, one pytest item per check: every level, at
every precision each backend declares on its first device (bf16 for torch and tensorflow on an
AVX512-BF16 CPU), the parallel level in a child process with AIPERF_CPU_DEVICES=2.

Run one backend:  .venv/bin/python -m pytest tests/test_conformance.py -k "torch:"
The same kit runs from the CLI (aiperf conformance --backend torch) and, for any installed backend,
through the pytest plugin (pytest --aiperf-backend torch).
"""

import pytest

from aiperf_conformance.pytest_support import conformance_cases, run_case

BACKENDS = ("numpy", "torch", "tensorflow", "jax", "mindspore")
# The kit's full runs: about half of `make test`'s time. `make test-quick` leaves them out; the kit's own
# machinery is tested quickly on the NumPy reference (test_conformance_kit.py and the other test_conformance_*).
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", conformance_cases(BACKENDS), ids=str)
def test_conformance(case):
    run_case(case)
