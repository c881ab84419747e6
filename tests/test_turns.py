"""The turnstile: a bounded number of subscriber work units per event-loop turn, first come first served,
and nothing in the way when nobody waits."""

from __future__ import annotations

import asyncio
import collections

from gateway.core.turns import Turnstile


class Turns:
    """Counts the loop's turns: a callback that schedules itself again every turn."""

    def __init__(self) -> None:
        self.n = 0
        self._loop = asyncio.get_running_loop()
        self._loop.call_soon(self._tick)
        self.stopped = False

    def _tick(self) -> None:
        self.n += 1
        if not self.stopped:
            self._loop.call_soon(self._tick)


def test_a_crowd_goes_through_at_most_per_turn_units_a_loop_turn_in_arrival_order() -> None:
    async def main() -> None:
        gate, turns, passed = Turnstile(per_turn=8), Turns(), []

        async def unit(i: int) -> None:
            await gate.turn()
            passed.append((i, turns.n))

        await asyncio.gather(*(unit(i) for i in range(100)))
        turns.stopped = True
        per_turn = collections.Counter(t for _, t in passed)
        assert max(per_turn.values()) == 8, per_turn
        assert [i for i, _ in passed] == list(range(100))  # first come first served
        assert len(per_turn) >= 100 // 8
        assert gate.waited == 92

    asyncio.run(main())


def test_nobody_waiting_means_no_await_and_a_cancelled_waiter_does_not_hold_the_others() -> None:
    async def main() -> None:
        gate = Turnstile(per_turn=1)
        await gate.turn()  # room in this turn: returns without suspending
        assert gate.waited == 0
        await asyncio.sleep(0)  # a new turn
        a, b, c = (asyncio.ensure_future(gate.turn()) for _ in range(3))
        await asyncio.sleep(0)  # a went through; b and c wait for later turns
        assert a.done() and not b.done() and not c.done()
        b.cancel()  # its client left while it waited
        await asyncio.wait_for(c, 5)
        assert b.cancelled()
        assert not gate._waiting
    asyncio.run(main())
