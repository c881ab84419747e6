"""The engine worker's token path: one pass per engine step. The synthetic backend's single timer emits
every due token of every request in one pass; each request's :class:`Emitter` numbers its deltas, reads
the clock once per step and queues one outbox per gateway (no sockets: the server is never bound)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Sequence

import msgspec
import pytest

from engine_worker import protocol as p
from engine_worker.backends.base import Prepared, StepSink
from engine_worker.backends.synthetic import _WORDS, SyntheticBackend, _Start
from engine_worker.config import EngineConfig
from engine_worker.server import Emitter, EngineServer, IntervalMerger


@pytest.fixture
def server() -> Iterator[EngineServer]:
    srv = EngineServer(backend=SyntheticBackend(EngineConfig(backend="synthetic")), address="ipc:///nonexistent")
    yield srv
    srv._ctx.term()


def test_emitter_numbers_deltas_and_gives_usage_with_the_last(server: EngineServer) -> None:
    e = Emitter(server, b"gw", "r1", prompt_tokens=5)
    e(" a", 1)
    e(" b c", 2)
    e(" d", 1, "length")
    deltas = server._outbox[b"gw"]
    assert [(d.seq, d.text, d.token_count, d.finish_reason) for d in deltas] == [
        (0, " a", 1, None), (1, " b c", 2, None), (2, " d", 1, "length")]
    assert deltas[-1].usage == p.Usage(prompt_tokens=5, completion_tokens=4)
    assert deltas[0].usage is None and e.finish_reason == "length"


def test_one_clock_read_per_step_and_one_outbox_per_gateway(server: EngineServer,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(1000, 2000, 100))
    reads: list[int] = []

    def now_ns() -> int:
        reads.append(t := next(clock))
        return t

    monkeypatch.setattr(p, "now_ns", now_ns)
    a, b = Emitter(server, b"gw1", "r1", 1), Emitter(server, b"gw2", "r2", 1)
    a("x", 1)
    b("y", 1)
    a("z", 1)
    assert reads == [1000]  # the whole step shares one stamp
    assert {k: [d.emit_ns for d in v] for k, v in server._outbox.items()} == {b"gw1": [1000, 1000], b"gw2": [1000]}
    server._outbox, server._step_ns = {}, 0  # what the flush does after sending
    a("w", 1)
    assert reads == [1000, 1100] and server._outbox[b"gw1"][0].emit_ns == 1100


def test_merged_delta_keeps_the_emit_time_of_its_oldest_text(server: EngineServer) -> None:
    e = Emitter(server, b"gw", "r1", 1, IntervalMerger(3))
    server._step_ns = 10
    e("a", 1)  # the first step is never held
    server._step_ns = 20
    e("b", 1)  # held
    server._step_ns = 30
    e("c", 1)  # held
    server._step_ns = 40
    e("d", 1)  # 3 tokens: sent
    assert [(d.text, d.token_count, d.emit_ns) for d in server._outbox[b"gw"]] == [("a", 1, 10), ("bcd", 3, 20)]


def _prepared(rid: str, max_tokens: int, offset: int, stop: list[str] | None = None) -> Prepared:
    submit = p.Submit(request_id=rid, endpoint="completions", prompt="x",
                      sampling=p.Sampling(max_tokens=max_tokens, stop=stop or []))
    return Prepared(submit=submit, prompt_tokens=1, payload=_Start(offset, max_tokens))


class Steps:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str | None]] = []
        self.ids: list[int] = []

    def __call__(self, text: str, token_count: int, finish_reason: p.FinishReason | None = None,
                 chunk: bytes = b"", token_ids: Sequence[int] = (), steps: p.EngineSteps | None = None
                 ) -> None:
        self.calls.append((text, token_count, finish_reason))
        self.ids += token_ids


def _backend(tokens_per_s: float = 2000.0) -> SyntheticBackend:  # (several tokens per step, unless idle)
    return SyntheticBackend(EngineConfig(backend="synthetic", synthetic_tokens_per_s=tokens_per_s,
                                         synthetic_ttft_ms=0.0))


def test_synthetic_one_timer_paces_every_request_to_its_end() -> None:
    async def main() -> tuple[list[Steps], tuple[int, int]]:
        backend = _backend()
        sinks = [Steps() for _ in range(3)]
        await asyncio.gather(*(backend.stream(_prepared(f"r{i}", 20 + i, 7 * i), s) for i, s in enumerate(sinks)))
        return sinks, backend.load()

    sinks, load = asyncio.run(main())
    for i, s in enumerate(sinks):
        assert sum(n for _, n, _ in s.calls) == 20 + i
        assert "".join(t for t, _, _ in s.calls) == "".join(_WORDS[(7 * i + k) % len(_WORDS)] for k in range(20 + i))
        assert [f for _, _, f in s.calls] == [None] * (len(s.calls) - 1) + ["length"]
    assert load == (0, 0)


def test_a_synthetic_continuation_goes_on_exactly_where_the_delivered_tokens_end() -> None:
    """A continuation (``Submit.resume``: the output token ids delivered) yields the rest of the uninterrupted
    answer: the same text, the same finish, a stop string that spans the join included."""
    async def run(submit: p.Submit) -> Steps:
        backend = _backend()
        steps = Steps()
        await backend.stream(await backend.prepare(submit), steps)
        return steps

    # (stop strings inside one synthetic token: the synthetic engine sends a stop's first tokens when the stop
    # completes in a later step, so a stop spanning tokens would depend on how the steps fell)
    for stop in ([], ["subscr", "sea,"], ["gateway receives"]):
        whole = p.Submit(request_id="w", endpoint="completions", prompt="rivers",
                         sampling=p.Sampling(max_tokens=30, seed=3, stop=stop))
        full = asyncio.run(run(whole))
        text = "".join(t for t, _, _ in full.calls)
        boundaries = list(itertools.accumulate(n for _, n, _ in full.calls[:-1]))  # after each step but the last
        for k in boundaries:
            cont = msgspec.structs.replace(whole, resume=full.ids[:k])
            rest = asyncio.run(run(cont))
            head = "".join(_WORDS[i] for i in full.ids[:k])
            assert head + "".join(t for t, _, _ in rest.calls) == text, (stop, k)
            assert rest.calls[-1][2] == full.calls[-1][2]
            if not stop:  # (with a stop, the last step's tokens past it depend on how the steps fell)
                assert full.ids[:k] + rest.ids == full.ids


def test_synthetic_shared_steps_put_every_running_request_in_the_same_ticks() -> None:
    """``--synthetic-steps shared``: a request that starts between two steps joins the step clock, so each
    of its tokens comes out in a tick that also carries a token of the request already running (as
    continuous batching on a GPU); a tick carries one step per request (a late tick: the tokens due by then)."""

    async def main() -> tuple[list[int], list[int]]:
        backend = SyntheticBackend(EngineConfig(backend="synthetic", synthetic_tokens_per_s=50.0,
                                                synthetic_ttft_ms=0.0, synthetic_steps="shared"))
        ticks = 0
        tick = backend._tick

        def counted() -> None:
            nonlocal ticks
            ticks += 1
            tick()

        backend._tick = counted  # type: ignore[method-assign]
        seen: dict[str, list[int]] = {"a": [], "b": []}
        tokens = {"a": 0, "b": 0}

        def sink(rid: str) -> StepSink:
            """A sink that records the tick each of the request's steps came in."""
            def call(text: str, token_count: int, finish_reason: p.FinishReason | None = None,
                     chunk: bytes = b"", token_ids: Sequence[int] = ()) -> None:
                seen[rid].append(ticks)
                tokens[rid] += token_count
            return call

        a = asyncio.create_task(backend.stream(_prepared("a", 40, 0), sink("a")))
        await asyncio.sleep(0.007)  # between two steps of the 20 ms clock
        await backend.stream(_prepared("b", 5, 3), sink("b"))
        await a
        assert tokens == {"a": 40, "b": 5}
        return seen["a"], seen["b"]

    a, b = asyncio.run(main())
    # b's every step rode one of a's steps (a late tick carries the tokens due by then in one step: on a busy
    # loop a fresh clone once saw b's 5 tokens in 3 steps, so the steps are not counted)
    assert set(b) <= set(a)
    assert len(a) == len(set(a))  # one step per request per tick


def test_synthetic_stop_string_spanning_steps_ends_the_request() -> None:
    # "receives tok" begins in the 3rd token (already sent, so it stays) and completes in the 4th, which
    # is cut before it: the stop is found across steps although each step holds one word. A late timer
    # joins due tokens into one step (then the stop lies inside one step and is cut whole, rightly), so
    # the run is repeated, at 50 ms a token, until the steps fell one token each.
    async def main() -> Steps:
        s = Steps()
        await _backend(20.0).stream(_prepared("r", 50, 0, ["receives tok"]), s)
        return s

    for _ in range(5):
        s = asyncio.run(main())
        if [n for _, n, _ in s.calls] == [1, 1, 1, 1]:
            break
    assert [n for _, n, _ in s.calls] == [1, 1, 1, 1], f"no run had one token per step: {s.calls}"
    assert "".join(t for t, _, _ in s.calls) == "".join(_WORDS[:3])
    assert s.calls[-1] == ("", 1, "stop")


def test_synthetic_cancel_stops_the_request_and_frees_its_slot() -> None:
    async def main() -> tuple[int, int, tuple[int, int]]:
        backend = _backend(200.0)
        s = Steps()
        task = asyncio.create_task(backend.stream(_prepared("r", 1000, 0), s))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        seen = len(s.calls)
        await asyncio.sleep(0.1)
        return seen, len(s.calls), backend.load()

    seen, later, load = asyncio.run(main())
    assert 0 < seen == later and load == (0, 0)


def test_synthetic_zero_tokens_finishes_at_once() -> None:
    s = Steps()
    asyncio.run(_backend().stream(_prepared("r", 0, 0), s))
    assert s.calls == [("", 0, "length")]


def test_feed_stops_at_the_finishing_step_and_closes_the_generator() -> None:
    from engine_worker.backends.base import Step, feed

    closed: list[bool] = []

    async def steps():  # type: ignore[no-untyped-def]
        try:
            yield Step(text="a", token_count=1)
            yield Step(text="", token_count=0, finish_reason="stop", chunk=b"{}")
            yield Step(text="never", token_count=1)
        finally:
            closed.append(True)

    s = Steps()
    asyncio.run(feed(steps(), s))
    assert s.calls == [("a", 1, None), ("", 0, "stop")] and closed == [True]
