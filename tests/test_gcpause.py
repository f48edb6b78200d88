"""gcpause: the collector paused for a block, and the existing objects kept out of collections for one."""

import gc
import weakref

import pytest

from aiperf_core.gcpause import gc_frozen, gc_paused


def test_paused_collector_comes_back_as_it_was():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()


def test_frozen_objects_skip_the_blocks_collections_and_garbage_made_meanwhile_is_still_collected():
    class Cycle:
        pass

    before = gc.get_freeze_count()
    with pytest.raises(RuntimeError):
        with gc_frozen():
            assert gc.get_freeze_count() > before
            raise RuntimeError("the block's error comes through, and the freeze still ends")
    assert gc.get_freeze_count() == 0

    survivor = Cycle()
    survivor.me = survivor
    alive = weakref.ref(survivor)
    with gc_frozen():
        del survivor  # a cycle that existed before the block: frozen, so this collection keeps it
        gc.collect()
        assert alive() is not None
    gc.collect()  # after the block it is an ordinary garbage cycle again
    assert alive() is None
