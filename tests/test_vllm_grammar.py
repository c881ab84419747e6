"""The vLLM grammar shim patches vLLM's private structured-output code only on the vLLM it was written for."""

from __future__ import annotations

import logging

import pytest

from engine_worker.backends import vllm_grammar


def test_the_pinned_vllm_is_one_the_shim_was_written_for() -> None:
    assert vllm_grammar.check_version() == vllm_grammar.vllm_version()


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.0.0", "0.320.1"])
def test_another_vllm_is_refused_with_what_to_do(version: str) -> None:
    with pytest.raises(vllm_grammar.UnsupportedVllm, match=rf"written for vLLM 0\.32\.x; this is vLLM {version}"):
        vllm_grammar.check_version(version)


def test_install_patches_the_pinned_vllm_once() -> None:
    from vllm.v1.structured_output import StructuredOutputManager

    assert vllm_grammar.install()
    patched = StructuredOutputManager._create_grammar
    assert getattr(patched, vllm_grammar.MARK)
    assert vllm_grammar.install() and StructuredOutputManager._create_grammar is patched


def test_install_patches_nothing_on_another_vllm(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    from vllm.v1.structured_output import StructuredOutputManager

    before = StructuredOutputManager._create_grammar
    monkeypatch.setattr(vllm_grammar, "vllm_version", lambda: "0.33.0")
    with caplog.at_level(logging.ERROR, logger=vllm_grammar.__name__):
        assert not vllm_grammar.install()
    assert StructuredOutputManager._create_grammar is before
    assert "this is vLLM 0.33.0" in caplog.text


def test_install_patches_nothing_when_the_private_method_changed_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.structured_output import StructuredOutputManager

    monkeypatch.setattr(StructuredOutputManager, "_create_grammar", lambda self, request, extra: None)
    changed = StructuredOutputManager._create_grammar
    assert not vllm_grammar.install()
    assert StructuredOutputManager._create_grammar is changed
