"""The report's packet-loss section end to end: namespaces, the packet wire, iptables drops, two gateways
with HTTP/3, every arm on the same streams (needs root, as the suite runs, and `make test-deps`'s iptables)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.system import require
from tokenfan_bench.network.lossy import available

pytestmark = pytest.mark.timeout(300)


def test_loss_section_runs_every_arm_under_kernel_drops_and_reports_what_was_lost(tmp_path: Path) -> None:
    from tokenfan_bench.report.matrix import main as report_main

    require("iptables")
    assert available() is None, available()
    out = tmp_path / "report.md"
    out.write_text("# report\n\nearlier sections\n")
    require("/usr/bin/chromium")
    assert report_main(["--loss-only", "--loss", "5%", "--loss-streams", "3", "--min-streams", "3",
                        "--browser-streams", "4", "--max-tokens", "16", "--bootstrap", "100", "--out", str(out),
                        "--data", str(tmp_path)]) == 0
    level = json.loads((tmp_path / "results-loss.json").read_text())["loss"]["levels"]["5%"]
    rows = level["run"]["loss_rows"]
    assert [r["transport"] for r in rows.values()] == ["sse", "sse", "sse-h2", "ws", "sse-h3", "wt"]
    # every arm joined its streams before their first token (JOIN_MS), so each has live tokens to time
    assert all(r["errors"] == 0 and r["late"] == 0 for r in rows.values()), rows
    assert all(r["p50"]["value"] > 25 for r in rows.values())  # 60 ms RTT: ≥ 30 ms one way
    browser = level["browser"]["loss_rows"]  # Chromium in the client namespace, WebTransport among its APIs
    assert [r["transport"] for r in browser.values()] == ["browser-es", "browser-es", "browser-ws", "browser-wt"]
    assert all(r["errors"] == 0 and r["subscribers"] >= 3 for r in browser.values()), browser
    m = level["measured"]
    assert m["protocols"]["tcp"]["dropped"] > 0 and m["protocols"]["udp"]["dropped"] > 0
    assert 0.01 < m["protocols"]["tcp"]["loss"] < 0.15 and 0.01 < m["protocols"]["udp"]["loss"] < 0.15
    assert m["tcp"]["gateway"]["Tcp.RetransSegs"] > 0  # the kernel repaired what iptables dropped
    text = out.read_text()
    assert text.startswith("# report\n\nearlier sections\n") and "| 5% |" in text and "<!-- loss:end -->" in text
    assert "This section: `tokenfan bench report --loss-only --loss 5%" in text  # dated apart from the report's
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"tfc{os.getpid()}" not in names and f"tfg{os.getpid()}" not in names  # the namespaces are gone
