"""The shipped Prometheus rules (deploy/prometheus/tokenfan-rules.yml) with Debian's ``promtool``: they load
(``check rules``), and each alert fires on the series that should fire it, only after its ``for:``, and stays quiet
on a healthy gateway's (``test rules`` of tests/prometheus/tokenfan-rules.test.yml). A real Prometheus loads them
and scrapes live gateways in tests/e2e/test_prometheus.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.system import require

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "tokenfan-rules.yml"
UNIT = ROOT / "tests" / "prometheus" / "tokenfan-rules.test.yml"
# what docs/observability.md and the issue ask an operator to be told about
ALERTS = {"TokenfanNoEngineReady", "TokenfanEngineDown", "TokenfanMigrationsFailing", "TokenfanMigrationsRefused",
          "TokenfanRefusalsRising", "TokenfanSlowReadersCut", "TokenfanBrokerUnreachable", "TokenfanGatewayDown"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=UNIT.parent,
                          check=False)


def test_promtool_checks_the_shipped_rules() -> None:
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_every_alert_fires_when_it_should_and_not_before_its_for() -> None:
    r = promtool("test", "rules", UNIT.name)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_rules_name_every_alert_the_docs_describe_and_each_has_a_severity_and_a_summary() -> None:
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    alerts = {rule["alert"]: rule for rule in rules if "alert" in rule}
    assert set(alerts) == ALERTS
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    docs = (ROOT / "docs" / "observability.md").read_text()
    assert all(f"`{name}`" in docs for name in ALERTS)
