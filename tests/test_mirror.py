"""The one mirror (gateway.scaleout.mirror) without Redis or sockets: records from an injected iterator, a fake clock,
a scripted lease."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable

import pytest

from gateway.core.streams import Event, Retention, Stream, StreamHub
from gateway.errors import APIError
from gateway.scaleout import broker_codec as codec
from gateway.scaleout.mirror import Idle, Item, Lease, Mirror, MirrorSet, Opened, Quiet, apply


def event(seq: int, text: str | None = None) -> codec.Fields:
    text = str(seq) if text is None else text
    return codec.encode_event(seq, {"choices": [{"index": 0, "text": text}], "tokenfan": {"seq": seq}}, text, None)


HEADER = codec.encode_header("completions", "m", "owner-1")


def texts(s: Stream) -> list[str]:
    return [e.text for e in s.events]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedLink:
    """A link whose records (as Redis stores them) and lease answers are given up front; ``clock`` advances
    ``step`` s per Quiet. Like a real link, it raises CodecError for a record that is not ours."""

    def __init__(self, items: Iterable[codec.Fields | Quiet], leases: Iterable[Lease] = (), clock: Clock | None = None,
                 step: float = 1.0, header: codec.Fields = HEADER) -> None:
        self.items, self.leases = list(items), list(leases)
        self.clock, self.step, self.header = clock or Clock(), step, header
        self.asked: list[str] = []
        self.cancels: list[tuple[str, str]] = []
        self.closed = False

    async def records(self) -> AsyncGenerator[Item, None]:
        try:
            for item in self.items:
                if isinstance(item, Quiet):
                    self.clock.now += self.step
                    yield item
                else:
                    yield codec.decode(item)
                await asyncio.sleep(0)
        finally:
            self.closed = True

    async def open(self, stream_id: str) -> Opened:
        header = codec.decode(self.header)
        assert isinstance(header, codec.Header)
        return Opened(header, self.records())

    async def lease(self, owner: str) -> Lease:
        self.asked.append(owner)
        return self.leases.pop(0)

    async def cancel(self, stream_id: str, owner: str) -> bool:
        self.cancels.append((stream_id, owner))
        return True


def follow(link: ScriptedLink, *, timeout: float = 5.0, recheck: float = 0.5) -> tuple[Stream, APIError | None]:
    async def main() -> tuple[Stream, APIError | None]:
        stream = Stream("str-m", "completions", "m")
        opened = await link.open(stream.id)
        m = Mirror(stream, opened, link, Idle(timeout, recheck, link.clock()), clock=link.clock)
        return stream, await m.run()

    return asyncio.run(main())


def test_events_are_placed_by_seq_and_repeats_after_a_reread_are_skipped() -> None:
    link = ScriptedLink([HEADER, event(0), event(1), HEADER, event(0), event(1), event(2),
                         codec.encode_end("done", 3, None)])
    stream, ending = follow(link)
    assert ending is None and stream.state == "done" and texts(stream) == ["0", "1", "2"]
    assert [e.seq for e in stream.events] == [0, 1, 2]


def test_a_hole_ends_the_mirror_with_stream_lost_and_keeps_what_came_before() -> None:
    stream, ending = follow(ScriptedLink([HEADER, event(0), event(2), event(3)]))
    assert ending is not None and ending.code == "stream_lost" and "events 1 to 1" in ending.message
    assert texts(stream) == ["0"] and not stream.finished  # the caller finishes it with the ending


def test_an_end_counting_more_events_than_arrived_is_stream_lost_never_done() -> None:
    stream, ending = follow(ScriptedLink([HEADER, event(0), codec.encode_end("done", 2, None)]))
    assert ending is not None and ending.code == "stream_lost" and stream.state == "running"


def test_a_record_that_is_not_ours_ends_the_mirror_with_stream_lost() -> None:
    async def main() -> Stream:
        link = ScriptedLink([HEADER, event(0), {b"something": b"else"}, event(1)])
        m = await MirrorSet(StreamHub(Retention()), link, idle_timeout=60.0, recheck=0.5).mirror("str-g")
        assert m.task is not None
        await m.task
        return m

    m = asyncio.run(main())
    assert m.state == "error" and m.error is not None and m.error.code == "stream_lost" and texts(m) == ["0"]


def test_an_error_end_without_its_error_is_stream_lost() -> None:
    s = Stream("str-x", "completions", "m")
    assert apply(s, codec.EndEntry("error", 0, None)) is not None and not s.finished
    err = APIError(503, "engine went away", type="server_error", code="engine_unavailable")
    assert apply(s, codec.EndEntry("error", 0, err)) is None and s.state == "error" and s.error is not None


def test_quiet_gaps_while_the_owners_lease_is_held_never_end_the_mirror() -> None:
    # idle timeout 5 s, 1 s per quiet read: the lease is asked at 5 s, then just after it would expire
    link = ScriptedLink([HEADER, event(0), *[Quiet()] * 30, event(1), codec.encode_end("done", 2, None)],
                        leases=[Lease("held", 2.0)] * 10 + [Lease("held")] * 10)
    stream, ending = follow(link)
    assert ending is None and stream.state == "done" and texts(stream) == ["0", "1"]
    assert link.asked and set(link.asked) == {"owner-1"}
    assert len(link.asked) < 30  # asked when due, not on every quiet read


def test_idle_with_the_lease_gone_twice_is_owner_lost() -> None:
    link = ScriptedLink([HEADER, event(0), *[Quiet()] * 20], leases=[Lease("missing"), Lease("missing")])
    stream, ending = follow(link, timeout=3.0, recheck=0.5)
    assert ending is not None and ending.code == "owner_lost" and texts(stream) == ["0"]
    assert len(link.asked) == 2


def test_a_lease_missing_once_then_back_is_not_owner_lost() -> None:
    link = ScriptedLink([HEADER, *[Quiet()] * 12, event(0), codec.encode_end("done", 1, None)],
                        leases=[Lease("missing"), Lease("held", 1.0), Lease("unknown"), *[Lease("held")] * 10])
    stream, ending = follow(link, timeout=3.0)
    assert ending is None and stream.state == "done"


def test_a_link_unreachable_for_the_idle_timeout_is_broker_unavailable() -> None:
    link = ScriptedLink([HEADER, event(0), *[Quiet(OSError("refused"))] * 10])
    _, ending = follow(link, timeout=3.0)
    assert ending is not None and ending.code == "broker_unavailable" and ending.status == 503
    assert link.asked == []  # no lease to ask without the link


def test_a_link_that_ends_without_an_end_is_owner_lost() -> None:
    _, ending = follow(ScriptedLink([HEADER, event(0)]))
    assert ending is not None and ending.code == "owner_lost"


def test_idle_checks_follow_the_lease_and_reset_on_any_record() -> None:
    idle = Idle(timeout=10.0, recheck=0.5, now=0.0)
    assert not idle.due(9.9) and idle.due(10.0)
    assert idle.check(10.0, Lease("held", 1.5), "s") is None and idle.deadline == 10.0 + 1.5 + 0.05
    assert idle.check(11.6, Lease("missing"), "s") is None and idle.deadline == 11.6 + 0.5 + 0.25
    idle.heard(12.0)
    assert idle.misses == 0 and idle.deadline == 22.0
    assert idle.check(22.0, Lease("missing"), "s") is None
    lost = idle.check(22.8, Lease("missing"), "s")
    assert lost is not None and lost.code == "owner_lost" and lost.status == 502


def test_mirrors_end_every_mirror_with_mirror_closed_and_release_it_for_eviction() -> None:
    async def main() -> None:
        hub = StreamHub(Retention(finished_ttl=0.0))
        link = ScriptedLink([HEADER, event(0), *[Quiet()] * 10**6], step=0.0)  # quiet "forever"
        mirrors = MirrorSet(hub, link, idle_timeout=60.0, recheck=0.5)
        m = await mirrors.mirror("str-a")
        assert m.mirrored and await mirrors.mirror("str-a") is m
        while not m.events:
            await asyncio.sleep(0)
        assert await mirrors.cancel_remote("str-a") is True and link.cancels == [("str-a", "owner-1")]
        await mirrors.close()
        await asyncio.sleep(0)
        assert m.state == "error" and m.error is not None and m.error.code == "mirror_closed"
        assert link.closed
        hub.check_capacity()  # evicts what is due
        assert "str-a" not in hub.streams

    asyncio.run(main())


def test_a_new_mirror_answers_once_it_holds_what_the_owner_held() -> None:
    async def main() -> None:
        hub = StreamHub(Retention())
        header = codec.encode_header("completions", "m", "1", detached=False, held=4)  # 3 events and the end
        link = ScriptedLink([header, event(0), event(1), event(2), codec.encode_end("cancelled", 3, None)],
                            header=header)
        m = await MirrorSet(hub, link, idle_timeout=60.0, recheck=0.5).mirror("str-b")
        assert m.state == "cancelled" and texts(m) == ["0", "1", "2"] and m.detached is False

    asyncio.run(main())


def plain(entry: codec.Entry) -> object:
    """An entry comparable by value (APIError compares by identity)."""
    if isinstance(entry, codec.EndEntry) and entry.error is not None:
        return entry.state, entry.events, entry.error.status, entry.error.body()
    return entry


def test_a_peer_line_decodes_to_the_same_entry_as_the_redis_record() -> None:
    err = APIError(503, "engine went away", type="server_error", code="engine_unavailable")
    for fields in (codec.encode_header("chat.completions", "m", "2", detached=False, held=5), event(3, 'a "q"\n'),
                   codec.encode_event(0, {"choices": []}, "", "stop"), codec.encode_end("error", 7, err),
                   codec.encode_end("done", None, None)):
        line = codec.pack(fields)
        assert b"\n" not in line and plain(codec.decode_line(line)) == plain(codec.decode(fields))


def test_a_peer_line_that_is_not_ours_raises_codec_error() -> None:
    for line in (b"not json", b"[1]", b'{"seq": "x", "data": {}, "text": ""}', b'{"seq": "1", "data": [1], "text": ""}',
                 b'{"seq": "-1", "data": {}, "text": ""}', b'{"something": "else"}'):
        with pytest.raises(codec.CodecError):
            codec.decode_line(line)


def test_the_peer_links_event_line_is_the_packed_event_record() -> None:
    for ev in (Event(3, {"choices": [{"text": "é\n"}]}, {"seq": 3, "emit_ns": 1}, "é\n", None),
               Event(0, {"choices": []}, {"seq": 0}, "", "length")):
        assert codec.pack_event(ev) == codec.pack(codec.encode_event_of(ev))


def test_a_subscriber_cancelled_while_its_mirror_catches_up_ends_cancelled_at_any_point() -> None:
    async def attempt(k: int) -> tuple[bool, bool]:
        header = codec.encode_header("completions", "m", "1", held=3)
        link = ScriptedLink([header, event(0), event(1), event(2), *[Quiet()] * 10**6], header=header, step=0.0)
        mirrors = MirrorSet(StreamHub(Retention()), link, idle_timeout=60.0, recheck=0.5)
        task = asyncio.create_task(mirrors.mirror("str-c"))
        for _ in range(k):
            await asyncio.sleep(0)
        pending = task.cancel()
        await asyncio.wait({task})
        await mirrors.close()
        return pending, task.cancelled()

    async def main() -> None:
        outcomes = [await attempt(k) for k in range(40)]
        assert all(cancelled for pending, cancelled in outcomes if pending), outcomes
        assert outcomes[-1] == (False, False)  # the sweep reaches past the catch-up

    asyncio.run(main())


def test_a_lease_certainly_gone_is_owner_lost_at_the_first_check() -> None:
    """A worker's socket that refuses (or answers with another pid) cannot come back as a Redis key can."""
    idle = Idle(timeout=10.0, recheck=0.5, now=0.0)
    lost = idle.check(10.0, Lease("missing", certain=True), "s")
    assert lost is not None and lost.code == "owner_lost"


def test_a_held_lease_whose_owner_connection_closed_twice_is_owner_lost_at_once() -> None:
    idle = Idle(timeout=10.0, recheck=0.5, now=0.0, lease_check=2.0, presence_check=0.15)
    assert not idle.due(0.14) and idle.due(0.15)  # quiet for the presence check, not the lease's TTL
    assert idle.check(0.15, Lease("held", 1.5, present=True), "s") is None and idle.deadline == 0.15 + 0.15
    assert idle.check(0.3, Lease("held", 1.4, present=False), "s") is None and idle.absent == 1
    lost = idle.check(0.4, Lease("held", 1.3, present=False), "s")
    assert lost is not None and lost.code == "owner_lost"


def test_a_closed_owner_connection_that_comes_back_is_not_owner_lost() -> None:
    idle = Idle(timeout=10.0, recheck=0.5, now=0.0, lease_check=2.0, presence_check=0.15)
    assert idle.check(0.15, Lease("held", 1.5, present=False), "s") is None
    assert idle.check(0.25, Lease("held", 1.5, present=True), "s") is None and idle.absent == 0
    assert idle.check(0.4, Lease("held", 1.4, present=False), "s") is None  # one miss again, not two in a row
    # an owner that does not say it keeps a presence subscription (present None): only its lease counts
    assert idle.check(0.5, Lease("held", 1.4), "s") is None and idle.deadline == 0.5 + 1.4 + 0.05


def test_a_new_owner_continuing_a_shorter_log_rolls_the_mirror_back_never_splices() -> None:
    """The mirror read events 0-3 from a primary; the store it reads again after a failover lost 2-3, and an
    adopter continued from 2 events (its header says at=2): the mirror drops its 2-3 and reads the adopter's
    2, 3, 4 as its own, not as repeats."""
    adopter = codec.encode_header("completions", "m", "owner-2", epoch=2, at=2)
    link = ScriptedLink([HEADER, event(0), event(1), event(2, "old"), event(3, "old"), HEADER, event(0), event(1),
                         adopter, event(2, "new"), event(3, "new"), event(4, "new"), codec.encode_end("done", 5, None)])
    stream, ending = follow(link)
    assert ending is None and stream.state == "done"
    assert texts(stream) == ["0", "1", "new", "new", "new"] and [e.seq for e in stream.events] == [0, 1, 2, 3, 4]


def test_a_new_owners_header_at_the_mirrors_length_changes_nothing() -> None:
    adopter = codec.encode_header("completions", "m", "owner-2", epoch=2, at=2)
    link = ScriptedLink([HEADER, event(0), event(1), adopter, event(2), codec.encode_end("done", 3, None)])
    stream, ending = follow(link)
    assert ending is None and texts(stream) == ["0", "1", "2"]
