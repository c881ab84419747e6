"""Request parsing: OpenAI bodies become engine submissions or precise 400s."""

from __future__ import annotations

import orjson
import pytest

from engine_worker import protocol as p
from gateway.errors import APIError
from gateway.openai_api import ChunkBuilder, Limits, parse_request


def parse(endpoint: str, body: dict) -> object:
    return parse_request(endpoint, orjson.dumps(body), Limits(default_max_tokens=32, max_tokens_cap=100))  # type: ignore[arg-type]


def test_chat_request_maps_every_sampling_field() -> None:
    req = parse("chat.completions", {
        "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                   {"role": "user", "content": "hi"}],
        "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 7, "temperature": 0.5,
        "top_p": 0.9, "top_k": 0, "seed": 3, "stop": "\n", "presence_penalty": 1, "frequency_penalty": -1,
        "ignore_eos": True})
    sub = req.to_submit("r", "t")  # type: ignore[attr-defined]
    assert sub.messages == [p.ChatMessage("system", "be brief"), p.ChatMessage("user", "hi")]
    assert sub.sampling == p.Sampling(max_tokens=7, temperature=0.5, top_p=0.9, top_k=-1, seed=3, stop=["\n"],
                                      presence_penalty=1, frequency_penalty=-1, ignore_eos=True)
    assert req.include_usage and req.stream  # type: ignore[attr-defined]


def test_default_max_tokens_applies() -> None:
    assert parse("completions", {"prompt": "x"}).submit_fields["sampling"].max_tokens == 32  # type: ignore[attr-defined]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 101}, "max_tokens"),
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": [1, 2]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_completion_requests_name_the_parameter(body: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        parse("completions", body)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("body", [b"", b"{", b"[]", b"null"])
def test_non_object_bodies_are_400(body: bytes) -> None:
    with pytest.raises(APIError) as info:
        parse_request("chat.completions", body, Limits())
    assert info.value.status == 400


def test_chat_requires_messages_with_known_roles() -> None:
    with pytest.raises(APIError, match="non-empty"):
        parse("chat.completions", {"messages": []})
    with pytest.raises(APIError, match="role"):
        parse("chat.completions", {"messages": [{"role": "wizard", "content": "x"}]})


def test_chunks_follow_the_openai_stream_shape() -> None:
    b = ChunkBuilder("chat.completions", "chatcmpl-1", "m", include_usage=True)
    role = b.role_chunk()
    assert role is not None and role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = b.delta_chunk("hi", "stop")
    assert last["choices"][0] == {"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": "stop"}
    assert last["usage"] is None and last["object"] == "chat.completion.chunk"
    usage = b.usage_chunk(p.Usage(3, 2))
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    c = ChunkBuilder("completions", "cmpl-1", "m", include_usage=False)
    assert c.role_chunk() is None
    assert c.delta_chunk("x", None)["choices"][0]["text"] == "x" and "usage" not in c.delta_chunk("x", None)
