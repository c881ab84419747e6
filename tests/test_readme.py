"""The README stays true: every CLI flag and its environment variable is documented."""

from __future__ import annotations

import argparse
import re

from engine_worker.settings import COMMANDS, add_arguments
from tests.procs import ROOT


def test_every_flag_and_env_var_is_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    actions = []
    for command in COMMANDS:
        parser = argparse.ArgumentParser()
        add_arguments(parser, command)
        actions += [a for a in parser._actions if a.help != argparse.SUPPRESS]  # deprecated aliases
    for action in actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert any(f"`{flag}`" in readme for flag in action.option_strings), action.option_strings
        env = re.search(r"\[(TOKENFAN_\w+)\]", action.help or "")
        assert env and env.group(1) in readme, action.option_strings
