"""The synthetic engine's script file: what loads, and the start-up error a malformed one gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_worker.backends.scripted import load_script


def _write(tmp_path: Path, value: object) -> Path:
    path = tmp_path / "script.json"
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return path


def test_a_script_loads_in_order(tmp_path: Path) -> None:
    entries = load_script(_write(tmp_path, [{"match": "a+b", "reply": ["x", "y"]}, {"match": "", "reply": ["z"]}]))
    assert [(e.match.pattern, e.reply) for e in entries] == [("a+b", ("x", "y")), ("", ("z",))]


@pytest.mark.parametrize(("value", "words"), [
    ("{not json", "Expecting"),
    ({"match": "a", "reply": ["x"]}, "a JSON list"),
    ([{"match": "a"}], "entry 0 needs"),
    ([{"match": "a", "reply": []}], "entry 0 needs"),
    ([{"match": "a", "reply": ["x", 3]}], "entry 0 needs"),
    ([{"match": "(", "reply": ["x"]}], "entry 0: bad regex"),
])
def test_a_malformed_script_is_refused_with_the_reason(tmp_path: Path, value: object, words: str) -> None:
    with pytest.raises((ValueError, TypeError), match=words):
        load_script(_write(tmp_path, value))


def test_a_missing_script_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--synthetic-script .*nope.json"):
        load_script(tmp_path / "nope.json")


def test_the_synthetic_engines_table_of_vllm_fields_is_vllms() -> None:
    """The synthetic engine refuses by this table (no vLLM import on its request path): it must be vLLM's."""
    from engine_worker.backends import vllm_fields

    assert vllm_fields.DEFAULTS == vllm_fields.from_vllm(), "regenerate: see engine_worker/backends/vllm_fields.py"
