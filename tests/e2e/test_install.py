"""The wheel is the whole product: built from the committed files, installed without the source tree, it
serves a generation over every transport from any directory.

A wheel is built once per session from a copy of the tracked files (``git ls-files``: a file the checkout has
but git does not is not in it), with the suite's own setuptools (no network). It is installed, without its
dependencies, into a fresh venv (``--without-pip``, no system site-packages) whose one ``.pth`` line puts the
suite's site-packages on the path for the dependencies: a ``.pth`` line adds a directory and runs none of the
``.pth`` files in it, so the editable install's finder stays out and every tokenfan module is the wheel's
(checked). Then ``tokenfan serve --engine synthetic --http3-port`` runs from an unrelated directory, and a chat
completion streams over POST SSE, ``/v1/ws``, a fan-out stream's SSE and HTTP/3.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from websockets.sync.client import connect

from tests.e2e.helpers import sse_events
from tests.procs import ROOT
from tokenfan_bench.clients.quic import QuicOrigin, free_udp_port
from tokenfan_bench.servers.processes import Proc, free_port, wait_healthy
from tokenfan_bench.wire.events import SseDecoder
from tokenfan_settings.release import __version__

ROOTS = ("tokenfan_settings", "tokenfan", "gateway", "engine_worker", "tokenfan_bench")
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "LICENSE", *(f"{r}/" for r in ROOTS), "web/")
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True, "ignore_eos": True}
MODULES = ("tokenfan", "tokenfan.cli", "tokenfan_settings", "gateway", "gateway.http3.server", "engine_worker",
           "engine_worker.backends.synthetic", "tokenfan_bench", "tokenfan_web")

pytestmark = pytest.mark.timeout(300)


def tracked() -> list[str]:
    """The committed files the wheel is built from."""
    out = subprocess.run(["git", "ls-files", "-z", "--", *BUILD_INPUTS], cwd=ROOT, capture_output=True,
                         check=True).stdout
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the tracked files (so the checkout gets no build/ and no egg-info)."""
    d = tmp_path_factory.mktemp("wheel")
    for rel in tracked():
        (d / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, d / "src" / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--disable-pip-version-check", "-w", str(d / "dist"), str(d / "src")],
                   check=True, cwd=d, timeout=240)
    (built,) = (d / "dist").glob("tokenfan-*.whl")
    return built


@pytest.fixture(scope="session")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel; its dependencies are the suite's (one ``.pth`` line, see above)."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (purelib,) = (venv / "lib").glob("python3*/site-packages")
    (purelib / "the-suites-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)], check=True, timeout=120)
    return venv


def outside_env() -> dict[str, str]:
    """The environment without this checkout on the path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_the_wheel_holds_every_module_and_every_file_the_code_loads(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {rel.removeprefix("web/").join(("tokenfan_web/", "")) if rel.startswith("web/") else rel
            for rel in tracked() if rel.startswith(BUILD_INPUTS[4:])}
    assert want - names == set(), sorted(want - names)  # e.g. gateway/http3/*.py, web/js/*.js, the assets
    assert {f"{r}/py.typed" for r in ROOTS} <= names
    assert f"tokenfan-{__version__}.dist-info/METADATA" in names


def test_the_installed_wheel_alone_is_imported_and_names_its_version(venv: Path, tmp_path: Path) -> None:
    probe = ("import importlib, importlib.metadata, json, sys; "
             f"files = {{m: importlib.import_module(m).__file__ or list(importlib.import_module(m).__path__)[0] "
             f"for m in {MODULES!r}}}; "
             "print(json.dumps({'files': files, 'version': importlib.metadata.version('tokenfan'), "
             "'finders': [type(f).__module__ for f in sys.meta_path]}))")
    out = json.loads(subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=outside_env(),
                                    capture_output=True, text=True, check=True).stdout)
    assert all(str(f).startswith(str(venv)) for f in out["files"].values()), out["files"]
    assert not [f for f in out["finders"] if "editable" in f], out["finders"]
    assert out["version"] == __version__
    version = subprocess.run([str(venv / "bin" / "tokenfan"), "--version"], cwd=tmp_path, env=outside_env(),
                             capture_output=True, text=True, check=True).stdout
    assert version.startswith(f"tokenfan {__version__} (protocol tokenfan/")  # no checkout: no commit


@pytest.fixture
def installed_gateway(venv: Path, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """``tokenfan serve`` of the venv, run from ``tmp_path``: (URL, HTTP/3 UDP port)."""
    tokenfan = str(venv / "bin" / "tokenfan")
    env = outside_env()
    subprocess.run([tokenfan, "certs", "--days", "13", str(tmp_path / "certs")], cwd=tmp_path, env=env,
                   check=True, capture_output=True)
    port, udp = free_port(), free_udp_port()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - the server's stdout while it runs
    proc = Proc(subprocess.Popen([tokenfan, "serve", "--engine", "synthetic", "--host", "127.0.0.1", "--port",
                                  str(port), "--http3-port", str(udp), "--http3-certfile",
                                  str(tmp_path / "certs" / "cert.pem"), "--http3-keyfile",
                                  str(tmp_path / "certs" / "key.pem"), "--log-level", "warning"],
                                 cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 60)
        yield url, udp
    finally:
        proc.stop()
        log.close()


def chat_text(datas: list[str]) -> str:
    """The content of a chat completion's ``data:`` payloads (the last one ``[DONE]``)."""
    assert datas[-1] == "[DONE]", datas[-3:]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, datas[:-1])
                   if c.get("choices"))


async def http3_chat(port: int) -> tuple[int | None, list[bytes]]:
    origin = QuicOrigin("127.0.0.1", port, None)
    try:
        client = await origin.client()
        _, resp = client.request("POST", origin.authority, "/v1/chat/completions",
                                 {"content-type": "application/json"}, orjson.dumps(CHAT))
        await resp.done
        return resp.status, [ev.data for ev in SseDecoder().feed(b"".join(resp.chunks))]
    finally:
        await origin.close()


def test_the_installed_wheel_serves_the_pages_and_every_transport(installed_gateway: tuple[str, int]) -> None:
    url, udp = installed_gateway
    health = httpx.get(url + "/health").json()
    assert health["version"] == __version__ and health["engines"][0]["version"] == __version__
    for path, marker in (("/", "<html"), ("/ab", "<html"), ("/web/js/api.js", ""), ("/web/js/webtransport.js", "")):
        r = httpx.get(url + path)
        assert r.status_code == 200 and marker in r.text.lower(), (path, r.status_code)

    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30)  # POST SSE
    assert r.status_code == 200 and chat_text([e["data"] for e in sse_events(r.text)])

    with connect(url.replace("http", "ws") + "/v1/ws", open_timeout=10) as ws:  # /v1/ws
        ws.send(json.dumps({"type": "request", "id": "a", "endpoint": "chat.completions", "body": CHAT}))
        messages = []
        while not messages or messages[-1]["type"] not in ("done", "error"):
            messages.append(json.loads(ws.recv(timeout=30)))
    assert messages[-1] == {"type": "done", "id": "a"} and len(messages) > 1, messages[-2:]

    r = httpx.post(url + "/v1/streams", json={"endpoint": "chat.completions", **CHAT})  # fan-out SSE
    assert r.status_code == 201, r.text
    with httpx.stream("GET", f"{url}/v1/streams/{r.json()['id']}/events", timeout=30) as events:
        body = "".join(events.iter_text())
    assert chat_text([e["data"] for e in sse_events(body) if e["event"] == "message"])

    status, datas = asyncio.run(http3_chat(udp))  # HTTP/3 (--http3-port), aioquic
    assert status == 200 and chat_text([d.decode() for d in datas])
