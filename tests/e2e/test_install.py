"""A plain (non-editable) ``pip install .`` in a fresh venv serves the pages from any directory.

This is the new-user path without the Makefile: a wheel is built from the checkout and installed with
its core dependencies only (no engine extras; the synthetic engine ships in the package), then
``tokenfan serve`` runs from an unrelated working directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.procs import ROOT
from tokenfan_bench.servers.processes import Proc, free_port, wait_healthy


@pytest.mark.timeout(600)
def test_a_non_editable_install_serves_the_pages_from_any_directory(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, str(ROOT)], check=True, cwd=tmp_path, timeout=540)
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - the server's stdout while it runs
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = Proc(subprocess.Popen([str(venv / "bin" / "tokenfan"), "serve", "--engine", "synthetic", "--host",
                                  "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                                 cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 60)
        for path, marker in (("/", "<html"), ("/ab", "<html"), ("/web/js/api.js", "")):
            r = httpx.get(url + path)
            assert r.status_code == 200, (path, r.status_code)
            assert marker in r.text.lower()
        # The installed package is what served them, not the checkout.
        out = subprocess.run([str(venv / "bin" / "python"), "-c", "import gateway; print(gateway.__file__)"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
        assert str(venv) in out
    finally:
        proc.stop()
