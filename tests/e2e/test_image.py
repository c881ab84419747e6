"""The CPU image that ``make image`` built, started: its default entrypoint, the compose layout and the
Kubernetes pod's commands and probes, run from the image itself.

No container runtime can start a container here (podman's crun fails ``setrlimit``), so every process runs
with ``buildah run --isolation chroot`` in the image's own root filesystem, as the image's user (or the
user the manifest pins), with the image's environment, host directories bind-mounted where the manifests
mount volumes. Each test gets its own network namespace with only a loopback, so the image listens on its
real port (8000) and Redis on 6379, as in a container; the test reaches them through a TCP relay whose
upstream sockets are opened inside that namespace. What this does not reproduce: PID 1 semantics, cgroup
limits, the container runtime's own volume and DNS handling (names such as ``redis`` are set in the
container's /etc/hosts).

The image is the one in buildah's storage under ``deploy/image.sh store`` whose ``tokenfan.source-hash``
label matches the tree (``deploy/image.sh hash``): a stale or missing image fails with "run make image".
Skipped, with the reason, only where no image can be built: no buildah and no Docker daemon, or not root.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.helpers import chunk_text, sse_events, wait_until

ROOT = Path(__file__).resolve().parents[2]
IMAGE_SH = ROOT / "deploy" / "image.sh"
DOCKER = ROOT / "deploy" / "docker"
K8S = ROOT / "deploy" / "k8s"
IMAGE = "localhost/tokenfan:cpu"
UID = 10001
PORT = 8000  # the image's port: the default command, compose and the pod all use it

def _image_sh(*args: str) -> str:
    return subprocess.run([str(IMAGE_SH), *args], check=True, capture_output=True, text=True, cwd=ROOT,
                          timeout=60).stdout.strip()


def _why_impossible() -> str | None:
    if os.geteuid() != 0:
        return "buildah's chroot isolation, network namespaces and the vfs store need root"
    if not shutil.which("ip"):
        return "no `ip` (iproute2) to make the test's network namespace"
    tool = _image_sh("tool")
    if tool == "none":
        return "no image builder: no Docker daemon answers and buildah is not installed (make image-deps)"
    if tool == "docker":
        return ("the image was built with Docker; this test starts images with buildah (no daemon needed): "
                "TOKENFAN_IMAGE_TOOL=buildah make image")
    return None


WHY = _why_impossible()
pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(WHY is not None, reason=WHY or "")]


# --------------------------------------------------------------------------- buildah


@functools.cache
def buildah() -> list[str]:
    """buildah with the storage ``make image`` built into (``deploy/image.sh buildah-args``)."""
    return ["buildah", *_image_sh("buildah-args").split()]


def bah(*args: str, timeout: float = 180) -> str:
    out = subprocess.run([*buildah(), *args], check=True, capture_output=True, text=True, timeout=timeout)
    return out.stdout.strip()


@pytest.fixture(scope="module")
def image() -> dict[str, Any]:
    """The built image's OCI config; fails when it is missing or older than the tree."""
    try:
        info = json.loads(bah("inspect", "--type", "image", IMAGE))
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"no {IMAGE} in {_image_sh('store')}: run `make image` first ({exc.stderr.strip()[:200]})")
    labels = info["OCIv1"]["config"].get("Labels") or {}
    want = _image_sh("hash", "cpu")
    assert labels.get("tokenfan.source-hash") == want, f"{IMAGE} was built from another tree: run `make image`"
    return info["OCIv1"]["config"]  # type: ignore[no-any-return]


class Container:
    """A buildah working container of the image (its root filesystem is ``rootfs``)."""

    _n = itertools.count()

    def __init__(self, hosts: dict[str, str] | None = None, image: str = IMAGE) -> None:
        name = f"tokenfan-test-{os.getpid()}-{next(self._n)}"
        add = [f"--add-host={h}:{ip}" for h, ip in (hosts or {}).items()]
        self.id = bah("from", "--pull=false", "--name", name, *add, image)
        # buildah run mounts the image's VOLUMEs itself (a fresh directory each), and in no fixed order with
        # `-v` on the same path: the engine's socket landed in either (seen here). Docker and Kubernetes
        # mount the given volume there; so does the test, with the image's own volume list dropped.
        config = json.loads(bah("inspect", "--type", "container", self.id))["OCIv1"]["config"]
        self.volumes = sorted(config.get("Volumes") or {})
        if self.volumes:
            bah("config", *[f"--volume={v}-" for v in self.volumes], self.id)
        self.rootfs = Path(bah("mount", self.id))

    def remove(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError):
            bah("rm", self.id)


@pytest.fixture
def work() -> Iterator[Path]:
    """The test's volumes and logs, in the image store's folder, not pytest's tmp_path: pytest sessions of
    the same user (root) prune each other's older ``/tmp/pytest-of-root/pytest-N``, and a volume deleted
    under a running container was seen to fail these tests."""
    base = Path(_image_sh("store")) / "tests"
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def container() -> Iterator[Container]:
    c = Container()
    yield c
    c.remove()


# --------------------------------------------------------------------------- network namespace and relay

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class Netns:
    """A network namespace with only ``lo``, made for one test and deleted after it."""

    _n = itertools.count()

    def __init__(self) -> None:
        self.name = f"tfimg-{os.getpid()}-{next(self._n)}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def relay(self, port: int) -> str:
        """``http://127.0.0.1:<free host port>`` relayed to 127.0.0.1:``port`` inside the namespace: the
        accepting thread enters the namespace (setns is per thread), so each upstream socket it opens is
        there, while the listening socket was bound on the host's loopback."""
        listener = socket.create_server(("127.0.0.1", 0))
        ready = threading.Event()

        def pump(src: socket.socket, dst: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(65536):
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        def serve() -> None:
            with open(f"/var/run/netns/{self.name}") as ns:
                if _libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            ready.set()
            with listener:
                while True:
                    try:
                        client, _ = listener.accept()
                    except OSError:
                        return
                    try:
                        upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
                        upstream.settimeout(None)
                    except OSError:
                        client.close()
                        continue
                    for a, b in ((client, upstream), (upstream, client)):
                        threading.Thread(target=pump, args=(a, b), daemon=True).start()

        threading.Thread(target=serve, daemon=True, name=f"relay-{self.name}").start()
        ready.wait(5)
        self._listeners.append(listener)
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    _listeners: list[socket.socket]

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "delete", self.name], check=False)


@pytest.fixture
def netns() -> Iterator[Netns]:
    ns = Netns()
    ns._listeners = []
    yield ns
    for listener in ns._listeners:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    ns.delete()


# --------------------------------------------------------------------------- processes from the image


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _argv0(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    return ""


class Running:
    """One ``buildah run`` of a command in a container; ``pid`` is the command itself (the process a
    container runtime would signal), found below buildah's ``buildah-chroot-exec``."""

    def __init__(self, popen: subprocess.Popen[bytes], log: Path, name: str) -> None:
        self.popen, self.log, self.name = popen, log, name
        self._pid: int | None = None

    @property
    def pid(self) -> int:
        if self._pid is None:
            def find() -> bool:
                todo = [self.popen.pid]
                while todo:
                    p = todo.pop()
                    kids = _children(p)
                    if _argv0(p) == "buildah-chroot-exec" and kids:
                        self._pid = kids[0]
                        return True
                    todo += kids
                return False

            wait_until(find, timeout=30, what=f"{self.name}'s process")
        assert self._pid is not None
        return self._pid

    def uid(self) -> int:
        status = Path(f"/proc/{self.pid}/status").read_text()
        return int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1])

    def sigterm(self, timeout: float) -> tuple[int, float]:
        """SIGTERM to the command; its exit status and how long it took to exit."""
        t0 = time.monotonic()
        os.kill(self.pid, signal.SIGTERM)
        rc = self.popen.wait(timeout)
        return rc, time.monotonic() - t0

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(AssertionError, ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def run_in(c: Container, ns: Netns, argv: list[str], log: Path, *, env: dict[str, str] | None = None,
           volumes: dict[Path, str] | None = None, user: str | None = None) -> Running:
    """``argv`` run in ``c`` by ``buildah run --isolation chroot``, on ``ns``'s network."""
    cmd = [*ns.prefix(), *buildah(), "run", "--isolation", "chroot", "--network", "host"]
    for k, v in (env or {}).items():
        cmd += ["-e", f"{k}={v}"]
    for host, target in (volumes or {}).items():
        cmd += ["-v", f"{host}:{target}"]
    if user:
        cmd += ["--user", user]
    cmd += [c.id, "--", *argv]
    fh = log.open("wb")
    popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    fh.close()
    return Running(popen, log, log.stem)


def entry_argv(config: dict[str, Any]) -> list[str]:
    return [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])]


def with_entrypoint(config: dict[str, Any], command: list[str]) -> list[str]:
    """A command given by Compose (``command:``) or Kubernetes (``args:``): it replaces CMD, not ENTRYPOINT."""
    return [*(config.get("Entrypoint") or []), *command]


def volume_dir(path: Path, *, uid: int = UID, gid: int = UID, mode: int = 0o700) -> Path:
    """A host directory standing in for a volume: a new Docker volume copies the image directory's owner
    and mode (/run/tokenfan is 10001, 0700 in the image); an emptyDir is root's, 0777."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, gid)
    path.chmod(mode)
    return path


def with_anonymous_volumes(c: Container, work: Path, given: dict[Path, str], tag: str) -> dict[Path, str]:
    """``given`` plus, for each VOLUME of the image not among them, a fresh directory with the image
    directory's owner and mode: what Docker gives a container for a VOLUME that no ``-v`` names."""
    out = dict(given)
    for target in c.volumes:
        if target not in given.values():
            st = (c.rootfs / target.lstrip("/")).stat()
            out[volume_dir(work / f"{tag}-anon{target.replace('/', '-')}", uid=st.st_uid, gid=st.st_gid,
                           mode=stat.S_IMODE(st.st_mode))] = target
    return out


def wait_health(url: str, running: list[Running], timeout: float = 90) -> httpx.Response:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        for r in running:
            assert r.popen.poll() is None, f"{r.name} exited {r.popen.returncode}:\n{r.text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            resp = httpx.get(url + "/health", timeout=3)
            if resp.status_code == 200:
                return resp
            last = f"{resp.status_code} {resp.text[:200]}"
        time.sleep(0.3)
    raise AssertionError(f"/health not 200 within {timeout} s ({last}):\n" +
                         "\n".join(r.text()[-2000:] for r in running))


def stream_chat(url: str, max_tokens: int = 12) -> tuple[str, list[dict[str, str]]]:
    """A streamed chat completion: its text and its SSE events (the last one must be [DONE])."""
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events and events[-1]["data"] == "[DONE]", events[-3:]
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    return "".join(chunk_text(c) for c in chunks), events


# --------------------------------------------------------------------------- what the image holds


def test_the_image_names_a_non_root_user_and_holds_no_compiler_tests_or_pip_cache(
        image: dict[str, Any], container: Container) -> None:
    assert image["User"] == "tokenfan"
    passwd = {ln.split(":")[0]: ln.split(":") for ln in (container.rootfs / "etc/passwd").read_text().splitlines()}
    assert int(passwd["tokenfan"][2]) == UID and int(passwd["tokenfan"][3]) == UID
    assert entry_argv(image) == ["tokenfan", "serve", "--host", "0.0.0.0", "--port", str(PORT)]
    assert set(image.get("Volumes") or {}) == {"/run/tokenfan", "/var/cache/tokenfan", "/tmp"}
    env = dict(e.split("=", 1) for e in image["Env"])
    assert "PIP_CERT" not in env and "PIP_FIND_LINKS" not in env and "TORCH_INDEX_URL" not in env  # build args only
    rootfs = container.rootfs
    path_dirs = env["PATH"].split(":")
    compilers = [f"{d}/{cc}" for d in path_dirs for cc in ("cc", "gcc", "g++", "c++", "clang", "x86_64-linux-gnu-gcc-12")
                 if (rootfs / d.lstrip("/") / cc).exists()]
    assert not compilers, compilers
    assert not list((rootfs / "usr/lib/gcc").glob("*/*/cc1*")), "a C compiler's back end is in the image"
    caches = [p for p in ("root/.cache/pip", "home/tokenfan/.cache", "tmp/pip-build-env") if (rootfs / p).exists()]
    assert not caches, caches
    app = rootfs / "opt/tokenfan"
    assert sorted(p.name for p in app.iterdir() if not p.name.endswith(".egg-info")) == sorted(
        ["pyproject.toml", "setup.py", "README.md", "tokenfan_settings", "tokenfan", "engine_worker", "gateway", "tokenfan_bench",
         "web"])
    assert not [p for p in app.rglob("test_*.py")] and not (app / "tests").exists()
    assert not list((rootfs / "var/lib/apt/lists").glob("*_Packages*")), "apt lists left in the image"


# --------------------------------------------------------------------------- the default entrypoint


def _snapshot(rootfs: Path, skip: set[str]) -> dict[str, tuple[int, int, int, int]]:
    """(mtime, size, mode, uid) of every path in the container's root filesystem but the volumes and the
    kernel's. A directory's mtime and size are left out: buildah itself makes and removes an entry in /run
    at every run (seen with `true`); what a process creates or changes shows as the entry itself."""
    out: dict[str, tuple[int, int, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(rootfs):
        rel = "/" + os.path.relpath(dirpath, rootfs).lstrip(".")
        dirnames[:] = [d for d in dirnames if os.path.join(rel, d) not in skip]
        for name in [*filenames, *dirnames, ""]:
            p = os.path.join(dirpath, name) if name else dirpath
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(p)
                is_dir = stat.S_ISDIR(st.st_mode)
                out[os.path.join(rel, name) if name else rel] = (
                    0 if is_dir else st.st_mtime_ns, 0 if is_dir else st.st_size, st.st_mode, st.st_uid)
    return out


def test_the_default_entrypoint_serves_streams_writes_only_its_volumes_and_stops_on_sigterm(
        image: dict[str, Any], container: Container, netns: Netns, work: Path) -> None:
    run_dir = volume_dir(work / "run")
    cache_dir = volume_dir(work / "cache", mode=0o755)
    volumes = with_anonymous_volumes(container, work, {run_dir: "/run/tokenfan", cache_dir: "/var/cache/tokenfan"},
                                     "serve")
    skip = {"/proc", "/sys", "/dev", *volumes.values()}
    # buildah itself writes /etc/hosts, /etc/resolv.conf, … at each run: a first run makes them, then the snapshot
    warm = run_in(container, netns, ["true"], work / "warm.log", volumes=volumes)
    assert warm.popen.wait(60) == 0, warm.text()
    before = _snapshot(container.rootfs, skip)

    serve = run_in(container, netns, entry_argv(image), work / "serve.log",
                   env={"TOKENFAN_ENGINE": "synthetic"}, volumes=volumes)
    try:
        url = netns.relay(PORT)
        health = wait_health(url, [serve]).json()
        assert serve.uid() == UID, "the entrypoint must run as the image's user"
        text, events = stream_chat(url)
        assert text and len(events) > 3
        assert (run_dir / "engine.sock").is_socket(), sorted(os.listdir(run_dir))
        rc, took = serve.sigterm(timeout=30)
    finally:
        serve.stop()
    assert rc == 0, serve.text()[-3000:]
    assert took < 10, f"SIGTERM took {took:.1f} s: more than `docker stop`'s 10 s grace"
    assert health["status"] == "ok" and health["engine"]["backend"] == "synthetic", health

    after = _snapshot(container.rootfs, skip)
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, f"written outside the volumes: {changed[:20]}"


# --------------------------------------------------------------------------- the compose layout


def compose_services() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]  # type: ignore[no-any-return]


def compose_env(service: dict[str, Any], **override: str) -> dict[str, str]:
    """A service's ``environment`` with Compose's ``${VAR:-default}`` / ``${VAR-default}`` at their defaults."""
    import re

    out = {}
    for k, v in (service.get("environment") or {}).items():
        out[k] = override.get(k, re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", str(v)))
    return out


def redis_in(ns: Netns, argv: list[str], log: Path, port: int = 6379) -> subprocess.Popen[bytes]:
    """Debian's redis-server with the manifest's own arguments (its image cannot be pulled here)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (make test-deps)")
    args = [a for a in argv if a != "redis-server"]
    fh = log.open("wb")
    proc = subprocess.Popen([*ns.prefix(), exe, *args, "--port", str(port), "--bind", "127.0.0.1"],
                            stdout=fh, stderr=subprocess.STDOUT, cwd=log.parent)
    fh.close()

    def pong() -> bool:
        out = subprocess.run([*ns.prefix(), "redis-cli", "-p", str(port), "ping"], check=False,
                             capture_output=True, text=True)
        return out.stdout.strip() == "PONG"

    wait_until(pong, timeout=15, what="redis")
    return proc


def redis_keys(ns: Netns, port: int = 6379) -> list[str]:
    out = subprocess.run([*ns.prefix(), "redis-cli", "-p", str(port), "--scan"], capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


def test_compose_engine_gateway_and_redis_serve_a_stream_through_the_shared_socket_volume(
        image: dict[str, Any], netns: Netns, work: Path) -> None:
    services = compose_services()
    engine, gateway, redis = services["engine"], services["gateway"], services["redis"]
    named = {name: volume_dir(work / name, mode=0o700 if name == "ipc" else 0o755) for name in ("ipc", "models")}

    def mounts(service: dict[str, Any]) -> dict[Path, str]:
        return {named[v.split(":")[0]]: v.split(":")[1] for v in service["volumes"]}

    # two containers of one image, as Compose starts them (one root filesystem each), `redis` in /etc/hosts
    eng_c, gw_c = Container(), Container(hosts={"redis": "127.0.0.1"})
    procs: list[Running] = []
    redis_proc = redis_in(netns, redis["command"], work / "redis.log")
    try:
        # `command:` replaces the image's CMD; its ENTRYPOINT stays
        procs.append(run_in(eng_c, netns, with_entrypoint(image, engine["command"]), work / "engine.log",
                            user=engine["user"],
                            env=compose_env(engine, TOKENFAN_ENGINE="synthetic"),
                            volumes=with_anonymous_volumes(eng_c, work, mounts(engine), "engine")))
        procs.append(run_in(gw_c, netns, with_entrypoint(image, gateway["command"]), work / "gateway.log",
                            user=gateway["user"],
                            env=compose_env(gateway),
                            volumes=with_anonymous_volumes(gw_c, work, mounts(gateway), "gateway")))
        url = netns.relay(PORT)
        wait_health(url, procs)
        assert [p.uid() for p in procs] == [UID, UID]
        text, _ = stream_chat(url)
        assert text
        # a fan-out stream goes through the broker: its records are in Redis
        info = httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": 5},
                          timeout=10).json()
        events_url = info["events_url"] if info["events_url"].startswith("http") else url + info["events_url"]
        events = sse_events(httpx.get(events_url, timeout=30).text)
        assert events[-1]["data"] == "[DONE]"
        assert any(info["id"] in k for k in redis_keys(netns)), redis_keys(netns)
        # Compose's health check, run in the gateway container as Compose runs it
        check = run_in(gw_c, netns, gateway["healthcheck"]["test"][1:], work / "healthcheck.log",
                       user=gateway["user"])
        assert check.popen.wait(30) == 0, check.text()
        # stop as `docker compose down` does: SIGTERM to each container
        for p in reversed(procs):
            rc, took = p.sigterm(timeout=30)
            assert rc == 0 and took < 10, (p.name, rc, took, p.text()[-2000:])
    finally:
        for p in procs:
            p.stop()
        redis_proc.terminate()
        redis_proc.wait(10)
        eng_c.remove()
        gw_c.remove()


# --------------------------------------------------------------------------- the Kubernetes pod


def k8s_pod() -> dict[str, Any]:
    (deployment,) = [d for d in yaml.safe_load_all((K8S / "base" / "deployment.yaml").read_text())
                     if d and d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def k8s_cpu_env() -> dict[str, str]:
    """The ConfigMap the CPU overlay makes (base data, the overlay's patch on top)."""
    (base,) = [d for d in yaml.safe_load_all((K8S / "base" / "configmap.yaml").read_text()) if d]
    patch = yaml.safe_load((K8S / "overlays" / "cpu" / "configmap-cpu.yaml").read_text())
    return {**base["data"], **patch["data"]}


def probe_ok(url: str, container: dict[str, Any], probe: str,
             run: Callable[[list[str]], Running] | None = None) -> bool:
    """The kubelet's probe: an httpGet passes with a status from 200 to 399, an exec (``run`` runs its command
    in the container) with exit status 0 within ``timeoutSeconds``."""
    timeout = container[probe].get("timeoutSeconds", 1)
    if "exec" in container[probe]:
        assert run is not None, f"{probe} runs a command in the container"
        proc = run(container[probe]["exec"]["command"])
        try:
            return proc.popen.wait(timeout + 30) == 0  # + buildah's own start
        finally:
            proc.stop()
    spec = container[probe]["httpGet"]
    port = spec["port"]
    if isinstance(port, str):
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
    assert port == PORT
    return 200 <= httpx.get(url + spec["path"], timeout=timeout).status_code < 400


def test_the_pods_commands_and_probes_against_the_image_and_the_drain_within_prestop_and_grace(
        image: dict[str, Any], netns: Netns, work: Path) -> None:
    pod = k8s_pod()
    spec = {c["name"]: c for c in pod["containers"]}
    user = f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    # emptyDirs: root's, 0777 (the engine makes its own 0700 ipc/ below, as the manifest says)
    empty = {name: volume_dir(work / name, uid=0, gid=0, mode=0o777) for name in ("ipc", "models", "tmp")}
    ipc = empty["ipc"]
    env = k8s_cpu_env()
    broker = env["TOKENFAN_BROKER"].split("//")[1].split(":")[0]  # the Service name of redis.yaml
    # the synthetic engine, paced so a stream outlasts the gateway's drain (the pod's model would need minutes)
    env_engine = {**env, "TOKENFAN_ENGINE": "synthetic", "TOKENFAN_SYNTHETIC_TOKENS_PER_S": "20"}
    eng_c, gw_c = Container(hosts={broker: "127.0.0.1"}), Container(hosts={broker: "127.0.0.1"})
    procs: list[Running] = []
    (redis_doc,) = [d for d in yaml.safe_load_all((K8S / "base" / "redis.yaml").read_text())
                    if d and d["kind"] == "Deployment"]
    redis_proc = redis_in(netns, redis_doc["spec"]["template"]["spec"]["containers"][0]["args"],
                          work / "redis.log")
    try:
        for name, c in ((("engine", eng_c)), ("gateway", gw_c)):
            mounts = {empty[m["name"]]: m["mountPath"] for m in spec[name]["volumeMounts"] if m["name"] in empty}
            # `args:` replace the image's CMD; its ENTRYPOINT stays
            procs.append(run_in(c, netns, with_entrypoint(image, spec[name]["args"]), work / f"{name}.log",
                                user=user,
                                env=env_engine if name == "engine" else env, volumes=mounts))
        engine, gateway = procs
        url = netns.relay(PORT)
        wait_health(url, procs)
        assert (ipc / "ipc" / "engine.sock").is_socket()
        assert (ipc / "ipc").stat().st_mode & 0o777 == 0o700 and (ipc / "ipc").stat().st_uid == UID
        engine_mounts = {empty[m["name"]]: m["mountPath"] for m in spec["engine"]["volumeMounts"] if m["name"] in empty}

        def in_engine(argv: list[str]) -> Running:
            return run_in(eng_c, netns, argv, work / "engine-probe.log", user=user, env=env_engine,
                          volumes=engine_mounts)

        for name in ("engine", "gateway"):
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe in spec[name]:
                    assert probe_ok(url, spec[name], probe, in_engine), (name, probe)
        assert stream_chat(url)[0]

        # Pod deletion: both preStop hooks start; SIGTERM reaches each container when its hook ends.
        grace = pod["terminationGracePeriodSeconds"]
        pre = {n: int(spec[n]["lifecycle"]["preStop"]["exec"]["command"][1]) for n in spec}
        assert [spec[n]["lifecycle"]["preStop"]["exec"]["command"][0] for n in spec] == ["sleep", "sleep"]
        # an unlisted stream (POST SSE) in flight, longer than the gateway's drain: it is drained, then cut
        body: dict[str, Any] = {}
        streaming = threading.Event()  # the response has begun (its headers are in)

        def read_long() -> None:
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
                    "messages": [{"role": "user", "content": "x"}], "max_tokens": 1500, "stream": True}) as r:
                streaming.set()
                body["events"] = sse_events(r.read().decode())

        reader = threading.Thread(target=read_long)
        reader.start()
        # (the engine running it is not enough: beside a second pytest worker SIGTERM once came before the
        # response had begun, and that request was closed without one)
        wait_until(lambda: streaming.is_set() and httpx.get(url + "/health", timeout=3).json()["engine"]["running"] >= 1,
                   timeout=10, what="the long stream to run")
        rc_gw, drain = gateway.sigterm(timeout=grace)
        reader.join(30)
        assert rc_gw == 0, gateway.text()[-2000:]
        assert "server_shutdown" in json.dumps(body.get("events")), body
        # the engine outlives the gateway's drain: its preStop covers the gateway's preStop plus the drain
        assert pre["gateway"] + drain <= pre["engine"], (pre, drain)
        # the same gateway under Compose: `docker stop` waits stop_grace_period before SIGKILL
        assert drain < int(compose_services()["gateway"]["stop_grace_period"].removesuffix("s"))
        rc_en, engine_stop = engine.sigterm(timeout=grace)
        assert rc_en == 0, engine.text()[-2000:]
        # and the whole pod is gone within the grace period (measured: printed for docs/deploy.md)
        total = max(pre["gateway"] + drain, pre["engine"] + engine_stop)
        print(f"\ndrain: gateway {drain:.1f} s after SIGTERM, engine {engine_stop:.1f} s; "
              f"pod done {total:.1f} s after deletion, grace {grace} s")
        assert total < grace
    finally:
        for p in procs:
            p.stop()
        redis_proc.terminate()
        redis_proc.wait(10)
        eng_c.remove()
        gw_c.remove()


def test_readiness_drops_and_gateway_liveness_holds_when_the_engine_is_gone(
        image: dict[str, Any], netns: Netns, work: Path) -> None:
    """The manifest's design: the gateway's readiness (/readyz) and the engine's liveness (`tokenfan probe` over
    its socket) fail without an engine, while the gateway's own liveness probe (/livez) still passes, so only
    the engine is restarted."""
    pod = k8s_pod()
    spec = {c["name"]: c for c in pod["containers"]}
    user = f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    ipc = volume_dir(work / "ipc", uid=0, gid=0, mode=0o777)
    env = {k: v for k, v in k8s_cpu_env().items() if k != "TOKENFAN_BROKER"}  # this test runs no Redis
    env_engine = {**env, "TOKENFAN_ENGINE": "synthetic"}
    eng_c, gw_c = Container(), Container()
    procs: list[Running] = []
    try:
        procs.append(run_in(eng_c, netns, with_entrypoint(image, spec["engine"]["args"]), work / "engine.log",
                            user=user, env=env_engine, volumes={ipc: "/run/tokenfan"}))
        procs.append(run_in(gw_c, netns, with_entrypoint(image, spec["gateway"]["args"]), work / "gateway.log",
                            user=user, env=env, volumes={ipc: "/run/tokenfan"}))
        url = netns.relay(PORT)
        wait_health(url, procs)
        procs[0].stop()  # SIGKILL: a dead engine
        wait_until(lambda: not probe_ok(url, spec["gateway"], "readinessProbe"), timeout=15,
                   what="readiness to fail")

        def in_engine(argv: list[str]) -> Running:
            return run_in(eng_c, netns, argv, work / "engine-probe.log", user=user, env=env_engine,
                          volumes={ipc: "/run/tokenfan"})

        assert not probe_ok(url, spec["engine"], "livenessProbe", in_engine)
        assert probe_ok(url, spec["gateway"], "livenessProbe")
    finally:
        for p in procs:
            p.stop()
        eng_c.remove()
        gw_c.remove()


# --------------------------------------------------------------------------- the GPU Dockerfile, dry


def test_the_gpu_dockerfile_dry_build_starts_its_entrypoint(image: dict[str, Any], netns: Netns, work: Path) -> None:
    """Dockerfile.gpu built FROM a stand-in for the vLLM image (``deploy/image.sh gpu-dry``, run by ``make
    image``): its entrypoint and command serve (synthetic engine) as its user. No CUDA, no GPU."""
    gpu = "localhost/tokenfan:gpu-dry"
    try:
        config = json.loads(bah("inspect", "--type", "image", gpu))["OCIv1"]["config"]
    except subprocess.CalledProcessError:
        pytest.fail(f"no {gpu}: run `make image` (deploy/image.sh gpu-dry)")
    want = f"{_image_sh('hash', 'gpu')}-{image['Labels']['tokenfan.source-hash']}"
    assert (config.get("Labels") or {}).get("tokenfan.source-hash") == want, (
        f"{gpu} was built from another tree or CPU image: run `make image`")
    assert config["User"] == "tokenfan" and entry_argv(config) == entry_argv(image)
    c = Container(image=gpu)
    run_dir = volume_dir(work / "run")
    volumes = {run_dir: "/run/tokenfan", volume_dir(work / "cache", mode=0o755): "/var/cache/tokenfan"}
    serve = run_in(c, netns, entry_argv(config), work / "serve-gpu.log", env={"TOKENFAN_ENGINE": "synthetic"},
                   volumes=with_anonymous_volumes(c, work, volumes, "gpu"))
    try:
        url = netns.relay(PORT)
        wait_health(url, [serve])
        assert serve.uid() == UID
        assert stream_chat(url)[0]
        rc, took = serve.sigterm(timeout=30)
        assert rc == 0 and took < 10, (rc, took)
    finally:
        serve.stop()
        c.remove()


# --------------------------------------------------------------------------- the default model, opt-in


@pytest.mark.timeout(900)
@pytest.mark.skipif(os.environ.get("TOKENFAN_IMAGE_TEST_MODEL") != "1",
                    reason="the default model in the image takes minutes and ~3 GB: TOKENFAN_IMAGE_TEST_MODEL=1")
def test_the_default_entrypoint_serves_the_default_model(
        image: dict[str, Any], container: Container, netns: Netns, work: Path) -> None:
    """The image's default command with its default engine (vLLM, Gemma 3 270M prepared from the PyPI package
    into the /var/cache/tokenfan volume on first start): a real completion, nothing written outside the volumes."""
    run_dir = volume_dir(work / "run")
    cache_dir = volume_dir(work / "cache", mode=0o755)
    volumes = with_anonymous_volumes(container, work, {run_dir: "/run/tokenfan", cache_dir: "/var/cache/tokenfan"},
                                     "model")
    skip = {"/proc", "/sys", "/dev", *volumes.values()}
    warm = run_in(container, netns, ["true"], work / "warm.log", volumes=volumes)
    assert warm.popen.wait(60) == 0, warm.text()
    before = _snapshot(container.rootfs, skip)
    started = time.monotonic()
    serve = run_in(container, netns, entry_argv(image), work / "serve-model.log", volumes=volumes,
                   env={"TOKENFAN_KV_CACHE_GIB": "1"})  # the machine is shared: 1 GiB of KV cache, not 4
    try:
        url = netns.relay(PORT)
        health = wait_health(url, [serve], timeout=840).json()
        ready = time.monotonic() - started
        assert health["engine"]["backend"] == "vllm", health
        text, _ = stream_chat(url, max_tokens=16)
        assert text.strip()
        rc, took = serve.sigterm(timeout=60)
    finally:
        serve.stop()
    print(f"\ndefault model: ready {ready:.0f} s after start (first start: model prepared), "
          f"stopped {took:.1f} s after SIGTERM; reply {text!r}")
    assert rc == 0, serve.text()[-3000:]
    # the engine's stop, which compose's stop_grace_period for the engine covers (Docker's default 10 s may not)
    assert took < int(compose_services()["engine"]["stop_grace_period"].removesuffix("s"))
    after = _snapshot(container.rootfs, skip)
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, f"written outside the volumes: {changed[:20]}"
