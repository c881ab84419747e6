"""When the gateway freezes its live heap and when it thaws it (gateway/http/heap.py's FreezePolicy: the
readers' count and the time in, an action out), and that a freeze leaves what is alive collectable later."""

from __future__ import annotations

import gc

from gateway.http.heap import FreezePolicy, HeapFreezer


def test_a_crowd_arriving_is_frozen_every_step_readers_and_once_it_stops() -> None:
    policy = FreezePolicy(step=100, quiet=1.0)
    assert policy.decide(0.0, 0) is None  # nobody: nothing to do
    assert [policy.decide(t / 10, 40 * t) for t in range(1, 6)] == [None, None, "freeze", None, None]
    assert policy.frozen_at == 120
    assert policy.decide(0.6, 230) == "freeze"  # 110 more since the last freeze
    assert policy.decide(1.0, 250) is None  # still arriving
    assert policy.decide(1.9, 250) is None
    assert policy.decide(2.0, 250) == "freeze"  # no reader joined for a second: what came since is frozen
    assert policy.decide(9.0, 250) is None  # steady: nothing more


def test_readers_falling_below_half_of_the_last_freeze_thaw_the_heap_once() -> None:
    policy = FreezePolicy(step=100, quiet=1.0, frozen_at=1000)
    assert policy.decide(0.0, 600) is None  # a few left
    assert policy.decide(1.0, 499) == "thaw"
    assert policy.frozen_at == 499
    assert policy.decide(2.0, 300) is None  # not below half of 499 yet
    assert policy.decide(3.0, 0) == "thaw"
    assert policy.decide(9.0, 0) is None  # nothing frozen worth a thaw any more


def test_small_counts_are_never_thawed() -> None:
    policy = FreezePolicy(step=100, frozen_at=60)
    assert policy.decide(0.0, 0) is None


def test_the_freezer_freezes_and_thaws_the_process_heap() -> None:
    readers = [0]
    freezer = HeapFreezer(lambda: readers[0], FreezePolicy(step=10, quiet=1.0))
    gc.unfreeze()
    try:
        readers[0] = 10
        assert freezer.step(0.0) == "freeze"
        frozen = gc.get_freeze_count()
        assert frozen > 0 and freezer.freezes == 1
        readers[0] = 0
        assert freezer.step(1.0) == "thaw"
        assert freezer.thaws == 1 and gc.get_freeze_count() > 0  # thawed, collected, frozen again
    finally:
        gc.unfreeze()
