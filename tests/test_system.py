"""A program the suite installs (``make test-deps``) that is missing fails its tests instead of skipping them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.procs import ROOT
from tests.system import require

# The only skips left: programs the suite does not install (no kustomize/kubectl, no Docker here).
ALLOWED_SKIPS = {
    "tests/test_deploy.py": 2,
    # not root, or no image builder (both there in CI, where `make test` builds the image first); the default
    # model in the image, opt-in (TOKENFAN_IMAGE_TEST_MODEL=1: minutes and ~3 GB)
    "tests/e2e/test_image.py": 2,
    # the documentation blocks that cannot run here (a GPU, Kubernetes, minutes of a benchmark), each a skip with
    # its reason and their number pinned by tests/e2e/test_docs_examples.py: not a dependency the suite installs
    "tests/e2e/test_docs_examples.py": 1,
}
SKIP = re.compile(r"pytest\.skip\(|\.skipif\(|importorskip\(|mark\.skip\b")


def test_a_missing_program_fails_the_test_and_says_how_to_install_it() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"tokenfan-no-such-program is missing: run `make test-deps`"):
        require("tokenfan-no-such-program")
    with pytest.raises(pytest.fail.Exception, match="make test-deps"):
        require(Path("/nonexistent/sbin/nginx"))


def test_a_present_program_is_found_by_name_or_path() -> None:
    sh = require("sh")
    assert Path(sh).is_absolute()
    assert require(Path(sh)) == sh


def test_no_test_skips_on_a_dependency_the_suite_installs() -> None:
    found = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        n = len(SKIP.findall(path.read_text()))
        if n and rel != "tests/test_system.py":
            found[rel] = n
    assert found == ALLOWED_SKIPS, "use tests.system.require() for a program `make test-deps` installs, " \
                                   "and a plain import for a package the test extra installs"
