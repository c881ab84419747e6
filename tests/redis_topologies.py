"""Real Redis topologies on loopback for tests: a Sentinel group (a primary, a replica, three sentinels) and a
Redis Cluster (three primaries with a replica each), from Debian's ``redis-server`` / ``redis-sentinel`` /
``redis-cli``, without persistence. Each context manager kills every process it started at exit; every wait
is bounded and names what it waited for."""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.system import require

WAIT_S = 30.0


def wait_for(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, *, bus: bool = False) -> list[int]:
    """``n`` consecutive free loopback ports (with ``bus``: each port + 10000 free as well, a cluster node's
    bus port), drawn at random from 20000–29999 so concurrent test runs rarely collide."""
    for _ in range(200):
        base = random.randrange(20000, 30000 - n)
        ports = list(range(base, base + n))
        if all(_port_free(p) and (not bus or _port_free(p + 10000)) for p in ports):
            return ports
    raise RuntimeError(f"no {n} free ports{' with bus ports' if bus else ''} in 20000-29999")


@dataclass
class Node:
    """One ``redis-server`` (or ``redis-sentinel``) process on 127.0.0.1:``port``."""

    port: int
    workdir: Path
    args: list[str]
    program: str = "redis-server"
    password: str | None = None
    username: str | None = None
    tls_ca: Path | None = None  # it speaks TLS only, with a certificate signed by this
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "log", "ab")  # noqa: SIM115 (closed with the process)
        self.proc = subprocess.Popen([self.program, *self.args], cwd=self.workdir, stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()
        wait_for(self.ping, f"{self.program} on port {self.port}", 10)

    def client(self) -> redis.Redis:
        tls = {"ssl": True, "ssl_ca_certs": str(self.tls_ca)} if self.tls_ca else {}
        return redis.Redis(port=self.port, username=self.username, password=self.password, socket_timeout=2,
                           socket_connect_timeout=2, **tls)  # type: ignore[arg-type]

    def ping(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the process is gone at once, its connections reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        path = self.workdir / "log"
        return path.read_text(errors="replace") if path.exists() else ""


def _server_args(port: int, *extra: str) -> list[str]:
    return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra]


@dataclass
class SentinelGroup:
    """A primary and a replica watched by three sentinels under the service name ``service``."""

    service: str
    data: list[Node]
    sentinels: list[Node]
    password: str | None = None

    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{auth}{hosts}/{self.service}"

    def master_port(self, sentinel: Node | None = None) -> int:
        _host, port = (sentinel or self.sentinels[0]).client().execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return int(port)

    def primary(self) -> Node:
        port = self.master_port()
        return next(n for n in self.data if n.port == port)

    def _settled(self, port: int) -> bool:
        try:
            if any(self.master_port(s) != port for s in self.sentinels if s.alive()):
                return False
            node = next(n for n in self.data if n.port == port)
            return node.client().execute_command("ROLE")[0] == b"master"
        except (redis.RedisError, StopIteration):
            return False

    def wait_replicated(self) -> None:
        """The replica is connected and in sync (so a failover can pick it)."""
        primary = self.primary()

        def synced() -> bool:
            try:
                info = primary.client().info("replication")
            except redis.RedisError:
                return False
            return int(info.get("connected_slaves", 0)) >= len([n for n in self.data if n.alive()]) - 1 and all(
                v.get("state") == "online" for k, v in info.items() if k.startswith("slave") and isinstance(v, dict))

        wait_for(synced, "the replica in sync with the primary")

        def known() -> bool:  # each sentinel lists the replica, so it can promote it
            try:
                return all(len(s.client().execute_command("SENTINEL", "REPLICAS", self.service)) >= 1
                           for s in self.sentinels)
            except redis.RedisError:
                return False

        wait_for(known, "every sentinel knowing the replica")

    def failover(self, *, kill: bool) -> tuple[int, int]:
        """Fail the primary over to the replica: SIGKILL it (``kill``: the sentinels notice it is down and elect
        a leader) or ``SENTINEL FAILOVER``; wait until every live sentinel names the new primary and it says it
        is one. (old port, new port)."""
        old = self.primary()
        if kill:
            old.kill()
        else:
            self.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", self.service)
        new = next(n for n in self.data if n is not old)
        wait_for(lambda: self._settled(new.port), f"sentinels to promote {new.port} (was {old.port})")
        return old.port, new.port

    def stop(self) -> None:
        for n in (*self.sentinels, *self.data):
            n.stop()


@contextlib.contextmanager
def sentinel_group(workdir: Path, service: str = "tokenfan", password: str | None = None) -> Iterator[SentinelGroup]:
    """Start a primary, its replica and three sentinels (quorum 2, a primary is down after 1 s unanswered)."""
    require("redis-server")
    require("redis-sentinel")
    ports = free_ports(5)
    auth = ["--requirepass", password, "--masterauth", password] if password else []
    primary = Node(ports[0], workdir / f"redis-{ports[0]}", _server_args(ports[0], *auth), password=password)
    replica = Node(ports[1], workdir / f"redis-{ports[1]}",
                   _server_args(ports[1], "--replicaof", "127.0.0.1", str(ports[0]), *auth), password=password)
    sentinels = []
    for port in ports[2:]:
        d = workdir / f"sentinel-{port}"
        d.mkdir(parents=True, exist_ok=True)
        conf = [f"port {port}", "bind 127.0.0.1", f"dir {d}",
                f"sentinel monitor {service} 127.0.0.1 {ports[0]} 2",
                f"sentinel down-after-milliseconds {service} 1000",
                f"sentinel failover-timeout {service} 5000",
                f"sentinel parallel-syncs {service} 1"]
        if password:
            conf.append(f"sentinel auth-pass {service} {password}")
        (d / "sentinel.conf").write_text("\n".join(conf) + "\n")
        sentinels.append(Node(port, d, [str(d / "sentinel.conf")], program="redis-sentinel"))
    group = SentinelGroup(service, [primary, replica], sentinels, password)
    try:
        for node in (primary, replica, *sentinels):
            node.start()
        group.wait_replicated()
        yield group
    finally:
        group.stop()


@dataclass
class Cluster:
    """Three primaries with a replica each (``redis-cli --cluster create ... --cluster-replicas 1``)."""

    nodes: list[Node]
    killed: list[Node] = field(default_factory=list)

    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])

    def client(self) -> redis.RedisCluster:
        live = next(n for n in self.nodes if n.alive())
        return redis.RedisCluster(host="127.0.0.1", port=live.port, socket_timeout=2)

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def shards(self) -> list[tuple[Node, list[Node]]]:
        """(primary, its replicas) per shard, as a live node sees them."""
        live = next(n for n in self.nodes if n.alive())
        out = []
        for slot in live.client().execute_command("CLUSTER", "SLOTS"):
            primary, *replicas = slot[2:]
            out.append((self.node(int(primary[1])), [self.node(int(r[1])) for r in replicas]))
        return out

    def primary_of(self, key: str) -> Node:
        slot = int(next(n for n in self.nodes if n.alive()).client().execute_command("CLUSTER", "KEYSLOT", key))
        for entry in next(n for n in self.nodes if n.alive()).client().execute_command("CLUSTER", "SLOTS"):
            if int(entry[0]) <= slot <= int(entry[1]):
                return self.node(int(entry[2][1]))
        raise LookupError(slot)

    def healthy(self) -> bool:
        """Every live node says cluster_state:ok and sees three primaries serving all slots."""
        try:
            for n in self.nodes:
                if not n.alive():
                    continue
                info = n.client().execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                    return False
            return True
        except redis.RedisError:
            return False

    def fail_over(self, primary: Node, *, kill: bool) -> Node:
        """Fail ``primary``'s shard over to its replica: SIGKILL the primary (the replica is elected once the
        others mark it failed) or ``CLUSTER FAILOVER`` on the replica (a coordinated switch). The new primary."""
        (replica,) = next(r for p, r in self.shards() if p is primary)  # a killed shard's has none left
        if kill:
            primary.kill()
            self.killed.append(primary)
        else:
            replica.client().execute_command("CLUSTER", "FAILOVER")

        def promoted() -> bool:
            try:
                return replica.client().execute_command("ROLE")[0] == b"master" and self.healthy() and all(
                    p is not primary for p, _ in self.shards())
            except redis.RedisError:
                return False

        wait_for(promoted, f"replica {replica.port} to take over from {primary.port}")
        if not kill:  # the old primary follows the new one: the shard can fail over again
            wait_for(lambda: any(p is replica and r == [primary] for p, r in self.shards()),
                     f"{primary.port} listed as {replica.port}'s replica")
        return replica

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


@contextlib.contextmanager
def redis_cluster(workdir: Path) -> Iterator[Cluster]:
    """Start six cluster-enabled ``redis-server`` (ports p and p + 10000 free for each), join them into three
    shards of a primary and a replica, wait until every node says the cluster is ok."""
    require("redis-server")
    require("redis-cli")
    ports = free_ports(6, bus=True)
    nodes = [Node(p, workdir / f"cluster-{p}", _server_args(p, "--cluster-enabled", "yes", "--cluster-config-file",
                                                            f"nodes-{p}.conf", "--cluster-node-timeout", "1000"))
             for p in ports]
    cluster = Cluster(nodes)
    try:
        for n in nodes:
            n.start()
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        wait_for(cluster.healthy, "cluster_state:ok on every node")
        wait_for(lambda: len(cluster.shards()) == 3 and all(len(r) == 1 for _, r in cluster.shards()),
                 "three shards with a replica each")
        yield cluster
    finally:
        cluster.stop()


@dataclass
class TlsRedis:
    """One ``redis-server`` that speaks only TLS, with an ACL user ``user`` (password ``password``) and the default
    user off; ``ca`` is the certificate to trust (self-signed, for 127.0.0.1 and localhost)."""

    node: Node
    ca: Path
    user: str
    password: str

    def url(self) -> str:
        """Without the password (the gateway takes it from ``TOKENFAN_BROKER_PASSWORD``)."""
        return f"rediss://{self.user}@127.0.0.1:{self.node.port}/0?ssl_ca_certs={self.ca}"


@contextlib.contextmanager
def tls_redis(workdir: Path, user: str = "tokenfan", password: str = "tls-secret") -> Iterator[TlsRedis]:
    from gateway.http.certs import generate

    require("redis-server")
    cert, key = generate(workdir / "tls")
    (port,) = free_ports(1)
    node = Node(port, workdir / f"tls-{port}", _server_args(
        0, "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
        "--user", "default", "off", "--user", user, "on", f">{password}", "~*", "&*", "+@all"),
        password=password, username=user, tls_ca=cert)
    try:
        node.start()
        yield TlsRedis(node, cert, user, password)
    finally:
        node.stop()
