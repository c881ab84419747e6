"""deploy/image.sh's image stores: one per checkout, pruned before a build so clones do not fill the disk.

Runs the script's own ``prune`` (what a build does first) on stores made of plain directories: pruning
reads only their marker files and times, so no buildah and no image are needed.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

IMAGE_SH = Path(__file__).resolve().parents[1] / "deploy" / "image.sh"
HOUR = 3600.0


def _image_sh(stores: Path, *args: str, need_gib: int, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFAN_IMAGE_")}
    environ |= {"TOKENFAN_IMAGE_STORES": str(stores), "TOKENFAN_IMAGE_NEED_GIB": str(need_gib), **env}
    return subprocess.run(["bash", str(IMAGE_SH), *args], env=environ, capture_output=True, text=True,
                          timeout=60, check=True)


def _store(stores: Path, name: str, checkout: Path | None, age_s: float) -> Path:
    """A store directory as image.sh leaves it: its checkout and last use (a store without a checkout
    file is one made before stores recorded them: its directory's time counts)."""
    path = stores / name
    (path / "storage-overlay").mkdir(parents=True)
    (path / "driver").write_text("overlay\n")
    when = time.time() - age_s
    if checkout is not None:
        (path / "checkout").write_text(f"{checkout}\n")
        (path / "used").touch()
        os.utime(path / "used", (when, when))
    os.utime(path, (when, when))
    return path


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    stores = tmp_path / "stores"
    alive = tmp_path / "clone-alive"
    (alive / "deploy").mkdir(parents=True)
    (alive / "deploy" / "image.sh").touch()
    own = Path(_image_sh(stores, "store", need_gib=0).stdout.strip())
    return {
        "stores": stores,
        "own": _store(stores, own.name, IMAGE_SH.parents[1], 5 * HOUR),
        "gone": _store(stores, "clone-gone-1234abcd", tmp_path / "clone-gone", 0),
        "alive_old": _store(stores, "clone-alive-aaaa1111", alive, 2 * HOUR),
        "alive_recent": _store(stores, "clone-alive-bbbb2222", alive, 600),
        "legacy_old": _store(stores, "ci-run-cccc3333", None, 3 * HOUR),
        "not_a_store": (stores / "notes").resolve(),
    }


def test_a_gone_checkouts_store_is_removed_and_the_others_stay_while_the_disk_has_room(
        layout: dict[str, Path]) -> None:
    layout["not_a_store"].mkdir()
    out = _image_sh(layout["stores"], "prune", need_gib=0)
    assert not layout["gone"].exists()
    assert "that checkout is gone" in out.stderr
    for kept in ("own", "alive_old", "alive_recent", "legacy_old", "not_a_store"):
        assert layout[kept].is_dir(), kept


def test_short_of_space_the_stores_unused_for_an_hour_go_oldest_first_never_its_own(
        layout: dict[str, Path]) -> None:
    layout["not_a_store"].mkdir()
    out = _image_sh(layout["stores"], "prune", need_gib=1 << 20)  # never enough: every candidate goes
    assert not layout["gone"].exists()
    assert not layout["legacy_old"].exists() and not layout["alive_old"].exists()
    assert out.stderr.index("ci-run-cccc3333") < out.stderr.index("clone-alive-aaaa1111")  # least recent first
    for kept in ("own", "alive_recent", "not_a_store"):  # its own; used in the last hour; not a store
        assert layout[kept].is_dir(), kept


def test_an_explicit_store_never_prunes_its_siblings(layout: dict[str, Path], tmp_path: Path) -> None:
    _image_sh(layout["stores"], "prune", need_gib=1 << 20, TOKENFAN_IMAGE_STORE=str(tmp_path / "mine"))
    for kept in ("gone", "alive_old", "legacy_old"):
        assert layout[kept].is_dir(), kept
