"""The delivery core's ports: what it needs of a gateway that is one of several (``--broker`` replicas,
``--workers`` processes). :mod:`gateway.scaleout` implements them; the core knows only these protocols.

Two roles, one protocol each, so neither side carries methods it has no use for:

- :class:`Publisher` (``--broker``, or ``--workers`` without one): the owner of a listed stream writes it
  where other gateways can read it (Redis; or its peer workers, which keep a standby of it to adopt if
  the owner dies), and a stored response's transcript with it.
- :class:`RemoteStreams` (``--broker`` or ``--workers``): a stream or a transcript that another gateway
  holds: a local mirror of the stream (:mod:`gateway.scaleout.mirror`), a cancel sent to its owner, the transcript.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.core.streams import Event, Stream


class Publisher(Protocol):
    """The owner's side: what the pump tells the other gateways about a listed stream it runs.

    ``durable``: its listed streams are gated (:attr:`gateway.core.streams.Stream.gated`): an event reaches a
    reader only once the publisher committed it where an adopter reads it (the broker; ``--workers``: the
    standby worker)."""

    durable: bool

    def serving(self) -> bool:
        """Whether this gateway can run listed streams now (False: the broker is unreachable, or this gateway
        lost its lease and fenced itself): ``/health`` says not ready."""

    async def created(self, stream: Stream) -> None:
        """Announce the stream before its id is handed out (APIError 503 if that fails)."""

    def published(self, stream: Stream, event: Event) -> None: ...
    def ended(self, stream: Stream) -> None: ...

    async def successor(self) -> bool:
        """On SIGTERM: mark this gateway draining; whether another gateway that is not draining is alive to
        adopt its listed streams (if not, they drain here as unlisted ones do)."""

    async def hand_over(self) -> None:
        """Before exiting with streams other gateways adopt: flush, then give up the owner lease."""

    def put_transcript(self, response_id: str, data: bytes, ttl: float) -> None:
        """Keep a finished stored response's transcript for ``ttl`` s where every replica finds it."""


class RemoteStreams(Protocol):
    """The reader's side: streams and transcripts that another gateway holds."""

    async def close(self) -> None: ...

    async def mirror(self, stream_id: str) -> Stream:
        """A local mirror of another gateway's stream; APIError 404 / 410 / 503."""

    async def cancel_remote(self, stream_id: str) -> bool:
        """Ask the gateway that runs the stream to cancel it; True once it says it did."""

    async def transcript(self, response_id: str) -> bytes | None:
        """The transcript of a response another gateway ran, or None."""
