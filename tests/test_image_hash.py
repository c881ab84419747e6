"""deploy/image.sh's source hash (the image's ``tokenfan.source-hash`` label, which decides whether ``make image``
builds again) covers exactly what the Dockerfile copies: the sources of its COPY lines, read from the Dockerfile."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.procs import ROOT

VARIANTS = ("cpu", "gpu")


def _image_sh(root: Path, *args: str) -> str:
    return subprocess.run(["bash", str(root / "deploy" / "image.sh"), *args], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def _copy_lines(dockerfile: Path) -> list[list[str]]:
    """Each COPY line's sources (all but its last argument), COPY --from= aside."""
    return [line.split()[1:-1] for line in dockerfile.read_text().splitlines() if line.startswith("COPY ")
            and "--from=" not in line]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what the hash reads: deploy/ and the folders and files the Dockerfiles copy, plus tests/."""
    root = tmp_path_factory.mktemp("checkout")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "node_modules")
    for name in ("deploy", "tests", *_image_sh(ROOT, "sources", "cpu").split()):
        src = ROOT / name
        (shutil.copytree(src, root / name, ignore=ignore) if src.is_dir() else shutil.copy2(src, root / name))
    return root


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_hash_reads_what_the_dockerfile_copies(variant: str) -> None:
    dockerfile = ROOT / "deploy" / "docker" / f"Dockerfile.{variant}"
    copied = [src for line in _copy_lines(dockerfile) for src in line]
    assert _image_sh(ROOT, "sources", variant).split() == copied
    assert "tokenfan_settings" in copied


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_dockerignore_lets_through_exactly_what_is_copied(variant: str) -> None:
    """BuildKit needs the .dockerignore's list; it must name what the COPY lines take, no more, no less."""
    ignore = (ROOT / "deploy" / "docker" / f"Dockerfile.{variant}.dockerignore").read_text().splitlines()
    allowed = [line[1:] for line in ignore if line.startswith("!")]
    assert sorted(allowed) == sorted(_image_sh(ROOT, "sources", variant).split())


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_settings_change_changes_the_hash_and_a_test_change_does_not(tree: Path, variant: str) -> None:
    before = _image_sh(tree, "hash", variant)
    assert before == _image_sh(ROOT, "hash", variant)  # the copy hashes as the checkout does
    settings = tree / "tokenfan_settings" / "__init__.py"
    original = settings.read_text()
    try:
        settings.write_text(original + "\n# a settings-only change\n")
        assert _image_sh(tree, "hash", variant) != before
    finally:
        settings.write_text(original)
    assert _image_sh(tree, "hash", variant) == before
    (tree / "tests" / "not_in_the_image.py").write_text("x = 1\n")
    (tree / "gateway" / "__pycache__").mkdir(exist_ok=True)
    (tree / "gateway" / "__pycache__" / "junk.pyc").write_bytes(b"\0")
    assert _image_sh(tree, "hash", variant) == before


def test_a_copy_json_form_is_refused_not_misread(tree: Path) -> None:
    dockerfile = tree / "deploy" / "docker" / "Dockerfile.cpu"
    original = dockerfile.read_text()
    try:
        dockerfile.write_text(original + '\nCOPY ["extra", "./extra"]\n')
        proc = subprocess.run(["bash", str(tree / "deploy" / "image.sh"), "hash", "cpu"], capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode != 0 and "unsupported COPY" in proc.stderr, proc.stderr
    finally:
        dockerfile.write_text(original)


def test_make_image_says_where_the_image_is(tmp_path: Path) -> None:
    """An up-to-date image (a stand-in ``buildah`` answers the current hash for its label): ``deploy/image.sh
    build`` names this checkout's store, which a bare ``buildah images`` does not list, and how to list and
    export the image."""
    fake = tmp_path / "bin" / "buildah"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho {_image_sh(ROOT, 'hash', 'cpu')}\n")
    fake.chmod(0o755)
    store = tmp_path / "store"
    proc = subprocess.run(["bash", str(ROOT / "deploy" / "image.sh"), "build", "cpu"], capture_output=True, text=True,
                          timeout=60, check=True, env={"PATH": f"{fake.parent}:/usr/bin:/bin", "TOKENFAN_IMAGE_TOOL":
                                                       "buildah", "TOKENFAN_IMAGE_STORE": str(store),
                                                       "TOKENFAN_IMAGE_DRIVER": "vfs"})
    assert "tokenfan:cpu is up to date" in proc.stderr, proc.stderr
    assert f"localhost/tokenfan:cpu is in this checkout's buildah store, {store}" in proc.stderr
    assert "buildah $(deploy/image.sh buildah-args) images" in proc.stderr
    assert "push localhost/tokenfan:cpu oci-archive:tokenfan-cpu.tar" in proc.stderr
