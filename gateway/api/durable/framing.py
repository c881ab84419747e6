"""``?live=sse`` on the delivery core (pure): each event an ``event: data`` with its message and an ``event:
control`` with the next offset; the end a trailer (if any) and the closing control.

One framing per reader (its cursor, and where it is, are its own): the data event is built once per event and
kept on it for every reader (``Event.frames``), the control event (some 60 bytes) for each reader. Never merged
(a lagging reader gets every message as it is: a message is what an offset names). A reader cut as too slow gets
the core's ``event: error`` (which the protocol's clients skip) and the connection's end: they reconnect from
their last offset.
"""

from __future__ import annotations

from gateway.api.durable import protocol
from gateway.core.framing import Ending, Framing
from gateway.core.streams import Event, Stream

DATA = "durable_data"  # the key of an event's cached data event


class DurableSse(Framing):
    """One SSE reader of a stream from ``position``."""

    transport = "sse"
    resumable = True

    def __init__(self, stream: Stream, position: int, cursor: str) -> None:
        self.name = "durable_sse"
        self.stream = stream
        self.position = position  # the next message this reader gets
        self.cursor = cursor

    def frame(self, ev: Event) -> bytes:
        data = ev.frames.get(DATA)
        if data is None:
            data = ev.frames[DATA] = protocol.sse_data([ev.json])
        self.position = max(self.position, ev.seq + 1)
        up_to_date = ev.seq + 1 >= len(self.stream.events)
        return data + protocol.sse_control(ev.seq + 1, self.cursor, up_to_date)  # type: ignore[no-any-return]

    def frame_bytes(self, ev: Event) -> bytes:
        return self.frame(ev)

    def ending(self, stream: Stream) -> Ending:
        last = protocol.trailer(stream)
        frame = b""
        if last is not None and self.position <= len(stream.events):
            frame = protocol.sse_data([last])
        return Ending(frame + protocol.sse_control(protocol.tail(stream), None, True, is_closed=True))
