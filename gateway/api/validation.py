"""Request validation shared by chat completions, completions and the Responses API (pure, no I/O).

- :func:`decode_json_object` is the one JSON gate of every entry point (POST bodies, ``/v1/streams``,
  ``/v1/ws`` and Responses WebSocket messages): invalid UTF-8, malformed JSON and nesting deeper than
  ``Limits.max_json_depth`` are a 400 ``invalid_json``, never a 500 (msgspec would raise
  ``UnicodeDecodeError`` or ``RecursionError``, and ``orjson.dumps`` refuses depth 255+). Objects decoded
  elsewhere pass :func:`check_json_depth` instead.
- :func:`convert` types an object with msgspec; a type error is a 400 ``invalid_type`` naming the top-level
  field.
- The field checks (:func:`max_tokens`, :func:`check_range`, :func:`check_top_k`, :func:`stop_strings`,
  :func:`text_content`) give every API the same 400 ``invalid_value`` for the same mistake. Where vLLM
  checks the same field (``SamplingParams._verify_args``) the accepted range and the wording are vLLM's,
  so a body answers alike on tokenfan's plain path and through vLLM's layer in the engine; the parameter
  is the field the client wrote (``max_completion_tokens``, ``max_output_tokens``), where vLLM says
  ``max_tokens``.
"""

from __future__ import annotations

import re
from itertools import accumulate
from typing import Any, TypeVar

import msgspec
import orjson

from gateway.config import Limits
from gateway.errors import APIError, ClientError

T = TypeVar("T")



MAX_JSON_DEPTH = Limits().max_json_depth


def invalid(param: str, message: str) -> APIError:
    """400 ``invalid_value``: a field holds a value this server does not accept."""
    return ClientError(400, message, param=param, code="invalid_value")


def unsupported(param: str, why: str) -> APIError:
    """400 ``unsupported_parameter``: a field this server cannot honour (refused rather than ignored)."""
    return ClientError(400, f"{param}: {why}.", param=param, code="unsupported_parameter")


# -- the JSON gate ---------------------------------------------------------------------------------

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a string literal (unrolled: linear time)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes


def decode_json_object(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH, what: str = "Request body") -> dict[str, Any]:
    """``raw`` as a JSON object, or :class:`APIError` 400: ``invalid_json`` if empty, nested deeper than
    ``max_depth``, not UTF-8 or not JSON; ``invalid_value`` if not an object (``what`` names the input).

    The depth is checked on the bytes before parsing, and only when they hold more than ``max_depth``
    brackets (ordinary bodies pay two ``count`` calls); orjson then validates UTF-8 and the grammar."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if not data.strip():
        raise ClientError(400, f"{what} is empty; expected a JSON object.", code="invalid_json")
    if _nests_deeper(data, max_depth):
        raise ClientError(400, _too_deep(what, max_depth), code="invalid_json")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ClientError(400, f"{what} is not valid JSON: {_json_problem(data, exc)}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ClientError(400, f"{what} must be a JSON object, got {_json_type(obj)}.", code="invalid_value")
    return obj


def _nests_deeper(data: bytes, limit: int) -> bool:
    """Whether arrays/objects in JSON text nest more than ``limit`` levels: the brackets outside string
    literals, summed in C (a 1 MB body of brackets: ~50 ms on 2 loaded cores; orjson alone takes longer)."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    steps = _JSON_STRING.sub(b"", data).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    return any(depth > limit for depth in accumulate(memoryview(steps).cast("b")))


def check_json_depth(obj: object, max_depth: int = MAX_JSON_DEPTH, what: str = "Request body") -> None:
    """:class:`APIError` 400 ``invalid_json`` if an already decoded value (e.g. from ``orjson.loads``, which
    allows 1024 levels) nests deeper than ``max_depth``: check before ``msgspec.convert`` or ``orjson.dumps``."""
    if _deeper_than(obj, max_depth):
        raise ClientError(400, _too_deep(what, max_depth), code="invalid_json")


def _deeper_than(obj: object, limit: int) -> bool:
    """Whether an already decoded value nests more than ``limit`` levels (level by level: no recursion)."""
    level = [obj] if isinstance(obj, (dict, list)) else []
    for _ in range(limit):
        level = [c for node in level for c in (node.values() if isinstance(node, dict) else node)
                 if isinstance(c, (dict, list))]
        if not level:
            return False
    return bool(level)


def _json_problem(data: bytes, exc: orjson.JSONDecodeError) -> str:
    try:
        data.decode()
    except UnicodeDecodeError as bad:
        return f"invalid UTF-8 at byte {bad.start}"
    return str(exc)


def _too_deep(what: str, max_depth: int) -> str:
    return f"{what} nests arrays/objects more than {max_depth} levels deep."


def _json_type(obj: object) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(obj), "a number")


# -- typing ----------------------------------------------------------------------------------------

_PATH = re.compile(r"at `\$\.?([^`]*)`")  # where msgspec says a ValidationError happened: "... - at `$.a[0].b`"


def convert(obj: dict[str, Any], kind: type[T]) -> T:
    """A decoded JSON object as the msgspec struct ``kind``, or 400 ``invalid_type`` with msgspec's message
    and the top-level field it names as ``param`` (``messages`` for ``$.messages[0].role``)."""
    try:
        return msgspec.convert(obj, type=kind)
    except msgspec.ValidationError as exc:
        m = _PATH.search(str(exc))
        param = re.split(r"[.\[]", m.group(1))[0] if m and m.group(1) else None
        raise ClientError(400, f"Invalid request: {exc}", param=param, code="invalid_type") from exc


# -- fields ----------------------------------------------------------------------------------------


def max_tokens(value: int | None, param: str, limits: Limits) -> int:
    """A request's output-token limit (``param`` names the field): the default when absent, else an integer
    from 1 (as vLLM) to ``--max-tokens-cap``."""
    if value is None:
        return min(limits.default_max_tokens, limits.max_tokens_cap)
    if value < 1:
        raise invalid(param, f"{param} must be at least 1, got {value}.")
    check_max_tokens_cap(value, param, limits)
    return value


def check_max_tokens_cap(value: int, param: str, limits: Limits) -> None:
    """tokenfan's own ceiling, ``--max-tokens-cap`` (also on bodies vLLM's layer validates otherwise)."""
    if value > limits.max_tokens_cap:
        raise invalid(param, f"{param} must be at most {limits.max_tokens_cap} on this server, got {value}.")


def check_range(name: str, value: float | None, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """``value`` (if given) in ``[lo, hi]``, or ``(lo, hi]`` with ``lo_open``; worded as vLLM words it."""
    if value is None:
        return
    if not (lo < value if lo_open else lo <= value) or not value <= hi:  # NaN fails both
        raise invalid(name, f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}.")


def check_top_k(top_k: int | None) -> None:
    """-1 and 0 disable top-k (vLLM prefers 0 and quietly accepts -1); anything else is at least 1."""
    if top_k is not None and top_k < -1:
        raise invalid("top_k", f"top_k must be 0 or -1 (disabled), or at least 1, got {top_k}.")


def stop_strings(stop: str | list[str] | None, limits: Limits) -> list[str]:
    """``stop`` as a list: at most ``limits.max_stop`` strings, none empty (vLLM refuses those too)."""
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > limits.max_stop:
        raise invalid("stop", f"stop allows at most {limits.max_stop} strings.")
    if any(s == "" for s in strings):
        raise invalid("stop", "stop strings must not be empty.")
    return strings


def text_content(param: str, content: Any, kinds: frozenset[str]) -> str | list[str]:
    """A message's content: a string as is, or the texts of its parts (each of a type in ``kinds``), in
    order and unjoined. A part of another type is refused (400
    ``unsupported_parameter`` naming it).

    The parts are not joined here: vLLM's chat layer joins them as the chat template's content format
    requires (``vllm/renderers/chat_utils.py``: a newline between parts for templates that take string
    content, the parts themselves for templates that iterate over them), and the engine renders with it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(param, f"{param} must be a string or a list of content parts.")
    texts = []
    for j, part in enumerate(content):
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype not in kinds:
            raise unsupported(f"{param}[{j}]", f"content parts of type {ptype!r} are not supported; only text is")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{param}[{j}].text", f"{param}[{j}].text must be a string.")
        texts.append(part["text"])
    return texts
