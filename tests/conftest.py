"""Session fixtures: real engine processes and real gateways on loopback ports.

One synthetic engine and one vLLM engine (tiny random-weight Llama built locally) are shared by
the whole session. A second vLLM engine, configured with vLLM's tool, reasoning and structured-output
flags (``parser_gateway``), and ``vllm serve`` (the differential suite's reference) are started only when a
collected test needs them; all of them boot together (:class:`VllmBoot`). Under pytest-xdist the tests that
need them all run on one worker (:func:`pytest_xdist_make_scheduler`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import resource
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.otlp import Receiver
from tests.procs import PARSER_FLAGS, npm_ci, spawn, start_engine, start_gateway
from tokenfan_bench.servers.processes import Proc, free_port, stop_all, wait_healthy


@pytest.fixture(scope="session")
def ipc_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tokenfan-test-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def synthetic_engine(ipc_dir: Path) -> Iterator[str]:
    address = f"ipc://{ipc_dir / 'synthetic.sock'}"
    proc = start_engine(address, "--engine", "synthetic", "--synthetic-ttft-ms", "5",
                        "--synthetic-tokens-per-s", "200", name="engine-synthetic")
    yield address
    proc.stop()


@pytest.fixture(scope="session")
def gateway_url(synthetic_engine: str) -> Iterator[str]:
    """A gateway attached to the shared synthetic engine."""
    proc, url = start_gateway(synthetic_engine, name="gateway-synthetic")
    yield url
    proc.stop()


@pytest.fixture(scope="session")
def scripted_gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The scripted engine behind vLLM's tool and reasoning parsers (tests/scripted.py), started once."""
    from tests.scripted import start_scripted

    proc, url = start_scripted(tiny_model, tmp_path_factory.mktemp("scripted"))
    yield url
    proc.stop(timeout=30)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_worker.models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


# The vLLM processes a session may need; each boot costs ~35 s of one core (importing torch and vLLM
# in the front, EngineCore and worker processes). Without xdist they start with the session's first test,
# side by side and at the lowest CPU priority (BOOT_NICE), and the modules that need them run last
# (pytest_collection_modifyitems): the boot takes the CPU the other tests leave idle and delays none of them.
# Under xdist the first test that needs any of them starts every one the session's collected tests need, at
# the normal priority: the other worker's tests run beside them for their whole life, and an engine at nice 19
# beside them once took more than 30 s for the first tokens of a few streams (a wait test_vllm_adoption bounds).
BOOT_NICE = 19
# The differential pair and the spare engine (LEAN_VLLM): the pair runs its requests side by side
# (test_vllm_parity.both), so one OpenMP thread each, and on 2 cores neither engine's thread pool spins
# against the other's. They also run vLLM's model worker inside its EngineCore process
# (VLLM_ENABLE_V1_MULTIPROCESSING=0: the "uni" executor, which vLLM's CPU platform otherwise turns into "mp"),
# one spawned process fewer: measured here, an engine worker with PARSER_FLAGS booted in 22 s and 22 s of CPU
# against 38 s and 37 s. The front and EngineCore processes, what tokenfan talks to, are vLLM's usual ones;
# the session's plain engine (vllm_engine) keeps vLLM's default executor, as `tokenfan serve` runs it.
LEAN_VLLM = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


# Structured outputs as PARSER_FLAGS set them (compact JSON: without it the tiny model writes whitespace until
# max_tokens), on the engine pair of the migration tests: a continued grammar must end where the control's did.
STRUCTURED = ("--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}')


# The session's OTLP/HTTP receiver (tests/otlp.py), started by the first vLLM engine that exports to it: the two
# traced engines export vLLM's request spans and their own there (test_vllm_tracing; the batch every 200 ms, not
# vLLM's default 5 s, so a test waits for spans, not for the batch).
_TRACES: list[Receiver] = []


def session_traces() -> Receiver:
    if not _TRACES:
        _TRACES.append(Receiver().__enter__())
    return _TRACES[0]


def _traced() -> tuple[list[str], dict[str, str]]:
    return ["--otlp-traces-endpoint", session_traces().endpoint], {"OTEL_BSP_SCHEDULE_DELAY": "200"}


def _start_vllm_engine(model: Path, ipc_dir: Path, nice: int) -> tuple[Proc, str]:
    address = f"ipc://{ipc_dir / 'vllm.sock'}"
    # float32 and the name "tiny", as the differential pair: test_vllm_parity_plain compares this engine's
    # plain chat path with vllm serve (dtype auto would be bfloat16 on an AMX CPU)
    return start_engine(address, "--engine", "vllm", "--model", str(model), "--max-model-len", "512",
                        "--dtype", "float32", "--served-model-name", "tiny", *STRUCTURED, name="engine-vllm",
                        nice=nice), address


def _traced_engine(k: int) -> Callable[[Path, Path, int], tuple[Proc, str]]:
    def start(model: Path, ipc_dir: Path, nice: int) -> tuple[Proc, str]:
        """A plain engine of test_vllm_tracing, which kills one of the two mid-stream (same model, dtype and name:
        a continuation on either decodes the same); lean (LEAN_VLLM), traced."""
        address = f"ipc://{ipc_dir / f'vllm-traced-{k}.sock'}"
        traced, env = _traced()
        return start_engine(address, "--engine", "vllm", "--model", str(model), "--max-model-len", "512", "--dtype",
                            "float32", "--served-model-name", "tiny", "--kv-cache-gib", "1", *traced,
                            name=f"engine-vllm-traced-{k}", nice=nice, env={**LEAN_VLLM, **env}), address
    return start


def _start_parser_gateway(model: Path, ipc_dir: Path, nice: int) -> tuple[Proc, str]:
    port = free_port()
    proc = spawn(["-m", "tokenfan.cli", "serve", "--engine", "vllm", "--model", str(model),
                  "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512",
                  "--kv-cache-gib", "1", "--engine-address", f"ipc://{ipc_dir / 'parser.sock'}",
                  "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *PARSER_FLAGS],
                 "tokenfan-parser", env=LEAN_VLLM, nice=nice)
    return proc, f"http://127.0.0.1:{port}"


def _start_vllm_serve(model: Path, ipc_dir: Path, nice: int) -> tuple[Proc, str]:
    port = free_port()
    env = {"VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **LEAN_VLLM}
    proc = spawn(["-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                  "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512",
                  "--enforce-eager", "--disable-log-stats", "--host", "127.0.0.1", "--port", str(port),
                  *PARSER_FLAGS], "vllm-serve", env=env, nice=nice)
    return proc, f"http://127.0.0.1:{port}"


def _start_spare_engine(model: Path, ipc_dir: Path, nice: int) -> tuple[Proc, str]:
    """A second engine beside the parser engine of :func:`_start_parser_gateway` for test_vllm_migration,
    which kills it (booted with the others, not in the test): the same flags, dtype and threads as that engine
    (vLLM's hermes and qwen3 parsers; float32: a continuation on the other engine must decode the same)."""
    address = f"ipc://{ipc_dir / 'vllm-spare.sock'}"
    return spawn(["-m", "engine_worker", "--address", address, "--engine", "vllm", "--model", str(model),
                  "--max-model-len", "512", "--dtype", "float32", "--served-model-name", "tiny", "--kv-cache-gib",
                  "1", *PARSER_FLAGS], "engine-vllm-spare", env=LEAN_VLLM, nice=nice), address


VLLM_STARTS: dict[str, Callable[[Path, Path, int], tuple[Proc, str]]] = {
    "vllm_engine": _start_vllm_engine, "parser_gateway": _start_parser_gateway, "vllm_serve": _start_vllm_serve,
    "vllm_spare_engine": _start_spare_engine, "vllm_traced_engine": _traced_engine(0),
    "vllm_traced_engine_b": _traced_engine(1)}


def needs_vllm(item: pytest.Item) -> bool:
    return any(name in VLLM_STARTS for name in getattr(item, "fixturenames", ()))


# Under pytest-xdist (make test: -n 2 --dist loadgroup; docs/tests.md) every test that needs a vLLM process runs on one
# worker, so a run still boots each vLLM process once, and the other tests go module by module (a module's
# fixtures start once). Only a worker collects, so each worker writes its tests' groups to a file the
# controller's scheduler reads. (xdist's own loadgroup renames nodeids, which pytest 9.2 no longer allows.)
GROUPS_FILE = "tokenfan_groups_file"
GROUPED = "tokenfan_grouped"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput[GROUPS_FILE] = str(_groups_file(node.config))
    node.workerinput[LOCK_FILES] = _locks(_groups_file(node.config))
    node.workerinput[GROUPED] = node.config.getvalue("dist") == "loadgroup"  # GroupScheduling, below


def _groups_file(config: pytest.Config) -> Path:
    if not hasattr(config, "_tokenfan_groups"):
        handle, path = tempfile.mkstemp(prefix="tokenfan-xdist-groups-", suffix=".json")
        os.close(handle)
        config._tokenfan_groups = Path(path)  # type: ignore[attr-defined]
        config.add_cleanup(config._tokenfan_groups.unlink)  # type: ignore[attr-defined]
        for lock in _locks(config._tokenfan_groups):  # type: ignore[attr-defined]
            config.add_cleanup(functools.partial(Path(lock).unlink, missing_ok=True))
    return config._tokenfan_groups  # type: ignore[attr-defined, no-any-return]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = getattr(config, "workerinput", {}).get(GROUPS_FILE)
    if path is None:  # no xdist: the modules that need a vLLM process last, while it boots (see BOOT_NICE)
        vllm_modules = {item.nodeid.split("::")[0] for item in items if needs_vllm(item)}
        items.sort(key=lambda item: item.nodeid.split("::")[0] in vllm_modules)
        return
    groups = {item.nodeid: "vllm" if needs_vllm(item) else item.nodeid.split("::")[0] for item in items}
    tmp = Path(f"{path}.{os.getpid()}")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, path)  # every worker writes the same groups: whole files only


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups_file = _groups_file(config)

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scope scheduling with this suite's groups as the scopes (read once every worker collected)."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(groups_file.read_text())
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


# A test marked `alone` reads time (a benchmark's medians, a proxy's jitter) and runs with the other xdist
# worker paused between its tests: `alone` takes an exclusive lock that every other test holds shared from its
# setup to its teardown. A gate lock comes first, so a waiting `alone` test keeps the other worker from
# starting new tests while it waits for the running one (flock alone would let that worker take the shared
# lock again and again). Without xdist there is no other worker and the locks are never contended.
LOCK_FILES = "tokenfan_lock_files"


def _locks(groups_file: Path) -> tuple[str, str]:
    """The gate and run lock files of a session (beside its groups file, removed with it)."""
    return f"{groups_file}.gate", f"{groups_file}.run"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    locks = getattr(item.config, "workerinput", {}).get(LOCK_FILES)
    if locks is None:
        with _cpu_logged(item):
            yield
        return
    alone = item.get_closest_marker("alone") is not None
    with open(locks[0], "a") as gate, open(locks[1], "a") as run:
        fcntl.flock(gate, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            with _cpu_logged(item):
                yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


# TOKENFAN_TEST_CPU=<file>: one JSON line per test, its wall time and the CPU seconds its worker and the
# processes it reaped used (a session's long-lived processes, such as the vLLM engines, count when they stop).
CPU_LOG = os.environ.get("TOKENFAN_TEST_CPU")


def _cpu_s() -> float:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


@contextlib.contextmanager
def _cpu_logged(item: pytest.Item) -> Iterator[None]:
    if CPU_LOG is None:
        yield
        return
    t0, cpu0 = time.time(), _cpu_s()
    try:
        yield
    finally:
        row = {"test": item.nodeid, "start": t0, "wall_s": time.time() - t0, "cpu_s": _cpu_s() - cpu0,
               "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
        with open(CPU_LOG, "a") as f:
            f.write(json.dumps(row) + "\n")


class VllmBoot:
    """Starts the session's vLLM processes together on first use; each fixture waits for its own."""

    def __init__(self, session: pytest.Session, tiny_model: Path, ipc_dir: Path) -> None:
        self.model, self.ipc_dir = tiny_model, ipc_dir
        self.nice = 0 if hasattr(session.config, "workerinput") else BOOT_NICE
        needed = {name for item in session.items for name in getattr(item, "fixturenames", ())}
        self.procs: dict[str, tuple[Proc, str]] = {
            name: start(tiny_model, ipc_dir, self.nice) for name, start in VLLM_STARTS.items() if name in needed}
        session.config.stash[VLLM_BOOT] = self

    def get(self, name: str) -> tuple[Proc, str]:
        if name not in self.procs:  # a fixture requested dynamically (getfixturevalue) by no collected test
            self.procs[name] = VLLM_STARTS[name](self.model, self.ipc_dir, self.nice)
        return self.procs[name]

    def stop(self) -> None:
        """Stops every process (once: a later :meth:`get` starts that one again)."""
        procs, self.procs = self.procs, {}
        stop_all((proc for proc, _ in procs.values()), timeout=30)
        # a clean stop of our vLLM engines leaves nothing for vLLM's AsyncLLM.__del__ at interpreter exit
        # (it once printed a TypeError traceback after every stop)
        for name in ("vllm_engine", "parser_gateway"):
            if name in procs:
                log = procs[name][0].log()
                assert "Exception ignored in" not in log, (name, log[log.index("Exception ignored in"):][:2000])


VLLM_BOOT = pytest.StashKey[VllmBoot]()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The vLLM processes stop after the session's last test that needs them, not at its end: idle, each
    EngineCore still polls (about 2% of a core each, measured here), and under xdist their tests run first,
    one group on one worker (:func:`pytest_xdist_make_scheduler`), so they would idle for most of the run."""
    boot = item.config.stash.get(VLLM_BOOT, None)
    if boot is None or nextitem is None or not needs_vllm(item) or needs_vllm(nextitem):
        return
    if hasattr(item.config, "workerinput"):
        if not item.config.workerinput.get(GROUPED):  # xdist's own modes may mix them with the rest
            return
    elif any(map(needs_vllm, item.session.items[item.session.items.index(nextitem):])):
        return  # one process: the rest of the session in collection order
    boot.stop()  # under this suite's scheduler the group runs in one piece: it ends here


@pytest.fixture(scope="session")
def vllm_boot(request: pytest.FixtureRequest, tiny_model: Path, ipc_dir: Path) -> Iterator[VllmBoot]:
    boot = VllmBoot(request.session, tiny_model, ipc_dir)
    try:
        yield boot
    finally:
        boot.stop()


@pytest.fixture(scope="session", autouse=True)
def _boot_vllm_first(request: pytest.FixtureRequest) -> None:
    """Without xdist: start the vLLM processes the session needs with its first test (see BOOT_NICE)."""
    if getattr(request.config, "workerinput", None) is None and any(map(needs_vllm, request.session.items)):
        request.getfixturevalue("vllm_boot")


@pytest.fixture(scope="session")
def vllm_engine(vllm_boot: VllmBoot) -> tuple[str, Proc]:
    proc, address = vllm_boot.get("vllm_engine")
    return address, proc


@pytest.fixture(scope="session")
def vllm_spare_engine(vllm_boot: VllmBoot) -> tuple[str, Proc]:
    proc, address = vllm_boot.get("vllm_spare_engine")
    return address, proc


@pytest.fixture(scope="session")
def vllm_traced_engine(vllm_boot: VllmBoot) -> tuple[str, Proc]:
    proc, address = vllm_boot.get("vllm_traced_engine")
    return address, proc


@pytest.fixture(scope="session")
def vllm_traced_engine_b(vllm_boot: VllmBoot) -> tuple[str, Proc]:
    proc, address = vllm_boot.get("vllm_traced_engine_b")
    return address, proc


@pytest.fixture(scope="session")
def vllm_traces() -> Receiver:
    """The OTLP/HTTP receiver the session's traced vLLM engines export to (:func:`session_traces`)."""
    return session_traces()


@pytest.fixture(scope="session")
def vllm_gateway_url(vllm_engine: tuple[str, Proc]) -> Iterator[str]:
    """A gateway attached to the shared real vLLM engine (tiny model); waits for the engine start."""
    address, _engine = vllm_engine
    # ~40 s on a quiet box; 244 s was seen at load 17
    proc, url = start_gateway(address, name="gateway-vllm", timeout=480)
    yield url
    proc.stop()


@pytest.fixture(scope="session")
def parser_gateway(vllm_boot: VllmBoot) -> str:
    """``tokenfan serve`` on the tiny model with :data:`~tests.procs.PARSER_FLAGS` (float32): the
    differential suite against ``vllm serve`` and the agent SDK tests share this one process."""
    proc, url = vllm_boot.get("parser_gateway")
    wait_healthy(url, proc, timeout=600)
    return url


@pytest.fixture(scope="session")
def vllm_serve(vllm_boot: VllmBoot) -> str:
    """``vllm serve`` on the same model and flags as :func:`parser_gateway`: the differential suite's reference."""
    proc, url = vllm_boot.get("vllm_serve")
    wait_healthy(url, proc, timeout=600)
    return url


@pytest.fixture(scope="session")
def node_dir() -> Path:
    """``tests/node`` with the npm packages of its lockfile installed (``npm ci`` when they are not)."""
    try:
        return npm_ci()
    except RuntimeError as exc:
        pytest.fail(str(exc))
