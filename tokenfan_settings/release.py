"""What this build is: its release version and, run from a git checkout, its commit.

:data:`__version__` is the one place the version is written: pyproject.toml reads it (``dynamic``), and
``tokenfan --version``, ``/health`` and the ``tokenfan_build_info`` metric report it. The newest version
section of CHANGELOG.md names the same version (tests/test_docs_release.py). The wire protocol an engine and
a gateway must share is another number (:data:`engine_worker.protocol.PROTOCOL_VERSION`).
"""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

__version__ = "0.2.0"


@functools.cache
def commit() -> str | None:
    """The short git commit of the checkout this code runs from, or None (an installed wheel, no git)."""
    root = Path(__file__).resolve().parents[1]
    if not ((root / ".git").exists() and (root / "pyproject.toml").is_file()):
        return None  # not a checkout of tokenfan (a wheel installed inside some other repository stays None)
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def python() -> str:
    """The interpreter's version, as ``tokenfan_build_info`` labels it."""
    return platform.python_version()


def describe(protocol: str) -> str:
    """One line for ``tokenfan --version``: ``tokenfan 0.2.0 (commit abc123, protocol tokenfan/4, python 3.11.7)``."""
    parts = ([f"commit {c}"] if (c := commit()) else []) + [f"protocol {protocol}", f"python {python()}"]
    return f"tokenfan {__version__} ({', '.join(parts)})"
