"""The ``--broker`` URL, and the Redis clients it makes: one Redis, a Sentinel-managed primary, or a Redis Cluster.

    redis://[user:password@]host:6379[/db]         one Redis (or replicas behind one endpoint); rediss:// for TLS
    unix:///path/to/redis.sock[?db=0]              one Redis on a Unix socket
    redis+sentinel://[user:password@]host:26379[,host:26379...]/<service>[/<db>]   rediss+sentinel:// for TLS
    redis+cluster://[user:password@]host:port[,host:port...]                       rediss+cluster:// for TLS

The user and password in the URL (else ``--broker-password``) authenticate to the Redis servers that hold
the data; sentinels that require a password of their own get ``--broker-sentinel-password``.

Every part of the broker takes its clients from :class:`Clients`: ``redis`` for ordinary commands, ``blocking``
for ``XREAD BLOCK`` / ``BLPOP`` (a socket timeout above the block time), and the pub/sub of the cancel RPC and
the presence channels, which differ by topology: classic ``PUBLISH`` / ``SUBSCRIBE`` on one Redis or a
Sentinel's primary; sharded ``SPUBLISH`` / ``SSUBSCRIBE`` on a cluster (a channel lives on its slot's primary,
so ``SPUBLISH``'s count and ``PUBSUB SHARDNUMSUB`` see every subscriber, which classic pub/sub on a cluster,
counted per node, would not).

Following a failover without a restart:

- Sentinel: redis-py's :class:`~redis.asyncio.sentinel.SentinelConnectionPool` asks the sentinels for the
  primary at each new connection (here: every sentinel, the newest configuration wins, :class:`NewestSentinel`);
  a connection also checks with ``ROLE`` that the server it reached is a primary. Connections that
  stay open are moved by :meth:`Clients.watch`, which closes them all when the sentinels name another
  primary.
- Cluster: :class:`~redis.asyncio.cluster.RedisCluster` follows ``MOVED`` and refreshes its slot map on
  connection errors; a sharded subscription is on one node, so it is given up (:class:`SubscriptionLost`)
  when that node drops it (``sunsubscribe`` after its slots moved), when the connection fails, or when the
  slot map names another primary, and made again on the slot's primary after a refresh.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.config import BrokerTimings
from gateway.scaleout.redis_support import (
    REDIS_ERRORS,
    _ClosedIsLost,
    cancel_requested,
    connection_class,
    redact,
)

log = logging.getLogger(__name__)

Topology = Literal["standalone", "sentinel", "cluster"]
SCHEMES: dict[str, tuple[Topology, bool]] = {  # scheme -> (topology, TLS)
    "redis": ("standalone", False), "rediss": ("standalone", True), "unix": ("standalone", False),
    "redis+sentinel": ("sentinel", False), "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False), "rediss+cluster": ("cluster", True),
}
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")  # query options of a TLS URL


@dataclass(frozen=True, slots=True)
class Credentials:
    """Passwords given outside the URL (settings ``broker_password``, ``broker_sentinel_password``)."""

    password: str | None = None
    sentinel_password: str | None = None


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    """A parsed ``--broker`` URL (:func:`parse_broker_url`)."""

    topology: Topology
    url: str
    tls: bool = False
    hosts: tuple[tuple[str, int], ...] = ()  # sentinels, or a cluster's startup nodes
    service: str = ""  # the sentinels' name of the primary
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls_options: dict[str, str] = field(default_factory=dict)


def parse_broker_url(url: str) -> BrokerAddress:
    """The address in ``url``; ValueError saying what is wrong with it."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"--broker {url.split('@')[-1]!r}: unknown scheme {parts.scheme!r} (one of "
                         f"{', '.join(s + '://' for s in SCHEMES)})")
    topology, tls = SCHEMES[scheme]
    if topology == "standalone":
        return BrokerAddress("standalone", url, tls)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = sorted(set(query) - set(TLS_OPTIONS))
    if unknown or (query and not tls):
        raise ValueError(f"--broker: unknown option {', '.join(unknown or sorted(query))} for {scheme}:// "
                         f"(a TLS URL, rediss+...://, takes {', '.join(TLS_OPTIONS)})")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, colon, pw = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(pw) if colon else None)
    hosts = []
    default_port = 26379 if topology == "sentinel" else 6379
    for item in filter(None, hostlist.split(",")):
        host, colon, port = item.rpartition(":") if "]" not in item.rsplit(":", 1)[-1] else (item, "", "")
        if not colon:
            host, port = item, str(default_port)
        try:
            hosts.append((host.strip("[]"), int(port)))
        except ValueError:
            raise ValueError(f"--broker: bad port in {item!r}") from None
    if not hosts:
        raise ValueError(f"--broker: {scheme}:// needs at least one host:port")
    path = [p for p in parts.path.split("/") if p]
    service, db = "", 0
    if topology == "sentinel":
        if not path or len(path) > 2:
            raise ValueError("--broker: redis+sentinel://host:26379[,host:26379...]/<service name>[/<db>]")
        service = unquote(path[0])
        path = path[1:]
    elif path:
        raise ValueError("--broker: a Redis Cluster has one database: redis+cluster://host:port[,host:port...]")
    if path:
        try:
            db = int(path[0])
        except ValueError:
            raise ValueError(f"--broker: database {path[0]!r} is not a number") from None
    return BrokerAddress(topology, url, tls, tuple(hosts), service, db, username, password, query)


class SubscriptionLost(RedisConnectionError):
    """A sharded subscription's node no longer serves its channel (its slots moved, or it failed)."""


class NewestSentinel(Sentinel):
    """Asks every sentinel and believes the one with the newest ``config-epoch`` (redis-py's takes the first that
    answers: right after a failover a sentinel the news has not reached yet names the old primary, which after
    ``SENTINEL FAILOVER`` still takes writes for seconds, until the sentinels turn it into a replica)."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        replies = await asyncio.gather(*(s.sentinel_masters() for s in self.sentinels), return_exceptions=True)
        best: dict[str, Any] | None = None
        errors = []
        for reply in replies:
            if isinstance(reply, BaseException):
                if not isinstance(reply, REDIS_ERRORS):
                    raise reply
                errors.append(repr(reply))
                continue
            state = reply.get(service_name)
            if state and self.check_master_state(state, service_name) and (
                    best is None or int(state.get("config-epoch", 0)) > int(best.get("config-epoch", 0))):
                best = state
        if best is None:
            raise MasterNotFoundError(f"No master found for {service_name!r}: {', '.join(errors)}")
        return str(best["ip"]), int(best["port"])


class SafeSentinelConnection(_ClosedIsLost, SentinelManagedConnection):
    """A connection to the primary the sentinels name, refused unless that server says it is the primary."""

    async def connect_to(self, address: Any) -> None:
        await super().connect_to(address)
        if not self.connection_pool.is_master:
            return
        await self.send_command("ROLE")
        role = await self.read_response()
        if not role or role[0] not in (b"master", "master"):
            await self.disconnect()
            raise RedisConnectionError(f"{address[0]}:{address[1]} is not the primary (yet): the sentinels "
                                       "named it before the failover reached them")


class SafeSentinelSSLConnection(SafeSentinelConnection, SentinelManagedSSLConnection):
    pass


class Subscription:
    """One channel subscribed to: :meth:`open`, then :meth:`get` until it raises; :meth:`aclose` always."""

    def __init__(self, redis: Any, channel: str) -> None:
        self.redis, self.channel = redis, channel
        self._pubsub: Any = None

    async def open(self) -> None:
        self._pubsub = self.redis.pubsub()
        await self._pubsub.subscribe(self.channel)

    async def get(self, timeout: float) -> bytes | None:
        """The next message's data, or None within ``timeout``; a Redis error once the subscription is lost."""
        msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
        return msg["data"] if msg is not None and msg.get("type") == "message" else None

    async def aclose(self) -> None:
        if self._pubsub is not None:
            await self._pubsub.aclose()


class ShardedSubscription(Subscription):
    """``SSUBSCRIBE`` on the primary of the channel's slot, over a plain connection to that node (redis-py's
    ClusterPubSub keeps a subscription it was told to drop, and hides a failed node's errors)."""

    def __init__(self, cluster: RedisCluster, channel: str, node_kwargs: dict[str, Any]) -> None:
        super().__init__(cluster, channel)
        self.cluster, self.node_kwargs = cluster, node_kwargs
        self._node: ClusterNode | None = None
        self._client: Redis | None = None

    async def open(self) -> None:
        self._node = node = self.cluster.get_node_from_key(self.channel)
        if node is None:
            raise SubscriptionLost(f"no primary serves the slot of {self.channel}")
        self._client = Redis(host=node.host, port=int(node.port), **self.node_kwargs)
        self._pubsub = self._client.pubsub()
        await self._pubsub.ssubscribe(self.channel)

    async def get(self, timeout: float) -> bytes | None:
        now = self.cluster.get_node_from_key(self.channel)
        if now is None or self._node is None or now.name != self._node.name:
            raise SubscriptionLost(f"{self.channel} moved to {now.name if now else 'no node'}")
        msg = await self._pubsub.get_message(timeout=timeout)
        if msg is None:
            return None
        kind = msg.get("type")
        if kind == "sunsubscribe":
            raise SubscriptionLost(f"{self._node.name} dropped {self.channel} (its slots moved)")
        return msg["data"] if kind == "smessage" else None

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            if self._client is not None:
                await self._client.aclose()


class Clients:
    """The broker's Redis clients for one URL (see the module docstring)."""

    def __init__(self, address: BrokerAddress, t: BrokerTimings, credentials: Credentials | None = None) -> None:
        self.address = a = address
        self.topology = a.topology
        self.sharded = a.topology == "cluster"
        creds = credentials or Credentials()
        password = a.password if a.password is not None else creds.password  # (standalone: from_url parses it)
        self._sentinel: NewestSentinel | None = None
        self.watch_interval = min(0.5, t.lease_interval)
        # One immediate retry, on a new connection: after a Redis restart every pooled connection is
        # stale and fails once. Beyond that the broker retries itself, with backoff, where it is safe.
        once = Retry(NoBackoff(), 1)
        blocking_timeout = t.block + t.op_timeout
        if a.topology == "standalone":
            given = creds.password is not None and urlsplit(a.url).password is None
            extra: dict[str, Any] = {"password": creds.password} if given else {}
            self.redis: Any = Redis.from_url(a.url, socket_timeout=t.op_timeout, socket_connect_timeout=t.op_timeout,
                                             retry=once, **connection_class(a.url), **extra)
            self.blocking: Any = Redis.from_url(a.url, socket_connect_timeout=t.op_timeout, retry=once,
                                                **connection_class(a.url), **extra)
            # set after parsing, so a socket_timeout in the URL cannot undercut the block time
            self.blocking.connection_pool.connection_kwargs["socket_timeout"] = blocking_timeout
            return
        tls = _tls_kwargs(a)
        auth = {"username": a.username, "password": password}
        if a.topology == "sentinel":
            sentinel_auth = {"password": creds.sentinel_password} if creds.sentinel_password else {}
            self._sentinel = NewestSentinel(a.hosts, sentinel_kwargs={"socket_timeout": t.op_timeout,
                                                                "socket_connect_timeout": t.op_timeout,
                                                                **sentinel_auth, **tls})
            conn = SafeSentinelSSLConnection if a.tls else SafeSentinelConnection
            common = {"db": a.db, "socket_connect_timeout": t.op_timeout, "retry": once, "connection_class": conn,
                      **auth, **{k: v for k, v in tls.items() if k != "ssl"}}
            self.redis = self._sentinel.master_for(a.service, socket_timeout=t.op_timeout, **common)
            self.blocking = self._sentinel.master_for(a.service, socket_timeout=blocking_timeout, **common)
            return
        nodes = [ClusterNode(h, p) for h, p in a.hosts]
        # a few retries inside redis-py: MOVED after a failover, and a refresh of the slot map after an error
        retry = Retry(ExponentialBackoff(cap=t.backoff_max, base=0.05), 3)
        common = {"socket_connect_timeout": t.op_timeout, "retry": retry, **auth, **tls}
        self.redis = RedisCluster(startup_nodes=nodes, socket_timeout=t.op_timeout, **common)
        self.blocking = RedisCluster(startup_nodes=list(nodes), socket_timeout=blocking_timeout, **common)
        self._node_kwargs = {"socket_timeout": t.op_timeout, "socket_connect_timeout": t.op_timeout,
                             "retry": once, **auth, **tls}

    async def watch(self, on_moved: Callable[[], None] | None = None) -> None:
        """Sentinel: ask the sentinels every ``interval`` which server is the primary; when it changes, close every
        connection of this gateway (pooled, in use, blocked in XREAD, subscribed) so that each reconnects to
        the new one. After a ``SENTINEL FAILOVER`` the old primary takes writes until the sentinels turn it
        into a replica, seconds later: a connection that stayed on it would write where nobody reads.
        ``on_moved()`` after a change (the broker repairs its streams: the new primary may lack the last
        records the old one took). Returns at once for the other topologies."""
        if self._sentinel is None:
            return
        service, current = self.address.service, None
        while not cancel_requested():
            try:
                addr = await self._sentinel.discover_master(service)
            except REDIS_ERRORS as exc:
                log.debug("broker: no sentinel answered (%s)", exc)
            else:
                if current is not None and addr != current:
                    log.warning("broker: the sentinels moved primary %r from %s:%s to %s:%s; reconnecting", service,
                                *current, *addr)
                    if on_moved is not None:
                        on_moved()
                current = addr
                # every time, not only at the change: a connection that was being made to the old primary
                # as the sentinels switched is connected there only now
                for client in (self.redis, self.blocking):
                    pool = client.connection_pool
                    for conn in (*pool._available_connections, *pool._in_use_connections):  # noqa: SLF001
                        if conn.is_connected and (conn.host, conn.port) != addr:
                            await conn.disconnect()
            await asyncio.sleep(self.watch_interval)

    def where(self) -> str:
        """The topology and its address, without passwords, for logs."""
        a = self.address
        if a.topology == "standalone":
            return redact(a.url)
        hosts = ",".join(f"{h}:{p}" for h, p in a.hosts)
        return f"{a.topology} {hosts}" + (f" (service {a.service}, db {a.db})" if a.service else "")

    def subscription(self, channel: str) -> Subscription:
        if self.sharded:
            return ShardedSubscription(self.redis, channel, self._node_kwargs)
        return Subscription(self.redis, channel)

    async def refresh(self) -> None:
        """After a subscription was lost: a cluster's slot map read again (a new primary, a dead one gone)."""
        if self.sharded:
            await self.redis.nodes_manager.initialize()

    async def publish(self, channel: str, data: bytes) -> int:
        """Publish; how many subscribers got it."""
        if self.sharded:
            return int(await self.redis.spublish(channel, data))
        return int(await self.redis.publish(channel, data))

    async def numsub(self, channel: str) -> int:
        """How many subscribers ``channel`` has (on a cluster: at its slot's primary, where they subscribe)."""
        if self.sharded:
            node = self.redis.get_node_from_key(channel)
            reply = await self.redis.execute_command("PUBSUB SHARDNUMSUB", channel, target_nodes=node)
        else:
            reply = await self.redis.pubsub_numsub(channel)
        return int(reply[0][1]) if reply else 0

    async def aclose(self) -> None:
        await self.redis.aclose()
        await self.blocking.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()


def _tls_kwargs(a: BrokerAddress) -> dict[str, Any]:
    if not a.tls:
        return {}
    kw: dict[str, Any] = {"ssl": True, **a.tls_options}
    return kw


def connect(url: str, t: BrokerTimings, credentials: Credentials | None = None) -> Clients:
    """The clients of ``--broker url`` (nothing is connected yet); ValueError for a URL that is not one."""
    return Clients(parse_broker_url(url), t, credentials)
