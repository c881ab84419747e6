"""docs/reference.md is generated from the code (tools/reference.py) and stays so: a route, an error code or a
metric added without its row fails here, and so does a row whose route or code is gone."""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType

import httpx
import pytest

from tests.procs import ROOT


def load_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reference", ROOT / "tools" / "reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = load_reference()
PAGE = ROOT / reference.PAGE


def test_the_reference_page_is_what_the_code_generates() -> None:
    text = PAGE.read_text()
    assert text == reference.replace_blocks(text, reference.generated()), \
        f"stale tables: run `python tools/reference.py --write {reference.PAGE}`"


def test_a_route_without_its_row_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = dict(reference.ROUTES)
    del rows["GET /ab"]
    monkeypatch.setattr(reference, "ROUTES", rows)
    with pytest.raises(LookupError, match="no row for .'GET /ab'"):
        reference.routes_md()


def test_an_error_code_without_its_row_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    source = 'def f():\n    raise APIError(418, "teapot", code="i_am_a_teapot")\n'
    assert reference._code_sites(reference.ast.parse(source)) == {"i_am_a_teapot": {418}}
    codes = reference.error_codes()
    monkeypatch.setattr(reference, "error_codes", lambda: {**codes, "i_am_a_teapot": {418}})
    with pytest.raises(LookupError, match="i_am_a_teapot"):
        reference.errors_md()
    monkeypatch.setattr(reference, "error_codes", lambda: {**codes, "stream_expired": {404}})
    with pytest.raises(LookupError, match="status of .'stream_expired'"):
        reference.errors_md()


def test_every_code_the_limits_count_and_the_engine_sends_is_found() -> None:
    from gateway.core.metrics import REFUSAL_REASONS
    from gateway.errors import ENGINE_CODES

    codes = reference.error_codes()
    assert set(REFUSAL_REASONS) | set(ENGINE_CODES) <= set(codes)
    for code in ("model_not_found", "stream_expired", "invalid_api_key", "origin_not_allowed", "prompt_too_long"):
        assert code in codes and f"`{code}`" in PAGE.read_text()


def test_every_metric_a_running_gateway_exposes_has_its_row(gateway_url: str) -> None:
    text = httpx.get(gateway_url + "/metrics", timeout=10).text
    live = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    documented = set(re.findall(r"^\| `([a-z_]+)` \| (?:counter|gauge|histogram)", PAGE.read_text(), re.MULTILINE))
    missing = {m for m in live if not m.endswith("_created") and m not in documented}
    assert live and not missing, sorted(missing)


def test_every_page_route_and_api_route_is_listed_with_its_method() -> None:
    text = PAGE.read_text()
    for method, path in reference.app_routes():
        assert f"| {method} | `{path}` |" in text
    assert "| GET | `/ab` |" in text and "| GET | `/` |" in text
