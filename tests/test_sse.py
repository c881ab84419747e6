"""SSE framing is pure: values in, bytes out."""

from __future__ import annotations

import pytest

from gateway.core import sse


def test_event_has_id_event_retry_and_data_lines() -> None:
    assert sse.event(b"{}", id=3, event="error", retry_ms=500) == b"retry: 500\nevent: error\nid: 3\ndata: {}\n\n"


def test_comment_is_ignored_by_eventsource_grammar() -> None:
    assert sse.comment("keep-alive") == b": keep-alive\n\n"


@pytest.mark.parametrize("raw,expected", [(None, None), ("", None), ("0", 0), ("41", 41)])
def test_last_event_id_parses(raw: str | None, expected: int | None) -> None:
    assert sse.parse_last_event_id(raw) == expected


@pytest.mark.parametrize("raw", ["x", "1.5", "-5"])
def test_bad_last_event_id_is_rejected(raw: str) -> None:
    with pytest.raises(ValueError):
        sse.parse_last_event_id(raw)
