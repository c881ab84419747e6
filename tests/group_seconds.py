"""Rewrite ``tests/group_seconds.json`` from a ``TOKENFAN_TEST_CPU`` log of a two-worker run.

``python -m tests.group_seconds LOG``: each scheduling group's wall time, the sum of its tests' (the xdist
scheduler in ``tests/conftest.py`` gives the longest groups out first). A group the log does not name keeps
its old figure, so a log of part of the suite updates only that part.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from tests.conftest import GROUP_SECONDS, group_seconds


def main(log: Path) -> None:
    seconds: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        row = json.loads(line)
        seconds[row["group"]] += row["wall_s"]
    merged = {**group_seconds(), **seconds}
    ordered = dict(sorted(((k, round(v, 1)) for k, v in merged.items()), key=lambda kv: (-kv[1], kv[0])))
    GROUP_SECONDS.write_text(json.dumps(ordered, indent=1) + "\n")
    print(f"{len(seconds)} groups from {log}, {len(ordered)} in {GROUP_SECONDS}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
