"""The /v1/ws message parser (pure): every malformed message is a BadMessage naming the request."""

from __future__ import annotations

import pytest

from gateway.api.openai.ws_mux import BadMessage, Cancel, Request, parse_message


def test_a_request_and_a_cancel_parse() -> None:
    req = parse_message(b'{"type":"request","id":"a","endpoint":"completions","body":{"prompt":"x"}}')
    assert req == Request("a", "completions", {"prompt": "x"})
    assert parse_message(b'{"type":"request","id":"b","body":{}}') == Request("b", "chat.completions", {})
    assert parse_message(b'{"type":"cancel","id":"a"}') == Cancel("a")


@pytest.mark.parametrize(("raw", "cid", "code", "param"), [
    (b"{not json", None, "invalid_json", None),
    (b"\xff\xfe", None, "invalid_json", None),
    (b"[1,2]", None, "invalid_value", None),
    (b'{"type":"request"}', None, "invalid_value", "id"),
    (b'{"type":"request","id":""}', None, "invalid_value", "id"),
    (b'{"type":"request","id":"' + b"x" * 257 + b'"}', None, "invalid_value", "id"),
    (b'{"type":"nope","id":"a"}', "a", "invalid_value", "type"),
    (b'{"type":"request","id":"a","endpoint":"embeddings","body":{}}', "a", "invalid_value", "endpoint"),
    (b'{"type":"request","id":"a","body":"x"}', "a", "invalid_value", "body"),
    (b"[" * 100_000 + b"]" * 100_000, None, "invalid_json", None),
])
def test_bad_messages_name_their_request_and_field(raw: bytes, cid: str | None, code: str, param: str | None) -> None:
    with pytest.raises(BadMessage) as info:
        parse_message(raw)
    assert info.value.id == cid
    assert info.value.error.status == 400
    assert info.value.error.code == code and info.value.error.param == param
