"""The plain path takes the model's generation-config sampling defaults as vllm serve does (pure)."""

from __future__ import annotations

from engine_worker import protocol as p
from engine_worker.backends.vllm import generation_defaults

QWEN_LIKE = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def test_fields_the_body_leaves_unset_take_the_models_defaults() -> None:
    sampling = p.Sampling(max_tokens=8)  # what the gateway sends when the body sets none of them
    out, extra = generation_defaults(sampling, {"messages": [], "max_tokens": 8}, QWEN_LIKE)
    assert (out.temperature, out.top_p, out.top_k, out.max_tokens) == (0.7, 0.8, 20, 8)
    assert extra == {"repetition_penalty": 1.05}


def test_fields_the_body_sets_win_even_when_they_equal_vllms_neutral_values() -> None:
    sampling = p.Sampling(max_tokens=8, temperature=1.0, top_p=1.0, top_k=-1)
    body = {"prompt": "x", "temperature": 1.0, "top_p": 1.0, "top_k": -1, "presence_penalty": None}
    out, extra = generation_defaults(sampling, body, {**QWEN_LIKE, "presence_penalty": 1.5})
    assert (out.temperature, out.top_p, out.top_k, out.presence_penalty) == (1.0, 1.0, -1, 1.5)  # null: unset
    assert extra == {"repetition_penalty": 1.05}


def test_no_defaults_or_no_body_leave_sampling_alone() -> None:
    sampling = p.Sampling(max_tokens=3, temperature=0.0)
    assert generation_defaults(sampling, {"prompt": "x"}, {}) == (sampling, {})
    assert generation_defaults(sampling, None, QWEN_LIKE) == (sampling, {})
    assert generation_defaults(sampling, {"prompt": "x"}, {"top_k": 0})[0].top_k == -1  # vLLM's 0: disabled
