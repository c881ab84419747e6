"""gateway/http/uvicorn_shim.py: its checks pass on the installed uvicorn, and on another version or a class that
lacks a member it uses the port is off, said in an error log line (the gateway then serves every exchange by
plain ASGI: tests/e2e/test_detached.py runs such a gateway)."""

from __future__ import annotations

import logging
import re
import tomllib

import pytest
import uvicorn
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from gateway.http import uvicorn_shim
from tests.procs import ROOT


def test_the_installed_uvicorn_is_one_the_shim_was_written_for_and_has_its_shape() -> None:
    assert uvicorn_shim.connection_problems() == [] and uvicorn_shim.server_problems() == []
    assert isinstance(uvicorn_shim.server_port(), uvicorn_shim.UvicornPort)


def test_pyproject_allows_the_series_the_shim_was_written_for_and_not_the_next_minor() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = SpecifierSet(next(d.removeprefix("uvicorn") for d in deps if re.match(r"uvicorn\b[<>=!~]", d)))
    assert Version(uvicorn.__version__) in spec
    newest = max(Version(s) for s in uvicorn_shim.WRITTEN_FOR)
    assert all(Version(s) in spec for s in uvicorn_shim.WRITTEN_FOR)
    assert Version(f"{newest.major}.{newest.minor + 1}.0") not in spec


def test_instance_attributes_are_read_from_the_assignments_of_every_method() -> None:
    members = uvicorn_shim.members(RequestResponseCycle)
    assert {"flow", "transport", "response_complete", "chunked_encoding", "send"} <= members  # __init__, send()
    assert "no_such_thing" not in members


def test_another_uvicorn_version_turns_the_port_off_with_an_error_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="tokenfan.server"):
        assert uvicorn_shim.server_port("0.99.0") is None
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "uvicorn 0.99.0 is not a version this shim was written for" in record.getMessage()
    assert "--detach-subscribers false" in record.getMessage()


def test_a_missing_member_turns_the_port_off_with_an_error_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delattr(WebSocketsSansIOProtocol, "stop_keepalive")
    with caplog.at_level(logging.ERROR, logger="tokenfan.server"):
        assert uvicorn_shim.server_port() is None
    assert "WebSocketsSansIOProtocol has no stop_keepalive" in caplog.text


def test_an_instance_attribute_the_shim_needs_and_no_method_assigns_is_a_problem(
        monkeypatch: pytest.MonkeyPatch) -> None:
    shape = dict(uvicorn_shim.SHAPE)
    path = "uvicorn.protocols.http.httptools_impl:RequestResponseCycle"
    monkeypatch.setitem(uvicorn_shim.SHAPE, path, (*shape[path], "flow_control"))
    assert uvicorn_shim.connection_problems() == [f"{path} has no flow_control"]
    monkeypatch.setitem(uvicorn_shim.SHAPE, "uvicorn.protocols.http.gone_impl:Cycle", ("send",))
    assert "uvicorn.protocols.http.gone_impl:Cycle is not there" in uvicorn_shim.connection_problems()


def test_the_server_overrides_are_checked_and_a_missing_one_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    assert uvicorn_shim.server_problems() == []
    monkeypatch.setitem(uvicorn_shim.SERVER_SHAPE, "uvicorn.server:Server", ("capture_signals", "no_such_hook"))
    uvicorn_shim._checked_server.cache_clear()
    try:
        with pytest.raises(SystemExit, match="uvicorn.server:Server has no no_such_hook"):
            uvicorn_shim.graceful_server(uvicorn.Config(app=None), signals=(), drain=None)  # type: ignore[arg-type]
    finally:
        uvicorn_shim._checked_server.cache_clear()
