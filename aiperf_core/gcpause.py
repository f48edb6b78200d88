"""Pausing Python's cyclic garbage collector around work that allocates many objects and no cycles, and
keeping the objects that exist out of the collections a library asks for itself."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off for the block, back as it was after.

    Reading a big run, or building a graph's morphs, creates many small objects and no reference
    cycles (refcounting frees them); the collector would rescan the whole growing heap over and over
    for nothing: it nearly doubles the time of scoring a 4096-replica run, and a full collection in
    the middle of generate_candidates took a 0.1 s call to 1 s. Pausing only defers a collection."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def gc_frozen() -> Iterator[None]:
    """The objects that exist now kept out of every collection for the block (gc.freeze), and given
    back to the collector after it (gc.unfreeze): a gc.collect() inside the block scans only what the
    block made.

    MindSpore calls gc.collect() before it compiles each graph. In a process that also holds
    TensorFlow, torch and jax (the test suite, a vendor's pytest run of several backends) each of those
    full collections scans all their objects: the native counter, which compiles three graphs per layer,
    took 33.4 s for the kit's CNN count checks with TensorFlow loaded, 7.2 s in this block
    (docs/backends/mindspore.md). Nothing is lost: an object that became garbage during the block is
    collected after it."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
