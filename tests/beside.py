"""A test module's long subprocess, started beside its in-process tests (DEVELOPERS.md, "Test tiers")."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def beside(request, test: str, work, *args, **kwargs):
    """For a module fixture (`yield from`): a future of work(*args, **kwargs), started at once when the
    module's test `test` is selected, so that the other tests run while it works; None when it is not."""
    if not any(item.module is request.module and item.originalname == test for item in request.session.items):
        yield None
        return
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(work, *args, **kwargs)
