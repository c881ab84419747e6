"""Fan-out stream logic without sockets: log, cursors, coalescing, fairness, retention."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.api.chat_render import CHUNK_MERGE
from gateway.api.chat_request import ChunkBuilder
from gateway.api.openai.framing import FANOUT_SSE, FANOUT_WS
from gateway.core.backpressure import SlowConsumerPolicy
from gateway.core.follow import RolledBack, Watchdog
from gateway.core.follow import follow as _follow
from gateway.core.merge import coalesce
from gateway.core.streams import ChunkEvent, Event, Retention, StreamHub
from gateway.errors import APIError


def follow(stream, transport, after, write, policy):  # type: ignore[no-untyped-def]
    return _follow(stream, transport, after, write, policy, Watchdog(policy.send_timeout, None, tick=0.01),
                   merge=CHUNK_MERGE)

B = ChunkBuilder("chat.completions", "chatcmpl-x", "m", include_usage=False)


def publish_text(stream, words: list[str]) -> None:  # type: ignore[no-untyped-def]
    for i, w in enumerate(words):
        fin = "length" if i == len(words) - 1 else None
        stream.publish(ChunkEvent(B.delta_chunk(w, fin), 1, w, 1, fin))


def texts(events: list[Event]) -> str:
    return "".join(e.text for e in events)


def test_coalesce_keeps_all_text_and_the_last_seq() -> None:
    hub = StreamHub(Retention())
    s = hub.create("chat.completions", "m")
    role = B.role_chunk()  # (no event loop needed: publishing is synchronous)
    assert role is not None
    s.publish(ChunkEvent(role, 1, "", 0))
    publish_text(s, ["a", "b", "c"])
    merged = coalesce(s.events, CHUNK_MERGE)
    assert len(merged) == 1
    m = merged[0]
    assert m.seq == 3 and m.text == "abc" and m.finish_reason == "length"
    assert m.timed_payload["choices"][0]["delta"] == {"role": "assistant", "content": "abc"}
    assert m.timed_payload["tokenfan"]["first_seq"] == 0 and m.timed_payload["tokenfan"]["coalesced"] == 4
    assert b"id: 3\n" in FANOUT_SSE.frame(m) and '"seq":3' in FANOUT_WS.frame(m)


def test_coalesce_never_merges_tool_call_reasoning_logprob_or_other_choice_chunks() -> None:
    """A lagging reader still gets every structured delta as its own event, byte for byte."""
    hub = StreamHub(Retention())
    s = hub.create("chat.completions", "m")

    def chunk(choice: dict) -> dict:
        return {"id": "c", "object": "chat.completion.chunk", "choices": [choice]}

    structured = [
        chunk({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}, "logprobs": None}),
        chunk({"index": 0, "delta": {"reasoning": "hm"}, "logprobs": None}),
        chunk({"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [{"token": "a", "logprob": -1.0}]}}),
        chunk({"index": 1, "delta": {"content": "b"}, "logprobs": None}),
    ]
    publish_text(s, ["x", "y"])
    for c in structured:
        s.publish(ChunkEvent(c, 1, "", 1))
    publish_text(s, ["z"])
    merged = coalesce(s.events, CHUNK_MERGE)
    assert [m.payload for m in merged[1:5]] == structured
    assert texts(merged) == "xyz" and len(merged) == 6


def test_follow_replays_then_tails_without_a_seam() -> None:
    async def main() -> tuple[str, str]:
        hub = StreamHub(Retention())
        s = hub.create("chat.completions", "m")
        publish_text(s, ["a", "b"])  # before anyone subscribes (no finish yet: re-publish below)
        got_all: list[Event] = []
        got_resumed: list[Event] = []

        async def w_all(batch: list[Event]) -> None:
            got_all.extend(batch)

        async def w_res(batch: list[Event]) -> None:
            got_resumed.extend(batch)

        policy = SlowConsumerPolicy(coalesce_after=100)
        t1 = asyncio.create_task(follow(s, "sse", -1, w_all, policy))
        t2 = asyncio.create_task(follow(s, "ws", 0, w_res, policy))
        for w in ["c", "d", "e"]:
            await asyncio.sleep(0.001)
            s.publish(ChunkEvent(B.delta_chunk(w, None), 1, w, 1))
        s.finish("done")
        assert await t1 == 4 and await t2 == 4
        assert [e.seq for e in got_all] == [0, 1, 2, 3, 4]
        return texts(got_all), texts(got_resumed)

    assert asyncio.run(main()) == ("abcde", "bcde")


def test_replay_keeps_one_event_per_token_in_bounded_writes() -> None:
    async def main() -> list[list[Event]]:
        s = StreamHub(Retention()).create("completions", "m")
        publish_text(s, [f"w{i} " for i in range(20)])
        s.finish("done")
        writes: list[list[Event]] = []

        async def w(batch: list[Event]) -> None:
            writes.append(batch)

        await follow(s, "sse", 2, w, SlowConsumerPolicy(coalesce_after=4, replay_batch=8))
        return writes

    writes = asyncio.run(main())
    assert [len(b) for b in writes] == [8, 8, 1]
    assert [e.seq for b in writes for e in b] == list(range(3, 20))


def test_a_live_subscriber_that_lags_gets_coalesced_events() -> None:
    async def main() -> list[Event]:
        s = StreamHub(Retention()).create("completions", "m")
        got: list[Event] = []

        async def slow(batch: list[Event]) -> None:
            got.extend(batch)
            await asyncio.sleep(0.05)  # meanwhile the stream runs ahead

        task = asyncio.create_task(follow(s, "ws", -1, slow, SlowConsumerPolicy(coalesce_after=4)))
        await asyncio.sleep(0)
        publish_text(s, ["first "])
        await asyncio.sleep(0.01)  # the subscriber is now live, inside its slow write
        for i in range(20):
            s.publish(ChunkEvent(B.delta_chunk(f"w{i} ", None), 1, f"w{i} ", 1))
        s.finish("done")
        await task
        return got

    got = asyncio.run(main())
    assert texts(got) == "first " + "".join(f"w{i} " for i in range(20))
    assert len(got) == 2 and got[1].seq == 20 and got[1].timed_payload["tokenfan"]["coalesced"] == 20


def write_order(subscribers: list[tuple[str, str]], events: int) -> list[str]:
    """Names of the subscribers ``(name, transport)`` in the order their writes happened."""

    async def main() -> list[str]:
        s = StreamHub(Retention()).create("completions", "m")
        order: list[str] = []

        def writer(name: str):  # type: ignore[no-untyped-def]
            async def w(batch: list[Event]) -> None:
                order.append(name)
            return w

        tasks = [asyncio.create_task(follow(s, transport, -1, writer(name), SlowConsumerPolicy()))
                 for name, transport in subscribers]
        await asyncio.sleep(0)
        for _ in range(events):
            s.publish(ChunkEvent(B.delta_chunk("x", None), 1, "x", 1))
            await asyncio.sleep(0.001)
        s.finish("done")
        await asyncio.gather(*tasks)
        return order

    return asyncio.run(main())


def test_wake_order_alternates_between_transports() -> None:
    assert write_order([("sse", "sse"), ("ws", "ws")], 4) == ["sse", "ws", "ws", "sse", "sse", "ws", "ws", "sse"]


def test_wake_order_rotates_within_a_transport() -> None:
    assert write_order([(n, "sse") for n in "abc"], 3) == list("abc" "bca" "cab")


def test_a_stalled_writer_raises_slow_consumer() -> None:
    from gateway.core.backpressure import SlowConsumer

    async def main() -> None:
        s = StreamHub(Retention()).create("completions", "m")
        publish_text(s, ["a"])

        async def stuck(batch: list[Event]) -> None:
            await asyncio.sleep(10)

        await follow(s, "ws", -1, stuck, SlowConsumerPolicy(send_timeout=0.05))

    try:
        asyncio.run(main())
    except SlowConsumer:
        return
    raise AssertionError("expected SlowConsumer")


def test_retention_expires_by_ttl_then_answers_410() -> None:
    hub = StreamHub(Retention(finished_ttl=0.3))  # room for a busy box between mark_finished and get
    s = hub.create("completions", "m")
    publish_text(s, ["a"])
    s.finish("done")
    hub.mark_finished(s)
    assert hub.get(s.id) is s
    time.sleep(0.35)
    for sid, status in [(s.id, 410), ("never", 404)]:
        try:
            hub.get(sid)
        except APIError as exc:
            assert exc.status == status
        else:
            raise AssertionError


def test_a_dropped_stream_is_unknown_404_not_expired_and_frees_its_bytes() -> None:
    hub = StreamHub(Retention())
    finished, running = hub.create("completions", "m"), hub.create("completions", "m")
    publish_text(finished, ["abc"])
    finished.finish("done")
    hub.mark_finished(finished)
    assert hub.total_bytes > 0
    for s in (finished, running):
        hub.drop(s.id)
        with pytest.raises(APIError) as info:
            hub.get(s.id)
        assert (info.value.status, info.value.code) == (404, "stream_not_found")
    assert hub.total_bytes == 0
    running.finish("cancelled")
    hub.mark_finished(running)  # its pump ends after the drop: not retained again
    assert running.id not in hub.streams


def test_retention_byte_budget_drops_oldest_finished_first() -> None:
    hub = StreamHub(Retention(max_bytes=3000))
    streams = []
    for _ in range(5):
        s = hub.create("completions", "m")
        publish_text(s, ["x" * 300])
        s.finish("done")
        hub.mark_finished(s)
        streams.append(s)
    assert hub.total_bytes <= 3000
    alive = [s.id in hub.streams for s in streams]
    assert alive[-1] and not alive[0] and alive == sorted(alive)  # a suffix survives


def test_frames_are_kept_only_when_several_readers_share_them() -> None:
    """A listed stream read by one client (a stored response) keeps no frames in its log: nothing shares
    them; once two readers follow it, each new event's frame is built once for both. A reader that joins
    later gets the earlier events rebuilt, byte for byte what the first reader got."""

    async def main() -> tuple[dict[str, list[bytes]], list[Event]]:
        s = StreamHub(Retention()).create("chat.completions", "m")
        got: dict[str, list[bytes]] = {"first": [], "late": []}

        def reader(name: str) -> asyncio.Task[int]:
            async def write(batch: list[Event]) -> None:
                got[name] += [FANOUT_SSE.frame(e) for e in batch]  # type: ignore[misc]

            return asyncio.create_task(follow(s, "sse", -1, write, SlowConsumerPolicy()))

        tasks = [reader("first")]
        await asyncio.sleep(0.01)
        for w in ("a", "b"):
            s.publish(ChunkEvent(B.delta_chunk(w, None), 1, w, 1))
            await asyncio.sleep(0.01)
        tasks.append(reader("late"))
        await asyncio.sleep(0.01)
        publish_text(s, ["c", "d"])
        s.finish("done")
        await asyncio.gather(*tasks)
        return got, s.events

    got, events = asyncio.run(main())
    assert [FANOUT_SSE.name in e.frames for e in events] == [False, False, True, True]
    assert got["first"] == got["late"] == [FANOUT_SSE.build(e) for e in events]


def test_a_gated_stream_shows_readers_only_what_is_committed_and_its_end_once_sealed() -> None:
    async def main() -> None:
        hub = StreamHub(Retention())
        s = hub.create("chat.completions", "m")
        s.gated = True
        got: list[Event] = []

        async def w(batch: list[Event]) -> None:
            got.extend(batch)

        reader = asyncio.create_task(follow(s, "sse", -1, w, SlowConsumerPolicy(coalesce_after=100)))
        publish_text(s, ["a", "b", "c"])
        assert s.next_seq == 3 and s.events == [] and [e.seq for e in s.pending] == [0, 1, 2]
        await asyncio.sleep(0.01)
        assert got == []  # nothing durable yet
        s.commit(2)
        await asyncio.sleep(0.01)
        assert texts(got) == "ab" and [e.seq for e in s.pending] == [2]
        s.finish("done")
        s.commit(3)  # the last event, not the end
        await asyncio.sleep(0.01)
        assert texts(got) == "abc" and not reader.done() and not s.over
        s.commit(3, sealed=True)
        assert await asyncio.wait_for(reader, 1) == 2 and s.over

    asyncio.run(main())


def test_a_standby_relay_reads_a_gated_streams_pending_events_and_ends_before_the_seal_it_is_asked_for() -> None:
    """``--workers``: the relay to the standby gets each event as it is appended (the gate waits for its
    acknowledgement), a reader only what is committed; the relay ends once the stream finished (its end is
    what the seal waits for), the reader once it is sealed."""
    async def main() -> None:
        hub = StreamHub(Retention())
        s = hub.create("chat.completions", "m")
        s.gated = True
        relayed: list[Event] = []
        read: list[Event] = []

        async def to_relay(batch: list[Event]) -> None:
            relayed.extend(batch)

        async def to_reader(batch: list[Event]) -> None:
            read.extend(batch)

        policy, watchdog = SlowConsumerPolicy(coalesce_after=100), Watchdog(30.0, None)
        publish_text(s, ["a"])  # before the relay joins: replayed from pending
        relay = asyncio.create_task(_follow(s, "sse", -1, to_relay, policy, watchdog, relay=True, standby=True))
        reader = asyncio.create_task(follow(s, "sse", -1, to_reader, policy))
        await asyncio.sleep(0.01)
        publish_text(s, ["b", "c"])
        await asyncio.sleep(0.01)
        assert texts(relayed) == "abc" and read == [] and s.events == []
        s.commit(2)
        await asyncio.sleep(0.01)
        assert texts(read) == "ab" and texts(relayed) == "abc"  # (a commit writes the relay nothing again)
        s.finish("done")
        assert await asyncio.wait_for(relay, 1) == 2 and not s.over  # the relay writes the end record now
        s.commit(4, sealed=True)
        assert await asyncio.wait_for(reader, 1) == 2 and texts(read) == "abc" and s.over
        watchdog.stop()

    asyncio.run(main())


def test_a_paused_stream_sends_its_readers_away_and_a_relinquished_one_drops_what_was_not_durable() -> None:
    async def main() -> None:
        hub = StreamHub(Retention())
        s = hub.create("chat.completions", "m")
        s.gated = True
        got: list[Event] = []

        async def w(batch: list[Event]) -> None:
            got.extend(batch)

        policy = SlowConsumerPolicy(coalesce_after=100)
        first = asyncio.create_task(follow(s, "sse", -1, w, policy))
        publish_text(s, ["a", "b"])
        s.commit(1)
        await asyncio.sleep(0.01)
        s.pause(True)  # the owner fenced itself: its readers end (to resume elsewhere), the log stays
        assert await asyncio.wait_for(first, 1) == 0 and s.state == "running" and len(s.pending) == 1
        late = await asyncio.wait_for(follow(s, "ws", -1, w, policy), 1)  # a reader arriving now: the same
        assert late == 0 and texts(got) == "aa"
        s.pause(False)
        s.relinquish()  # another gateway owns it: the uncommitted "b" is never shown
        assert s.state == "moved" and s.pending == [] and texts(s.events) == "a" and s.over

    asyncio.run(main())


def test_a_resume_point_beyond_the_log_waits_for_the_log_to_reach_it() -> None:
    """A mirror still reading its log: the reader waits and reads on from its resume point."""
    async def main() -> list[int]:
        s = StreamHub(Retention()).create("chat.completions", "m")
        s.mirrored = True
        publish_text(s, ["a", "b"])
        got: list[Event] = []

        async def w(batch: list[Event]) -> None:
            got.extend(batch)

        t = asyncio.create_task(follow(s, "sse", 3, w, SlowConsumerPolicy()))
        await asyncio.sleep(0.01)
        publish_text(s, ["c", "d", "e"])
        s.finish("done")
        assert await t == 4
        return [e.seq for e in got]

    assert asyncio.run(main()) == [4]


def test_a_reader_past_the_point_a_new_owner_continues_from_ends_rolled_back_never_carried_past_it() -> None:
    """The store lost events a reader read (a replica promoted while behind), and an adopter continues the log from
    before them: that reader ends with RolledBack (stream_rolled_back), before the first new event; a reader at or
    before the point reads the new owner's events; a mirror that held the lost events drops them."""
    async def main() -> tuple[list[str], list[str]]:
        s = StreamHub(Retention()).create("chat.completions", "m")
        s.mirrored = True  # the adopter's mirror, before it adopts
        publish_text(s, ["a", "b", "c", "d"])  # d: what the store lost
        behind: list[Event] = []

        async def w(batch: list[Event]) -> None:
            behind.extend(batch)

        policy = SlowConsumerPolicy()
        never: list[Event] = []

        async def w_past(batch: list[Event]) -> None:
            never.extend(batch)

        past = asyncio.create_task(follow(s, "sse", 4, w_past, policy))  # it read a, b, c, d and one more
        await asyncio.sleep(0.01)
        s.continue_at(3)  # the new owner's log: a, b, c
        assert texts(s.events) == "abc"
        at = asyncio.create_task(follow(s, "ws", 2, w, policy))  # it read a, b, c (elsewhere)
        await asyncio.sleep(0.01)
        publish_text(s, ["x", "y"])
        s.finish("done")
        with pytest.raises(RolledBack) as rb:
            await past
        assert (rb.value.seq, rb.value.held) == (5, 3) and never == []
        assert await at == 4
        return [e.text for e in behind], [e.text for e in s.events]

    assert asyncio.run(main()) == (["x", "y"], ["a", "b", "c", "x", "y"])


def test_a_resume_point_beyond_a_normal_end_is_rolled_back_not_done() -> None:
    async def main() -> None:
        s = StreamHub(Retention()).create("chat.completions", "m")
        publish_text(s, ["a", "b"])
        s.finish("done")

        async def w(batch: list[Event]) -> None:
            pass

        with pytest.raises(RolledBack):
            await follow(s, "sse", 4, w, SlowConsumerPolicy())
        assert await follow(s, "sse", 1, w, SlowConsumerPolicy()) == 1  # all read: a normal end

    asyncio.run(main())


def test_a_resume_point_beyond_an_owners_log_or_past_its_continuation_is_rolled_back_at_once() -> None:
    """Nothing can bring the log to it: the stream is this gateway's own and finished (its whole log is
    shorter), or a new owner continued it from before the resume point (a reader coming back after the
    adoption). On its own running stream the reader waits for the log instead."""
    async def main() -> None:
        hub = StreamHub(Retention())
        own = hub.create("chat.completions", "m")
        publish_text(own, ["a", "b"])

        async def w(batch: list[Event]) -> None:
            pass

        got: list[int] = []

        async def keep(batch: list[Event]) -> None:
            got.extend(ev.seq for ev in batch)

        # running: a resume point ahead of the owner's log waits for the log to grow to it
        reader = asyncio.create_task(follow(own, "sse", 3, keep, SlowConsumerPolicy()))
        await asyncio.sleep(0.05)
        assert not reader.done()
        publish_text(own, ["c", "d", "e"])
        own.finish("done")
        await asyncio.wait_for(reader, 1)
        assert got == [4]
        # finished short of it: nothing can bring the log there
        with pytest.raises(RolledBack):
            await asyncio.wait_for(follow(own, "sse", 7, w, SlowConsumerPolicy()), 1)
        mirror = hub.create("chat.completions", "m", "str-mirror")
        mirror.mirrored = True
        publish_text(mirror, ["a", "b", "c"])
        mirror.continue_at(2)
        with pytest.raises(RolledBack) as rb:
            await asyncio.wait_for(follow(mirror, "ws", 3, w, SlowConsumerPolicy()), 1)
        assert rb.value.held == 2

    asyncio.run(main())
