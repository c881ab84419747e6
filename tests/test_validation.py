"""One validation for every API: the same mistake gets the same 400 on chat, completions and Responses,
worded as vLLM words it where vLLM checks the same field."""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
import pytest

from gateway.api.chat_request import parse_request
from gateway.api.validation import check_range, check_top_k, convert, max_tokens
from gateway.config import Limits
from gateway.errors import APIError
from tests.responses_requests import parse_create

LIMITS = Limits(default_max_tokens=32, max_tokens_cap=100)


def error_of(endpoint: str, body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        if endpoint == "responses":
            parse_create(orjson.dumps({"input": "hi", **body}), LIMITS)
        else:
            base = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat.completions" else {
                "prompt": "hi"}
            parse_request(endpoint, orjson.dumps({**base, **body}), LIMITS)  # type: ignore[arg-type]
    return info.value


def shape(err: APIError) -> tuple[int, str | None, str | None, str]:
    return err.status, err.code, err.param, err.message


@pytest.mark.parametrize("body", [{"temperature": 2.5}, {"temperature": -0.1}, {"top_p": 0}, {"top_p": 1.5},
                                  {"temperature": "hot"}])
def test_a_mistake_in_a_shared_field_is_the_same_400_on_every_api(body: dict[str, Any]) -> None:
    errors = [shape(error_of(endpoint, body)) for endpoint in ("chat.completions", "completions", "responses")]
    assert errors[0] == errors[1] == errors[2], errors
    assert errors[0][:3] in ((400, "invalid_value", next(iter(body))), (400, "invalid_type", next(iter(body))))


@pytest.mark.parametrize("endpoint,param", [("chat.completions", "max_completion_tokens"),
                                            ("completions", "max_tokens"), ("responses", "max_output_tokens")])
def test_the_output_token_limit_is_checked_alike_and_named_as_the_client_wrote_it(endpoint: str, param: str) -> None:
    for value, message in ((0, f"{param} must be at least 1, got 0."),
                           (101, f"{param} must be at most 100 on this server, got 101.")):
        assert shape(error_of(endpoint, {param: value})) == (400, "invalid_value", param, message)


@pytest.mark.parametrize("kwargs,check", [
    ({"temperature": 3.0}, lambda: check_range("temperature", 3.0, 0.0, 2.0)),
    ({"top_p": 0.0}, lambda: check_range("top_p", 0.0, 0.0, 1.0, lo_open=True)),
    ({"presence_penalty": -3.0}, lambda: check_range("presence_penalty", -3.0, -2.0, 2.0)),
    ({"frequency_penalty": 2.5}, lambda: check_range("frequency_penalty", 2.5, -2.0, 2.0)),
    ({"max_tokens": 0}, lambda: max_tokens(0, "max_tokens", Limits())),
])
def test_sampling_refusals_are_worded_as_vllm_words_them(kwargs: dict[str, Any], check: Any) -> None:
    """vllm serve answers a body that takes vLLM's layer with SamplingParams' message: the plain path too."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    with pytest.raises(VLLMValidationError) as upstream:
        SamplingParams(**kwargs)
    with pytest.raises(APIError) as ours:
        check()
    assert ours.value.message == upstream.value.args[0]


def test_top_k_accepts_what_its_message_says() -> None:
    for ok in (-1, 0, 1, 40, None):
        check_top_k(ok)
    with pytest.raises(APIError, match=r"top_k must be 0 or -1 \(disabled\), or at least 1, got -2\."):
        check_top_k(-2)


def test_a_text_part_whose_text_is_not_a_string_is_an_invalid_value_naming_it() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    err = error_of("chat.completions", body)
    assert shape(err) == (400, "invalid_value", "messages[0].content[0].text",
                          "messages[0].content[0].text must be a string.")
    err = error_of("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]})
    assert shape(err)[:3] == (400, "invalid_value", "input[0].content[0].text")


class _Typed(msgspec.Struct):
    n: int = 0
    items: list[dict[str, int]] = []


@pytest.mark.parametrize("obj,param", [({"n": "1"}, "n"), ({"items": [{"a": "x"}]}, "items")])
def test_a_type_error_names_the_top_level_field(obj: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        convert(obj, _Typed)
    assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_type", param)
