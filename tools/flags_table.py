"""Regenerate the README's configuration table from the CLI parsers: `python tools/flags_table.py`."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from engine_worker.config import add_engine_arguments
from gateway.config import add_gateway_arguments

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- flags:start -->", "<!-- flags:end -->"


def table() -> str:
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    add_engine_arguments(parser)
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for a in parser._actions:
        if not a.option_strings or a.dest == "help":
            continue
        flag = "--engine" if "--engine" in a.option_strings else a.option_strings[0]
        help_ = a.help or ""
        env = re.search(r"\[(TOKENFAN_\w+)\]", help_)
        text = re.sub(r"\s*\[TOKENFAN_\w+\]", "", help_).replace("|", "\\|")
        default = "" if a.default in (None, [], "") else str(a.default).replace(str(Path.home()), "~")
        rows.append(f"| `{flag}` | `{env.group(1) if env else ''}` | {f'`{default}`' if default else ''} | {text} |")
    return "\n".join(rows)


def main() -> None:
    text = README.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    README.write_text(f"{head}{START}\n{table()}\n{END}{tail}")


if __name__ == "__main__":
    main()
