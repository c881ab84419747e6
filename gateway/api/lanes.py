"""Scheduling of the requests of one WebSocket connection (``/v1/ws``, the Responses API's WebSocket mode):
:class:`Lanes`, pure, no I/O; :class:`WsClientError`, a client message refused on its lane."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gateway.errors import APIError, ClientError, Refusal

T = TypeVar("T")


class WsClientError(Exception):
    """A client message that cannot be served: the error, and the lane (``stream_id``) it was for."""

    def __init__(self, err: APIError, stream_id: str | None = None) -> None:
        super().__init__(err.message)
        self.error = err
        self.stream_id = stream_id


@dataclass(slots=True)
class _Lane(Generic[T]):
    queue: deque[T] = field(default_factory=deque)
    running: bool = False


class Lanes(Generic[T]):
    """Which ``response.create`` runs when on one connection (pure scheduling, no I/O).

    Each lane (``stream_id``; ``None`` is the default lane) runs its requests FIFO, one at a time.
    At most ``max_active`` lanes run at once; lanes with a waiting request take turns in the order
    they became ready (a lane that just finished one goes behind those already waiting).
    ``max_named`` distinct named lanes per connection (``websocket_stream_limit_reached`` after) and
    ``max_pending`` waiting requests (``pending_error``, by default a ``429``, after) bound what one socket
    can hold.

    ``/v1/ws`` uses it too, with one lane per request id and ``keep_idle=False``: a lane is forgotten when
    its request ends (or is cancelled while it waits), so ``max_active`` generations run and ``max_pending``
    wait, and an id is free again once its request is over.
    """

    def __init__(self, max_active: int = 16, max_named: int = 32, max_pending: int = 256, *,
                 keep_idle: bool = True, pending_error: Callable[[Lanes[T]], APIError] | None = None) -> None:
        self.max_active = max_active
        self.max_named = max_named
        self.max_pending = max_pending
        self.keep_idle = keep_idle
        self.pending_error = pending_error or _too_many_waiting
        self._lanes: dict[str | None, _Lane[T]] = {}
        self._ready: deque[str | None] = deque()  # lanes with a waiting head, in arrival order
        self._active = 0
        self._pending = 0

    @property
    def active(self) -> int:
        return self._active

    @property
    def pending(self) -> int:
        return self._pending

    def __contains__(self, lane_id: str | None) -> bool:
        return lane_id in self._lanes

    def cancel(self, lane_id: str | None) -> bool:
        """Drop the requests waiting on ``lane_id`` (not the running one); True if there were any."""
        lane = self._lanes.get(lane_id)
        if lane is None or not lane.queue:
            return False
        self._pending -= len(lane.queue)
        lane.queue.clear()
        if lane_id in self._ready:
            self._ready.remove(lane_id)
        if not lane.running and not self.keep_idle:
            del self._lanes[lane_id]
        return True

    def submit(self, lane_id: str | None, item: T) -> list[tuple[str | None, T]]:
        """Queue ``item`` on its lane; returns what to start now (lane, item), in order."""
        lane = self._lanes.get(lane_id)
        if lane is None:
            named = sum(1 for k in self._lanes if k is not None)
            if lane_id is not None and named >= self.max_named:
                raise WsClientError(ClientError(400, f"At most {self.max_named} distinct stream_id values per "
                                                  "connection.", param="stream_id",
                                             code="websocket_stream_limit_reached"), lane_id)
            lane = self._lanes[lane_id] = _Lane()
        if self._pending >= self.max_pending and not (self._active < self.max_active and not lane.running):
            if not lane.queue and not lane.running and not self.keep_idle:
                del self._lanes[lane_id]
            raise WsClientError(self.pending_error(self), lane_id)
        lane.queue.append(item)
        self._pending += 1
        if not lane.running and len(lane.queue) == 1:
            self._ready.append(lane_id)
        return self._schedule()

    def finished(self, lane_id: str | None) -> list[tuple[str | None, T]]:
        """The running request of ``lane_id`` reached its terminal event; returns what to start now."""
        lane = self._lanes.get(lane_id)
        if lane is None or not lane.running:
            raise RuntimeError(f"lane {lane_id!r} has nothing running")
        lane.running = False
        self._active -= 1
        if lane.queue:
            self._ready.append(lane_id)
        elif not self.keep_idle:
            del self._lanes[lane_id]
        return self._schedule()

    def _schedule(self) -> list[tuple[str | None, T]]:
        started = []
        while self._ready and self._active < self.max_active:
            lane_id = self._ready.popleft()
            lane = self._lanes[lane_id]
            lane.running = True
            self._active += 1
            self._pending -= 1
            started.append((lane_id, lane.queue.popleft()))
        return started


def _too_many_waiting(lanes: Lanes[Any]) -> APIError:
    return Refusal(429, f"Too many responses waiting on this connection (at most {lanes.max_pending}).",
                    type="rate_limit_error", code="rate_limit_exceeded")


# -- previous_response_id --------------------------------------------------------------------------
