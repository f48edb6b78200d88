"""Submissions: what turns a run directory into a ranked result (docs/submission.md).

    system.py    the system description (system.toml): `aiperf system describe`, its schema, its check
    peak.py      the measured peak (peak.json): `aiperf peak`, and reading a peak file
    package.py   the package (NAME.tar.gz + MANIFEST): `aiperf submit`
    unpack.py    safe unpacking of a package into a private temporary directory
    check.py     the reviewer's check: `aiperf check`, recomputing everything from the package
    ranking.py   the list: `aiperf rank`, HTML, CSV and JSON

Nothing here imports a deep-learning framework; `aiperf peak` loads the backend it measures.
"""

from aiperf_core.errors import AiperfError


class SubmissionError(AiperfError):
    """A submission, system description, peak file or conformance report is malformed or refused.
    The message is one line that names the file and field."""
