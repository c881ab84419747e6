"""SIGHUP: the gateway reads its API keys, stream-token secrets and TLS certificates again, without a restart.

A :class:`Reloader` holds one *part* per kind of material, each an async callable that reads its files,
checks them, swaps them in and says what changed (or raises :class:`ReloadError`, and the old material
stays): ``api keys`` (``--api-key-file``, beside the fixed ``--api-key``), ``token secrets``
(``--token-secret-file``), ``tls`` (Granian's certificate, :mod:`gateway.http.granian_tls`) and ``http3 tls``
(the QUIC listener's, :mod:`gateway.http3.server`). Open connections keep going: a request's keys are checked
once at its start, a TLS session keeps the certificate of its handshake.

Each part logs one line (counts and what changed, never a key or a secret) and counts
``tokenfan_reloads_total{part, result}``. With ``--workers`` the supervisor forwards SIGHUP to every worker,
and each reloads its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from gateway.http.auth import Auth, AuthFileError, read_key_file, read_secret_file

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

log = logging.getLogger("tokenfan.reload")

Part = Callable[[], Awaitable[str]]  # reads, checks and swaps in one kind of material; says what changed


class ReloadError(ValueError):
    """New material that cannot be used (a file unreadable, a certificate that does not load); the old stays.
    A part may raise any ValueError (the QUIC listener's, below this package, does)."""


class Reloader:
    """The parts to reload on SIGHUP, run one after the other; a SIGHUP during a reload runs one more after it."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, Part]] = []
        self.counter: Any = None  # tokenfan_reloads_total, once the gateway's metrics exist
        self._task: asyncio.Task[None] | None = None
        self._again = False

    def add(self, name: str, part: Part) -> None:
        self.parts.append((name, part))

    def signal(self) -> None:
        """The SIGHUP handler (in the event loop)."""
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="reload")

    async def _run(self) -> None:
        while True:
            self._again = False
            await self.reload()
            if not self._again:
                return

    async def reload(self) -> bool:
        """Every part once; False if one kept its old material."""
        ok = True
        if not self.parts:
            log.info("reload: nothing to reload (no --api-key-file, --token-secret-file or certificate)")
        for name, part in self.parts:
            try:
                change = await part()
            except ValueError as exc:
                ok = False
                log.error("reload: %s: kept the old material: %s", name, exc)
                self._count(name, "error")
            else:
                log.info("reload: %s: %s", name, change)
                self._count(name, "ok")
        return ok

    def _count(self, name: str, result: str) -> None:
        if self.counter is not None:
            self.counter.labels(name.replace(" ", "_"), result).inc()


def auth_from(config: GatewayConfig) -> Auth:
    """The gateway's :class:`Auth` at its start (a key or secret file that cannot be read stops it)."""
    try:
        keys = read_key_file(config.api_key_file) if config.api_key_file else frozenset()
        if config.token_secret_file:
            if config.token_secret:
                raise SystemExit("--token-secret and --token-secret-file: give one of them")
            first, *previous = read_secret_file(config.token_secret_file)
            material: dict[str, Any] = {"secret": first, "previous": tuple(previous)}
        else:
            material = {"secret": config.token_secret.encode()} if config.token_secret else {}
    except AuthFileError as exc:
        raise SystemExit(str(exc)) from exc
    return Auth(api_keys=frozenset(config.api_keys) | keys, token_ttl=config.stream_token_ttl,
                allowed_origins=config.allowed_origins, required=config.api_key_file is not None, **material)


def add_auth_parts(reloader: Reloader, auth: Auth, config: GatewayConfig) -> None:
    """The parts for ``--api-key-file`` and ``--token-secret-file`` (none without them)."""
    if config.api_key_file is not None:
        key_file, fixed = config.api_key_file, frozenset(config.api_keys)

        async def api_keys() -> str:
            try:
                keys = fixed | read_key_file(key_file)
            except AuthFileError as exc:
                raise ReloadError(str(exc)) from exc
            added, removed = len(keys - auth.api_keys), len(auth.api_keys - keys)
            auth.api_keys = keys
            return f"{len(keys)} keys ({added} added, {removed} removed)"

        reloader.add("api keys", api_keys)
    if config.token_secret_file is not None:
        secret_file = config.token_secret_file

        async def token_secrets() -> str:
            try:
                first, *previous = read_secret_file(secret_file)
            except AuthFileError as exc:
                raise ReloadError(str(exc)) from exc
            before = {auth.secret, *auth.previous}
            rotated = first != auth.secret
            auth.secret, auth.previous = first, tuple(previous)
            after = {first, *previous}
            return (f"{len(after)} secrets ({'a new one signs' if rotated else 'the same one signs'}, "
                    f"{len(after - before)} added, {len(before - after)} dropped)")

        reloader.add("token secrets", token_secrets)
