"""What a framing is (pure: events in, bytes or text out): the base every API's framings derive from.

A :class:`Framing` turns a stream's events and its ending into what one kind of reader writes; each API
has its own (chat and completions: :mod:`gateway.api.openai.framing`; the Responses API:
:mod:`gateway.api.responses.stream`), with its merge rules for a lagging reader. The core knows payloads
only as bytes to wrap.

A reader that is cut for being too slow never gets a normal end: SSE readers get an
``event: error`` with code ``slow_consumer``, WebSocket readers a close 1013.
Frames shared by all readers of one format are cached on the event (``Event.frames``). A framing
names the API's merge rules for a lagging reader (``merge``; None: never merged).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core import sse
from gateway.core.merge import MergeRules
from gateway.core.streams import Event, Stream, Transport
from gateway.errors import slow_consumer


@dataclass(frozen=True, slots=True)
class Ending:
    """What a reader writes when its stream is over (``frame``) and, for WebSocket, how it closes."""

    frame: bytes | str | None
    close_code: int = 1000
    reason: str = ""
    last: bool = True  # the connection ends here (False: a /v1/ws request ends, the socket stays)


class Framing:
    """Base of the per-path framings: ``frame`` builds one event's frame, ``ending`` the close."""

    name = "base"
    transport: Transport = "sse"
    resumable = False
    merge: MergeRules | None = None  # how a lagging reader's content events merge (None: each on its own)
    relay = False  # its reader feeds another worker's mirror: written first in every pass (Stream._wake)
    standby = False  # it feeds the stream's standby: it reads a gated stream's pending events too (Stream.append)

    def frame(self, ev: Event) -> bytes | str:
        cached = ev.frames.get(self.name)
        if cached is None:
            cached = ev.frames[self.name] = self.build(ev)
        return cached

    def build(self, ev: Event) -> bytes | str:
        raise NotImplementedError

    def frame_bytes(self, ev: Event) -> bytes:
        """The frame as bytes (what a direct write puts on the wire; WebSocket: the text payload)."""
        f = self.frame(ev)
        return f if isinstance(f, bytes) else f.encode()

    def join(self, frames: list[bytes | str]) -> list[bytes | str]:
        """Frames to write for a batch: SSE frames concatenate into one write, WS messages stay apart."""
        if self.transport == "sse" and len(frames) > 1:
            return [b"".join(frames)]  # type: ignore[arg-type]
        return frames

    def ending(self, stream: Stream) -> Ending:
        raise NotImplementedError

    def cut(self, send_timeout: float) -> Ending:
        err = slow_consumer(send_timeout, self.resumable)
        if self.transport == "sse":
            return Ending(sse.event(err.to_bytes(), event="error"))
        return Ending(None, 1013, "slow consumer" + (": resume with ?after=<last seq>" if self.resumable else ""))
