"""Programs the suite takes from the system rather than from pip: Debian's ``chromium``, ``redis-server`` and
``nginx``, which ``make test`` installs (``make test-deps``). A test that needs a missing one fails and says
how to install it; it never skips, since a skip would let a lost package hide every scenario that uses it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def require(program: str | Path) -> str:
    """The path of ``program`` (an absolute path, or a name looked up on PATH); fails the test if missing."""
    path = Path(program)
    found = str(path) if path.is_absolute() and path.exists() else None
    if found is None and not path.is_absolute():
        found = shutil.which(str(program))
    if found is None:
        pytest.fail(f"{program} is missing: run `make test-deps` (Debian's chromium, redis-server and nginx)",
                    pytrace=False)
    return found
