"""The engine link's rules as a state machine: messages and the time in, messages and events out.

No socket, no process, no event loop: each test feeds :class:`EngineLink` decoded messages at chosen times
and reads what it would send (``data_to_send``), what happened (``events_received``) and what reached each
request (a recording sink)."""

from __future__ import annotations

from engine_worker import protocol as p
from gateway.core.engine_link import ContinuationRefused, Continued, EngineLink, Lost, Reattached
from gateway.core.engine_pool import MigrationPolicy, Migrator
from gateway.core.metrics import Migrations
from gateway.core.request import RequestHandle
from gateway.core.step import Step
from gateway.errors import APIError, EngineError

TIMEOUT = 1.0
INTERVAL = 0.25  # the pinger's beat: a tick later than this after the previous one is the gateway's own stall


class Recorder:
    """A sink that records what a request received."""

    def __init__(self) -> None:
        self.deltas: list[p.Delta] = []
        self.failures: list[APIError] = []

    def on_delta(self, d: p.Delta, step: Step | None) -> None:
        self.deltas.append(d)

    def on_failure(self, err: APIError) -> None:
        self.failures.append(err)


def submit(rid: str, max_tokens: int = 8) -> p.Submit:
    return p.Submit(request_id=rid, endpoint="completions", sampling=p.Sampling(max_tokens=max_tokens), prompt="x")


def beat(link: EngineLink, engine_id: str, now: float, *, ping: int | None = None, running: int = 0,
         waiting: int = 0) -> None:
    """A heartbeat from ``engine_id`` answering ``ping`` (the link's last ping by default)."""
    link.receive(p.Heartbeat(engine_id=engine_id, backend="fake", model="m", max_model_len=64, running=running,
                             waiting=waiting, ping_sent_ns=ping if ping is not None else last_ping(link),
                             sent_ns=0), now, int(now * 1e9))


def last_ping(link: EngineLink) -> int:
    pings = [m.sent_ns for m in link.data_to_send() if isinstance(m, p.Ping)]
    assert pings, "the link sent no ping"
    return pings[-1]


def up(engine_id: str = "e1", now: float = 0.0, address: str = "ipc://a") -> EngineLink:
    """A link whose engine answered its first ping at ``now``."""
    link = EngineLink(address, heartbeat_timeout=TIMEOUT, heartbeat_interval=INTERVAL)
    link.tick(now, 1)
    beat(link, engine_id, now)
    assert link.healthy(now)
    return link


def open_request(link: EngineLink, rid: str, now: float, max_tokens: int = 8) -> tuple[RequestHandle, Recorder]:
    h = link.submit(submit(rid, max_tokens), now)
    sent = link.data_to_send()
    assert [m.request_id for m in sent if isinstance(m, p.Submit)] == [rid]
    sink = Recorder()
    h.attach(sink)
    return h, sink


def delta(rid: str, seq: int, text: str, ids: list[int], finish: p.FinishReason | None = None,
          steps: p.EngineSteps | None = None) -> p.DeltaBatch:
    return p.DeltaBatch([p.Delta(rid, seq, text, len(ids), 0, finish, token_ids=ids, steps=steps or [])])


def aborts(msgs: list[p.Message]) -> list[str]:
    return [rid for m in msgs if isinstance(m, p.Abort) for rid in m.request_ids]


def test_a_new_engine_id_under_the_same_address_loses_the_requests_sent_before_the_answered_ping_only() -> None:
    link = up("old")
    old, _ = open_request(link, "r0", 0.1)
    link.tick(0.25, 2)  # the ping the new instance will answer: r0 was sent before it
    ping = last_ping(link)
    later, later_sink = open_request(link, "later", 0.3)

    beat(link, "new", 0.4, ping=ping)

    [lost] = link.events_received()
    assert isinstance(lost, Lost) and lost.handles == [old] and "restarted" in lost.error.message
    assert aborts(link.data_to_send()) == ["r0"]  # the new instance may have got it
    assert list(link.requests) == ["later"] and link.healthy(0.4)
    st = link.status(0.4)
    assert (st["engine_id"], st["previous_engine_id"], st["restarts"]) == ("new", "old", 1)
    assert st["engine_changed_at"] == 0.4
    link.receive(delta("later", 0, "ok", [5], "stop"), 0.5, 0)
    assert [d.text for d in later_sink.deltas] == ["ok"] and later.done and not link.requests


def test_a_heartbeat_of_the_same_instance_loses_nothing() -> None:
    link = up("e1")
    open_request(link, "r", 0.1)
    link.tick(0.25, 2)
    beat(link, "e1", 0.3)
    assert link.events_received() == [] and list(link.requests) == ["r"] and link.restarts == 0


def test_heartbeats_missed_for_the_timeout_lose_every_request_at_the_next_tick_and_suspend_them() -> None:
    link = up("e1", now=0.0)
    a, _ = open_request(link, "a", 0.1)
    b, _ = open_request(link, "b", 0.2)
    for k in range(1, 4):  # the ticks come on time: the gateway's loop ran; the engine said nothing
        link.tick(k * INTERVAL, 1 + k)
        assert link.events_received() == []  # still within the timeout
    link.data_to_send()

    link.tick(TIMEOUT + 0.01, 3)

    [lost] = link.events_received()
    assert isinstance(lost, Lost) and lost.handles == [a, b] and "stopped answering" in lost.error.message
    sent = link.data_to_send()
    assert aborts(sent) == [] and isinstance(sent[-1], p.Ping)  # not aborted: the engine may still run them
    assert not link.requests and list(link.suspended) == ["a", "b"] and not link.healthy(TIMEOUT + 0.01)
    link.tick(TIMEOUT + 0.5, 4)
    assert link.events_received() == []  # lost once, not at every tick


def lost_with_missed_heartbeats(link: EngineLink, now: float) -> Lost:
    """Ticks on time from the last heartbeat (at 0) to ``now``, the engine silent: its requests are lost."""
    k = 1
    while k * INTERVAL <= now:
        link.tick(k * INTERVAL, 100 + k)
        k += 1
    [lost] = link.events_received()
    assert isinstance(lost, Lost)
    link.data_to_send()
    return lost


def test_a_request_lost_with_missed_heartbeats_is_reattached_when_the_same_instance_answers() -> None:
    link = up("e1")
    h, sink = open_request(link, "r", 0.1)
    link.receive(delta("r", 0, "a", [1]), 0.2, 0)
    lost = lost_with_missed_heartbeats(link, 1.3)  # the engine stalled (a long step, a collection, stopped)
    migrations = Migrations()
    migrator = Migrator(MigrationPolicy(limit=3, wait=5.0), migrations)
    migrator.lost(link.address, lost.handles, lost.error, 1.3)
    assert h.migrations == 1 and migrator.parked

    beat(link, "e1", 2.0, ping=99)  # the same instance: it still runs r
    [ev] = link.events_received()
    assert isinstance(ev, Reattached) and ev.handle is h
    migrator.reattached(h)
    assert not migrator.parked and h.migrations == 0 and not h.lost_at and list(link.requests) == ["r"]
    assert aborts(link.data_to_send()) == []
    link.receive(delta("r", 1, "b", [2], "stop"), 2.1, 0)  # under its own id: no continuation was sent
    assert [d.text for d in sink.deltas] == ["a", "b"] and h.done and not h.rejoined
    assert link.events_received() == [] and migrations.outcomes["continued"] == 0


def test_a_suspended_request_continued_elsewhere_meanwhile_is_aborted_when_its_old_engine_answers() -> None:
    old = up("e1", address="ipc://old")
    new = up("e2", address="ipc://new")
    h, sink = open_request(old, "r", 0.1)
    lost = lost_with_missed_heartbeats(old, 1.3)
    migrator = Migrator(MigrationPolicy(limit=3, wait=5.0), Migrations())
    migrator.lost(old.address, lost.handles, lost.error, 1.3)
    migrator.place(1.3, [new])
    assert h.owner is new and h.engine_rid == "r.m1"

    old.receive(delta("r", 0, "LATE", [9]), 2.0, 0)  # the old instance wakes up: not this request's any more
    assert aborts(old.data_to_send()) == ["r"] and old.events_received() == [] and not old.suspended
    beat(old, "e1", 2.1, ping=99)
    assert old.events_received() == [] and sink.deltas == []


def test_a_new_instance_aborts_what_was_suspended_on_the_old_one() -> None:
    link = up("e1")
    open_request(link, "r", 0.1)
    lost_with_missed_heartbeats(link, 1.3)
    beat(link, "e2", 2.0, ping=99)
    assert link.events_received() == [] and aborts(link.data_to_send()) == ["r"] and not link.suspended


def test_a_tick_late_because_the_gateways_loop_stalled_is_not_the_engines_silence() -> None:
    link = up("e1", now=0.0)
    h, _ = open_request(link, "r", 0.1)
    # The loop stalls for 6 s (busy, or the process stopped): the tick due at 0.25 runs at 6.25, before the
    # reader had a turn to read the heartbeats waiting in the socket.
    assert link.healthy(6.2)  # a check between ticks: the overdue tick is the stall, too
    link.tick(6.25, 2)
    assert link.events_received() == [] and list(link.requests) == ["r"] and link.healthy(6.25)
    assert aborts(link.data_to_send()) == [] and link.longest_stall == 6.0
    beat(link, "e1", 6.26, ping=2)  # read right after
    assert link.events_received() == [] and h.migrations == 0


def test_an_engine_silent_after_the_gateways_stall_is_lost_a_timeout_after_the_loop_ran_again() -> None:
    link = up("e1", now=0.0)
    open_request(link, "r", 0.1)
    link.tick(6.25, 2)  # a 6 s stall
    for k in range(1, 3):  # the loop runs on time again; the engine says nothing
        link.tick(6.25 + k * INTERVAL, 2 + k)
        assert link.events_received() == []
    link.tick(7.0, 5)  # silent for 1 s of the time the loop ran: 0.25 s before the stall, 0.75 s after
    [lost] = link.events_received()
    assert isinstance(lost, Lost) and [h.request_id for h in lost.handles] == ["r"]


def test_a_stall_before_the_last_heartbeat_does_not_excuse_a_silence_after_it() -> None:
    link = up("e1", now=0.0)
    open_request(link, "r", 0.1)
    beat(link, "e1", 5.0, ping=1)  # read during a stall: the tick due at 0.25 has not run yet
    link.tick(5.05, 2)  # late, but only 0.05 s of it after the heartbeat
    for k in range(1, 4):
        link.tick(5.05 + k * INTERVAL, 2 + k)
    assert link.events_received() == []
    link.tick(6.01, 6)  # 1.01 s after the heartbeat, of which 0.05 s stalled
    assert link.events_received() == []
    link.tick(6.1, 7)
    [lost] = link.events_received()
    assert isinstance(lost, Lost)


def test_a_dropped_connection_loses_every_request_without_an_abort_and_nothing_is_sent_until_the_next_heartbeat(
) -> None:
    link = up("e1")
    h, _ = open_request(link, "r", 0.1)
    link.disconnected()
    [lost] = link.events_received()
    assert isinstance(lost, Lost) and lost.handles == [h] and "dropped" in lost.error.message
    assert aborts(link.data_to_send()) == []  # the engine can never answer it on a new connection
    assert not link.healthy(0.2) and link.disconnects == 1
    try:
        link.submit(submit("gap"), 0.2)
    except EngineError as exc:
        assert exc.code == "engine_unavailable"
    else:
        raise AssertionError("a submit into the gap was accepted")
    link.tick(0.3, 2)
    beat(link, "e2", 0.35)
    assert link.healthy(0.35) and link.restarts == 1


def test_a_continuation_goes_under_a_new_request_id_with_the_output_so_far_and_its_first_delta_is_an_event(
) -> None:
    old = up("e1", address="ipc://old")
    h, sink = open_request(old, "q", 0.0)
    old.receive(p.Accepted("q", 3), 0.05, 0)
    old.receive(delta("q", 0, " a", [7]), 0.1, 0)
    old.receive(delta("q", 1, " bé", [8, 9]), 0.2, 0)
    old.disconnected()
    [lost] = old.events_received()
    assert lost.handles == [h]
    h.migrations, h.lost_at = 1, 0.3  # what the pool does when it parks it

    new = up("e2", now=0.3, address="ipc://new")
    assert new.resume(h, 0.4)
    [cont] = new.data_to_send()
    assert isinstance(cont, p.Submit)
    assert (cont.request_id, cont.resume, cont.resume_chars, cont.resume_steps) == ("q.m1", [7, 8, 9], 5, [])
    assert cont.sampling == h.submit.sampling and h.owner is new and h.engine_rid == "q.m1"

    new.receive(p.Accepted("q.m1", 6), 0.45, 0)
    assert h.prompt_tokens == 3  # the first acceptance counts
    new.receive(delta("q.m1", 0, " c", [10], "length"), 0.5, 0)
    [ev] = new.events_received()
    assert isinstance(ev, Continued) and ev.handle is h and abs(ev.gap - 0.2) < 1e-9
    assert h.rejoined and not h.lost_at and h.output_ids == [7, 8, 9, 10] and h.output_chars == 7
    assert [d.text for d in sink.deltas] == [" a", " bé", " c"] and h.done


def test_a_late_delta_of_a_lost_engine_is_dropped_even_on_the_engine_that_continues_the_request() -> None:
    link = up("e1")
    h, sink = open_request(link, "q", 0.0)
    link.receive(delta("q", 0, "a", [1]), 0.1, 0)
    link.disconnected()
    link.events_received()
    link.receive(delta("q", 1, "LATE", [2]), 0.15, 0)  # the lost connection's last step, read late
    h.migrations, h.lost_at = 1, 0.2
    link.tick(0.2, 2)
    beat(link, "e1-restarted", 0.25)
    assert link.resume(h, 0.3)
    link.receive(delta("q", 2, "LATE", [3]), 0.35, 0)  # the old id on the new connection: not this request
    link.receive(delta("q.m1", 0, "b", [4]), 0.4, 0)
    assert [d.text for d in sink.deltas] == ["a", "b"] and h.output_ids == [1, 4]


def test_an_engine_error_before_a_continuations_first_delta_is_a_refusal_and_fails_the_request() -> None:
    link = up("e1")
    h = RequestHandle(link, submit("q"))
    sink = Recorder()
    h.attach(sink)
    h.migrations, h.lost_at = 1, 0.1
    assert link.resume(h, 0.2)
    link.receive(p.Error("q.m1", "context_length_exceeded", "too long"), 0.3, 0)
    [ev] = link.events_received()
    assert isinstance(ev, ContinuationRefused) and ev.handle is h
    assert h.done and [f.code for f in sink.failures] == ["context_length_exceeded"]


def test_routing_load_counts_the_submits_a_heartbeat_did_not_see_continuations_included() -> None:
    old = up("e1", address="ipc://old")
    new = up("e2", address="ipc://new")
    h, _ = open_request(old, "q", 0.1)
    new.tick(0.1, 2)
    ping_before = last_ping(new)
    open_request(new, "other", 0.15)
    assert (old.routing_load(), new.routing_load()) == (1, 1)

    old.disconnected()
    old.events_received()
    h.migrations, h.lost_at = 1, 0.2
    assert new.resume(h, 0.2)
    assert old.in_flight == 0 and new.in_flight == 2
    assert new.routing_load() == 2  # both sent after the last ping the engine answered

    beat(new, "e2", 0.25, ping=ping_before, running=0, waiting=0)  # it had read neither when it answered
    assert new.routing_load() == 2
    new.tick(0.3, 3)
    beat(new, "e2", 0.35, running=2, waiting=0)  # a ping sent after both: the engine's count is all there is
    assert new.routing_load() == 2 and new.load() == (2, 0)


def test_a_submit_the_driver_could_not_send_is_forgotten_and_not_counted() -> None:
    link = up()
    h = link.submit(submit("r"), 0.1)
    [msg] = link.data_to_send()
    assert isinstance(msg, p.Submit) and link.unsent(msg) is h
    assert not link.requests and link.routing_load() == 0


def test_closing_an_unfinished_request_aborts_it_and_a_finished_one_does_not() -> None:
    link = up()
    running, _ = open_request(link, "running", 0.1)
    done, _ = open_request(link, "done", 0.1)
    link.receive(delta("done", 0, "x", [1], "stop"), 0.2, 0)
    done.close()
    running.close()
    assert aborts(link.data_to_send()) == ["running"] and not link.requests and link.aborts_sent == 1


def test_each_deltas_steps_are_kept_and_a_continuation_of_an_openai_request_replays_them_all() -> None:
    old = up("e1", address="ipc://old")
    h, _ = open_request(old, "o", 0.0)
    old.receive(p.Accepted("o", 4, openai=True), 0.05, 0)
    old.receive(delta("o", 0, "", [11], steps=[[[0, 11], [1, 21]]]), 0.1, 0)
    old.receive(delta("o", 1, "", [12], steps=[[[0, 12]], [[0, 13], [1, 22, 23]]]), 0.2, 0)
    old.receive(delta("o", 2, "", []), 0.25, 0)  # a delta with no step of its own
    assert h.openai and h.steps == [[[0, 11], [1, 21]], [[0, 12]], [[0, 13], [1, 22, 23]]]
    old.disconnected()
    old.events_received()
    h.migrations, h.lost_at = 1, 0.3

    new = up("e2", now=0.3, address="ipc://new")
    assert new.resume(h, 0.4)
    [cont] = new.data_to_send()
    assert isinstance(cont, p.Submit) and cont.request_id == "o.m1"
    assert cont.resume_steps == [[[0, 11], [1, 21]], [[0, 12]], [[0, 13], [1, 22, 23]]]
    assert cont.resume == [11, 12]
    new.receive(delta("o.m1", 0, "", [14], steps=[[[0, 14]]]), 0.5, 0)
    assert h.steps[-1] == [[0, 14]] and len(h.steps) == 4


def test_the_migrator_parks_lost_requests_places_them_on_the_least_loaded_engine_and_times_out_the_rest() -> None:
    busy = up("busy", address="ipc://busy")
    idle = up("idle", address="ipc://idle")
    open_request(busy, "x", 0.0)
    lost_link = up("gone", address="ipc://gone")
    a, _ = open_request(lost_link, "a", 0.0)
    pen, _ = open_request(lost_link, "pen", 0.0)
    lost_link.receive(delta("pen", 0, "z", []), 0.1, 0)  # text without token ids: nothing to continue from
    lost_link.disconnected()
    [lost] = lost_link.events_received()

    migrations = Migrations()
    migrator = Migrator(MigrationPolicy(limit=2, wait=5.0), migrations)
    migrator.lost(lost_link.address, lost.handles, lost.error, 0.5)
    assert pen.done and migrations.outcomes["refused"] == 1 and migrations.refusals["no_token_ids"] == 1
    assert [h for h, _, _ in migrator.parked] == [a] and a.migrations == 1 and a.lost_at == 0.5

    migrator.place(0.6, [busy, idle])
    assert not migrator.parked and a.owner is idle and list(idle.requests) == ["a.m1"]
    idle.receive(delta("a.m1", 0, "x", [1]), 0.8, 0)
    [ev] = idle.events_received()
    assert isinstance(ev, Continued)
    migrator.continued(ev.handle, ev.gap, True)
    assert migrations.outcomes["continued"] == 1 and sum(migrations.gap.counts) == 1

    idle.disconnected()  # lost again, and no engine takes it
    [lost] = idle.events_received()
    migrator.lost(idle.address, lost.handles, lost.error, 0.9)
    busy.disconnected()
    migrator.place(0.95, [busy])
    assert migrator.parked and not a.done and a.migrations == 2
    sink = Recorder()
    a.attach(sink)
    migrator.place(5.9, [busy])
    assert a.done and migrations.outcomes["timeout"] == 1 and "within 5s" in sink.failures[0].message
