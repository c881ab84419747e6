"""What the ``--broker`` parts share: Redis errors, timeouts and backoff, key lifetimes, the 503 of an
unreachable broker."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio.connection import Connection, SSLConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError, ResponseError

from gateway.errors import APIError, StreamError

log = logging.getLogger(__name__)


KNOWN_TTL_S = 24 * 3600  # the 410-vs-404 marker, and the bound on a key whose owner died mid-stream


ACK_TTL_S = 30


# redis-py's errors (a cluster none of whose nodes answers raises RedisClusterException); sockets; asyncio timeouts
REDIS_ERRORS = (RedisError, RedisClusterException, OSError, TimeoutError)


class _ClosedIsLost:
    """redis-py on uvloop raises ``RuntimeError("unable to perform operation on <TCPTransport closed=True …>")``
    when a connection closes while a command is sent on it (Redis killed while a client reconnects): raised
    as redis-py's ``ConnectionError`` here, it is an outage like any other (seen in tests/e2e/test_partitions.py:
    a mirror ended ``stream_lost`` on it)."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except RuntimeError as exc:
            if "closed=True" not in str(exc):
                raise
            raise RedisConnectionError(f"the connection to Redis closed while in use ({exc})") from exc


class SafeConnection(_ClosedIsLost, Connection):
    pass


class SafeSSLConnection(_ClosedIsLost, SSLConnection):
    pass


def connection_class(url: str) -> dict[str, Any]:
    """``Redis.from_url`` keyword arguments: the connection class of ``url``'s scheme that raises a closed
    transport as ``ConnectionError`` (a ``unix://`` URL keeps redis-py's own)."""
    scheme = urlsplit(url).scheme
    if scheme == "redis":
        return {"connection_class": SafeConnection}
    if scheme == "rediss":
        return {"connection_class": SafeSSLConnection}
    return {}


def broker_unavailable(exc: BaseException) -> APIError:
    return StreamError(503, f"The stream broker (Redis) is unavailable ({type(exc).__name__}: {exc}); retry shortly.",
                    type="server_error", code="broker_unavailable", retry_after=1.0)


def is_oom(exc: BaseException | None) -> bool:
    """Whether ``exc`` is Redis refusing a write for lack of memory (``maxmemory`` with ``noeviction``:
    ``OOM command not allowed when used memory > 'maxmemory'``, also from inside a script)."""
    return isinstance(exc, OutOfMemoryError) or (isinstance(exc, ResponseError) and "OOM command" in str(exc))


def broker_full(exc: BaseException) -> APIError:
    """Redis answers but refuses writes for lack of memory: a new listed stream cannot be announced."""
    return StreamError(503, f"The stream broker (Redis) is out of memory and refuses writes ({exc}); retry later.",
                       type="server_error", code="broker_full", retry_after=5.0)


class Backoff:
    """Reconnect delays: doubling from ``first`` up to ``cap``, each drawn from [step/2, step] so replicas
    do not reconnect in lockstep; :meth:`reset` after a success."""

    def __init__(self, cap: float, first: float = 0.05) -> None:
        self.cap, self.first, self._n = cap, first, 0

    def next(self) -> float:
        delay = min(self.cap, self.first * 2 ** self._n)
        self._n += 1
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self._n = 0


def cancel_requested() -> bool:
    """Whether this task was asked to stop, even if redis-py swallowed the CancelledError (see
    :func:`gateway.scaleout.mirror.stop_tasks`): every loop here checks it, so one ``cancel()`` always ends it."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
