"""The README stays true: every CLI flag and its environment variable is documented."""

from __future__ import annotations

import argparse
import re

from engine_worker.config import add_engine_arguments
from gateway.config import add_gateway_arguments
from tests.procs import ROOT


def test_every_flag_and_env_var_is_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    add_engine_arguments(parser)
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert any(f"`{flag}`" in readme for flag in action.option_strings), action.option_strings
        env = re.search(r"\[(TOKENFAN_\w+)\]", action.help or "")
        assert env and env.group(1) in readme, action.option_strings
