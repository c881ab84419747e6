"""Building Responses requests in tests: decode + build in one call (the routes do the two steps apart,
looking up ``previous_response_id``'s transcript in between)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.api.responses import chat as rc
from gateway.api.responses.request import ResponsesRequest, build_request, decode_create
from gateway.config import Limits


def parse_create(body: bytes | dict[str, Any], limits: Limits, history: Sequence[rc.Message] = ()) -> ResponsesRequest:
    return build_request(decode_create(body), limits, history)
