"""Fixtures of the end-to-end modules (the session's engines and gateways are in ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, sync_playwright

from tests.e2e.browser_fixtures import CHROMIUM, CHROMIUM_ARGS
from tests.system import require


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium (Debian's, :data:`~tests.e2e.browser_fixtures.CHROMIUM`), one per module that uses it."""
    require(CHROMIUM)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()
