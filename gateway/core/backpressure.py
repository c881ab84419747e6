"""Back-pressure: what happens to a reader that cannot keep up (:class:`SlowConsumerPolicy`)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.merge import MergeRules, coalesce
from gateway.core.streams import Event


@dataclass(slots=True)
class SlowConsumerPolicy:
    """What happens to a subscriber that cannot keep up.

    - Events that were already in the log when the subscriber's current write began (a late
      joiner's replay, a resume, a burst) are sent event by event, at most ``replay_batch`` per
      write, so every token keeps its own event and timing.
    - A subscriber is *lagging* when more than ``coalesce_after`` events were published while its
      last write was in progress (the client, not the producer, is the bottleneck); then its pending
      content events are merged (:func:`coalesce`) so it catches up with fewer, larger events. The same
      merge applies when the stream has failed or was cancelled, so the notice is not stuck behind a
      backlog (no text is lost: it arrives merged, then the notice).
    - A single write that does not complete within ``send_timeout`` seconds (the client stopped
      reading and the transport buffer is full) closes the subscriber with a ``slow_consumer``
      reason (SSE error event; WebSocket close 1013). It can resume from its last ``seq``.
    Memory per subscriber is bounded by the transport's write buffer: the subscriber itself holds
    only a cursor into the shared log.
    """

    coalesce_after: int = 8
    send_timeout: float = 10.0
    replay_batch: int = 64
    linger: float = 10.0  # after a cut, seconds the connection may still flush its ending before it is reset

    def plan(self, events: list[Event], cursor: int, lagging: bool, failing: bool = False,
             rules: MergeRules | None = None) -> list[Event]:
        """The next write for a reader at ``cursor``. ``failing``: the stream ended with an error or a
        cancel, so its notice must not queue behind a backlog: everything pending is merged by the API's
        ``rules`` (None: this reader never gets merged events)."""
        if rules is not None and (lagging or failing) and len(events) - cursor > self.coalesce_after:
            return coalesce(events[cursor:], rules)
        return events[cursor:cursor + self.replay_batch]


class SlowConsumer(Exception):
    """A write did not complete within the policy's send timeout."""
