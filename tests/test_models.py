"""Model preparation: the tiny test model and model-directory resolution (no vLLM engine here)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import transformers

from engine_worker.config import EngineConfig
from engine_worker.models import MARKER, TINY_VOCAB_SIZE, ModelError, build_tiny_llama, resolve_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_llama_loads_with_transformers(tiny: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(tiny)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    assert config.model_type == "llama"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 2, 4)
    assert config.vocab_size == len(tokenizer) == TINY_VOCAB_SIZE
    assert config.torch_dtype == "float32" or str(config.dtype).endswith("float32")
    assert tokenizer.decode(tokenizer.encode("Hello world", add_special_tokens=False)) == "Hello world"
    assert (tiny / MARKER).is_file()


def test_tiny_llama_chat_template_renders_a_generation_prompt(tiny: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        add_generation_prompt=True, tokenize=False,
    )
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_tiny_llama_is_deterministic_per_seed_and_idempotent(tiny: Path, tmp_path: Path) -> None:
    again = build_tiny_llama(tmp_path / "again")
    assert _digest(again) == _digest(tiny)
    assert (again / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    assert _digest(build_tiny_llama(tmp_path / "other", seed=1)) != _digest(tiny)
    marker = (again / MARKER).read_text()
    assert build_tiny_llama(again) == again.resolve()
    assert (again / MARKER).read_text() == marker  # not rebuilt


def test_tiny_llama_rebuilds_a_half_finished_directory(tmp_path: Path) -> None:
    broken = tmp_path / "tiny"
    broken.mkdir()
    (broken / "config.json").write_text("{")  # an interrupted build: no completion marker
    build_tiny_llama(broken)
    assert json.loads((broken / "config.json").read_text())["model_type"] == "llama"
    assert not list(tmp_path.glob(".tiny.tmp-*"))


def test_resolve_model_returns_a_given_model_directory(tiny: Path) -> None:
    assert resolve_model(EngineConfig(model=str(tiny))) == tiny.resolve()


def test_resolve_model_rejects_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="is not a directory"):
        resolve_model(EngineConfig(model=str(tmp_path / "nope")))


def test_resolve_model_rejects_a_directory_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(EngineConfig(model=str(tmp_path)))


def test_resolve_model_does_not_download_hub_ids() -> None:
    with pytest.raises(ModelError, match="hub ids are not downloaded"):
        resolve_model(EngineConfig(model="google/gemma-3-270m"))
