"""Request parsing: OpenAI bodies become engine submissions or precise 400s."""

from __future__ import annotations

import orjson
import pytest

from engine_worker import protocol as p
from gateway.api.chat_request import ChunkBuilder, parse_request
from gateway.config import Limits
from gateway.errors import APIError


def parse(endpoint: str, body: dict) -> object:
    return parse_request(endpoint, orjson.dumps(body), Limits(default_max_tokens=32, max_tokens_cap=100))  # type: ignore[arg-type]


def test_text_parts_reach_the_engine_unjoined_and_null_content_is_no_parts() -> None:
    """vLLM's chat layer joins text parts as the template's content format wants (a newline for string
    templates): the gateway must not join them itself (it joined them with nothing: 35 prompt tokens on the
    tiny model where vllm serve counts 36)."""
    req = parse("chat.completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": " about rivers."}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": []}]})
    sub = req.to_submit("r", "t")  # type: ignore[attr-defined]
    assert sub.messages == [p.ChatMessage("user", ["Tell me", " about rivers."]), p.ChatMessage("assistant", []),
                            p.ChatMessage("user", [])]
    assert [m.text for m in sub.messages] == ["Tell me\n about rivers.", "", ""]
    assert p.decode(p.encode(sub)) == sub


@pytest.mark.parametrize("prompt", [None, ""])
def test_a_missing_or_empty_prompt_is_refused_as_vllm_refuses_it(prompt: str | None) -> None:
    with pytest.raises(APIError) as info:
        parse("completions", {"prompt": prompt, "max_tokens": 2})
    assert (info.value.status, info.value.param) == (400, "prompt")
    assert info.value.message == "Either prompt or prompt_embeds must be provided and non-empty."
    assert parse("completions", {"prompt": [""]}).submit_fields["prompt"] == ""  # type: ignore[attr-defined]


def test_chat_request_maps_every_sampling_field() -> None:
    req = parse("chat.completions", {
        "model": "m", "messages": [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                                   {"role": "user", "content": "hi"}],
        "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 7, "temperature": 0.5,
        "top_p": 0.9, "top_k": 0, "seed": 3, "stop": "\n", "presence_penalty": 1, "frequency_penalty": -1,
        "ignore_eos": True})
    sub = req.to_submit("r", "t")  # type: ignore[attr-defined]
    assert sub.messages == [p.ChatMessage("system", ["be brief"]), p.ChatMessage("user", "hi")]
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
    ({"prompt": "x", "stop": [""]}, "stop"),
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



@pytest.mark.parametrize("endpoint,body", [
    ("chat.completions", {"messages": [{"role": "developer", "content": "be brief"}]}),  # vLLM merges system turns
    ("chat.completions", {"messages": [{"role": "wizard", "content": "x"}]}),  # vLLM's template decides
    ("chat.completions", {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none"}),
    ("chat.completions", {"messages": [{"role": "user", "content": "x"}], "n": 2, "logprobs": True}),
    ("chat.completions", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}),
    ("chat.completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    ("completions", {"prompt": [1, 2], "echo": True}),
    ("completions", {"prompt": "x", "response_format": {"type": "json_object"}, "unknown_field": 1}),
])
def test_bodies_beyond_the_plain_path_go_to_the_engine_whole(endpoint: str, body: dict) -> None:
    """vLLM's OpenAI layer in the engine validates and serves them, as vllm serve does: nothing is refused,
    rebuilt or dropped here."""
    req = parse(endpoint, {**body, "stream": True, "max_tokens": 9})
    sub = req.to_submit("r", "t")  # type: ignore[attr-defined]
    assert orjson.loads(sub.body) == {**body, "stream": True, "max_tokens": 9}
    assert sub.messages is None and sub.prompt is None and sub.stream and sub.sampling.max_tokens == 9


def test_forwarded_bodies_keep_the_gateway_limits() -> None:
    with pytest.raises(APIError) as info:
        parse("chat.completions", {"messages": [], "tools": [], "max_completion_tokens": 101})
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(APIError) as info:
        parse("chat.completions", {"messages": [], "n": 2, "stream": "yes"})
    assert info.value.param == "stream"


def test_plain_bodies_reach_the_engine_too() -> None:
    """A parser-configured engine serves plain chat bodies through vLLM's layer as well."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert orjson.loads(parse("chat.completions", body).to_submit("r", "t").body) == body  # type: ignore[attr-defined]


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
