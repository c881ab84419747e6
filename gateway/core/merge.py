"""Merging a lagging reader's content events: fewer, larger events, no text lost.

The delivery core knows no payload shape: each API says which of its events merge and how a merged
payload looks (:class:`MergeRules`); :func:`coalesce` applies them to a run of the log.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine_worker import protocol as p
from gateway.core.streams import Event


class MergeRules(Protocol):
    """An API's rule for merging a lagging reader's content events (:func:`coalesce`); the delivery core
    knows no payload shape: the OpenAI chunks' rules are :data:`gateway.api.chat_render.CHUNK_MERGE`, the
    Responses events' :data:`gateway.api.responses.stream.RESPONSES_MERGE`."""

    def group(self, payload: dict[str, Any]) -> object | None:
        """The run a content event may merge into (only with neighbours of the same group); None: never
        merged (lifecycle, usage, tool-call events keep their own event, nothing in them rebuilt)."""
        ...

    def merged(self, run: list[Event], text: str) -> dict[str, Any]:
        """The payload of a merged run: its last event's, carrying all of the run's ``text``."""
        ...


def coalesce(events: list[Event], rules: MergeRules) -> list[Event]:
    """Merge runs of content events into one event each (text concatenated, no text lost).

    A merged event takes the ``seq`` of the last event it covers, so resuming after it is exact;
    its ``tokenfan`` object records ``first_seq`` and ``coalesced`` (how many events it merged).
    Which events are content, and how a run's payload is rebuilt, is the API's ``rules``.
    """
    out: list[Event] = []
    run: list[Event] = []
    key: object | None = None

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append(_merge(run, rules))
        run.clear()

    for ev in events:
        group = rules.group(ev.payload)
        if group is not None and run and group == key:
            run.append(ev)
            continue
        flush()
        if group is None:
            out.append(ev)
        else:
            run.append(ev)
            key = group
    flush()
    return out


def _merge(run: list[Event], rules: MergeRules) -> Event:
    last = run[-1]
    text = "".join(e.text for e in run)
    timing = {**last.timing, "first_seq": run[0].seq, "coalesced": len(run), "sent_ns": p.now_ns()}
    return Event(last.seq, rules.merged(run, text), timing, text, last.finish_reason)
