"""Bad bytes are a 400 ``invalid_json`` in the OpenAI error shape, never a 500: invalid UTF-8 and
pathological nesting through the one JSON gate, :func:`gateway.api.validation.decode_json_object`.

Without the gate, msgspec raises ``UnicodeDecodeError`` on invalid UTF-8 inside a string and
``RecursionError`` from ~1,000 levels, and ``orjson.dumps`` refuses 255+ levels: all three were 500s."""

from __future__ import annotations

import orjson
import pytest

from gateway.api.chat_request import parse_request
from gateway.api.validation import MAX_JSON_DEPTH, check_json_depth, decode_json_object
from gateway.config import Limits
from gateway.errors import APIError

DEEP = 100_000

INVALID_UTF8 = {
    "stray byte in a string": b'{"prompt": "a\xff\xfeb", "max_tokens": 3}',
    "stray byte after the object": b'{"prompt": "ab"}\xff',
    "overlong encoding": b'{"prompt": "\xc0\xaf"}',
    "encoded surrogate": b'{"prompt": "\xed\xa0\x80"}',
    "truncated sequence": b'{"prompt": "\xe2\x82"}',
    "invalid key": b'{"\xff": 1, "prompt": "x"}',
}

MALFORMED = {
    "lone surrogate escape": b'{"prompt": "\\ud800"}',
    "byte order mark": b'\xef\xbb\xbf{"prompt": "x"}',
    "raw NUL in a string": b'{"prompt": "a\x00b"}',
    "truncated": b'{"prompt": "x"',
    "NaN": b'{"prompt": "x", "temperature": NaN}',
}


def nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


DEEP_BODIES = {
    "arrays in an unknown field": b'{"prompt": "x", "zz": ' + nested(DEEP) + b"}",
    "objects in an unknown field": b'{"prompt": "x", "zz": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}",
    "arrays in tools": b'{"prompt": "x", "tools": ' + nested(DEEP) + b"}",
    "arrays in messages": b'{"messages": ' + nested(DEEP) + b"}",
    "within orjson's limit but past msgspec's": b'{"prompt": "x", "zz": ' + nested(1000) + b"}",
    "within msgspec's limit but past orjson.dumps'": b'{"prompt": "x", "zz": ' + nested(300) + b"}",
    "one past the limit": b'{"prompt": "x", "zz": ' + nested(MAX_JSON_DEPTH) + b"}",
    "unclosed": b'{"prompt": "x", "zz": ' + b"[" * DEEP,
}


def assert_invalid_json(err: APIError) -> None:
    assert err.status == 400 and err.code == "invalid_json"
    body = orjson.loads(err.to_bytes())
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", INVALID_UTF8.values(), ids=INVALID_UTF8.keys())
def test_invalid_utf8_is_invalid_json_naming_the_byte(raw: bytes) -> None:
    with pytest.raises(APIError) as info:
        decode_json_object(raw)
    assert_invalid_json(info.value)
    first_bad = next(i for i, b in enumerate(raw) if b >= 0x80)  # every non-ASCII byte here is invalid
    assert f"invalid UTF-8 at byte {first_bad}" in info.value.message


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_json_is_invalid_json(raw: bytes) -> None:
    with pytest.raises(APIError) as info:
        decode_json_object(raw)
    assert_invalid_json(info.value)


@pytest.mark.parametrize("raw", DEEP_BODIES.values(), ids=DEEP_BODIES.keys())
@pytest.mark.parametrize("endpoint", ["chat.completions", "completions"])
def test_pathological_nesting_is_invalid_json_on_both_endpoints(endpoint: str, raw: bytes) -> None:
    with pytest.raises(APIError) as info:
        parse_request(endpoint, raw, Limits())  # type: ignore[arg-type]
    assert_invalid_json(info.value)
    assert "deep" in info.value.message


@pytest.mark.parametrize("raw", [*INVALID_UTF8.values(), *MALFORMED.values()])
@pytest.mark.parametrize("endpoint", ["chat.completions", "completions"])
def test_parse_request_answers_bad_bytes_with_400(endpoint: str, raw: bytes) -> None:
    with pytest.raises(APIError) as info:
        parse_request(endpoint, raw, Limits())  # type: ignore[arg-type]
    assert_invalid_json(info.value)


def test_nesting_up_to_the_limit_is_accepted_and_the_limit_is_configurable() -> None:
    ok = b'{"prompt": "x", "zz": ' + nested(MAX_JSON_DEPTH - 1) + b"}"  # the body object is level 1
    # an unknown field: forwarded whole to the engine (vLLM's layer ignores it, as vllm serve does)
    assert parse_request("completions", ok, Limits()).submit_fields["body"] == ok
    with pytest.raises(APIError) as info:
        parse_request("completions", ok, Limits(max_json_depth=8))
    assert_invalid_json(info.value)
    assert "8 levels" in info.value.message


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    prompt = "[" * 5000 + "{" * 5000 + '\\"[' * 3000 + "\\" + '"{'  # escaped quotes and backslashes too
    req = parse_request("completions", orjson.dumps({"prompt": prompt}), Limits())
    assert req.submit_fields["prompt"] == prompt


def test_an_already_decoded_body_is_checked_too() -> None:
    deep: object = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(APIError) as info:
        parse_request("completions", {"prompt": "x", "zz": deep}, Limits())
    assert_invalid_json(info.value)
    assert parse_request("completions", {"prompt": "x"}, Limits()).submit_fields["prompt"] == "x"
    with pytest.raises(APIError) as info:
        check_json_depth({"input": deep}, what="WebSocket message")
    assert_invalid_json(info.value)
    assert info.value.message.startswith("WebSocket message")
    check_json_depth({"input": [[{"a": [1]}]]})


@pytest.mark.parametrize("raw,what", [(b"", "empty"), (b"  \n", "empty"), (b"[]", "an array"), (b"null", "null"),
                                      (b'"x"', "a string"), (b"1", "a number")])
def test_empty_and_non_object_inputs_say_what_they_got(raw: bytes, what: str) -> None:
    with pytest.raises(APIError) as info:
        decode_json_object(raw, what="WebSocket message")
    assert info.value.status == 400
    assert info.value.code == ("invalid_json" if what == "empty" else "invalid_value")
    assert info.value.message.startswith("WebSocket message") and what in info.value.message


def test_text_input_and_valid_unicode_pass() -> None:
    assert decode_json_object('{"prompt": "h\u00e9llo \U0001f600 \\ud83d\\ude00"}') == {"prompt": "héllo 😀 😀"}
    with pytest.raises(APIError) as info:
        decode_json_object('{"prompt": "\ud800"}')  # a WebSocket text frame can never carry this; a caller's str might
    assert_invalid_json(info.value)
