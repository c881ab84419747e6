"""The mirror's records, as pure functions: field dicts in, typed entries out (no I/O).

One record format for every link a mirror reads (:mod:`gateway.scaleout.mirror`): Redis stores each record as a
stream entry; a peer worker's socket carries each one as an SSE event whose data is the same fields as
one JSON object (:func:`pack` / :func:`decode_line`).

Keys (every key of one stream shares its hash tag ``{<id>}``, so the fencing scripts, which touch several,
run on a Redis Cluster too; a gateway's lease and presence channel share ``{<gid>}``):
  ``tokenfan:{<id>}:s``    the stream: a Redis stream of entries, always starting with its header
  ``tokenfan:{<id>}:k``    "this id existed" marker, outlives the stream so an expired id answers 410
  ``tokenfan:{<id>}:e``    the stream's fencing epoch (:mod:`gateway.scaleout.redis_fence`)
  ``tokenfan:{<id>}:t``    a finished stored response's transcript (msgpack), for ``previous_response_id``
  ``tokenfan:{<id>}:a:<owner>``  set (NX) by the one gateway that adopts the stream of an unfenced owner
  ``tokenfan:gw:{<gid>}``  a gateway's lease, refreshed while it runs (a mirror's owner is alive): ``1`` serves,
                           ``1p`` serves and is present on ``tokenfan:p:{<gid>}``, ``draining``
  ``tokenfan:p:{<gid>}``   pub/sub channel a gateway subscribes to while it runs: a killed gateway's connection
                           closes at once, so no subscriber says it is gone without waiting for its lease
  ``tokenfan:ack:<n>``     the replies to one forwarded cancel (a list; ``1`` = "I held it and cancelled")
  ``tokenfan:cancel``      the cancel channel every gateway subscribes to

Before 2026-11-30 the keys had no hash tags (``tokenfan:s:<id>``, ``tokenfan:e:<id>``, ``tokenfan:gw:<gid>`` ...):
gateways of either naming sharing one Redis do not see each other's streams (CHANGELOG.md).

Entries of ``tokenfan:{<id>}:s`` (field names are bytes; values UTF-8):
  header  ``created`` = model, ``endpoint``, ``owner`` = gateway id (or worker index), ``detached`` = 1 | 0,
          ``epoch`` = the owner's fencing epoch (:mod:`gateway.scaleout.redis_fence`; absent: 0, not fenced),
          ``held`` = how many records (events, and the end) the owner's log held when it wrote the header
          (0 in Redis, written at creation; a peer writes one per connection: the mirror waits for those),
          ``at`` = an adopter's: how many events it continues the log from (events past it are not its log)
  event   ``seq``, ``data`` = the chunk JSON with its ``tokenfan`` object, ``text``, ``fin`` = finish reason or ""
  end     ``end`` = done | error | cancelled, ``events`` = how many events the stream has,
          ``error`` = {"status": n, "error": {message, type, param, code}} or ""

A mirror places each event by ``seq`` (:func:`place`): a repeat is skipped (every write is
idempotent, so the owner may re-send after a failure), a hole is an explicit loss.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import orjson

from gateway.errors import APIError, stream_lost

if TYPE_CHECKING:
    from gateway.core.streams import Event, Stream

Fields = dict[bytes, bytes]
EndState = Literal["done", "error", "cancelled"]
END_STATES: tuple[EndState, ...] = ("done", "error", "cancelled")

CANCEL_CHANNEL = "tokenfan:cancel"
ACK_YES = b"1"
ACK_NO = b"0"


def stream_key(stream_id: str) -> str:
    return f"tokenfan:{{{stream_id}}}:s"


def known_key(stream_id: str) -> str:
    return f"tokenfan:{{{stream_id}}}:k"


def epoch_key(stream_id: str) -> str:
    return f"tokenfan:{{{stream_id}}}:e"


def lease_key(gateway_id: str) -> str:
    return f"tokenfan:gw:{{{gateway_id}}}"


def presence_channel(gateway_id: str) -> str:
    return f"tokenfan:p:{{{gateway_id}}}"


def ack_key(nonce: str) -> str:
    return f"tokenfan:ack:{nonce}"


def adopt_key(stream_id: str, owner: str) -> str:
    """Set (NX) by the one gateway that adopts ``stream_id`` from its lost owner ``owner``."""
    return f"tokenfan:{{{stream_id}}}:a:{owner}"


def transcript_key(response_id: str) -> str:
    return f"tokenfan:{{{response_id}}}:t"


class CodecError(ValueError):
    """A Redis record that is not one this codec writes."""


@dataclass(frozen=True, slots=True)
class Header:
    endpoint: str
    model: str
    owner: str  # gateway id of the replica running the generation ("" if unknown)
    detached: bool = True  # the generation outlives its readers (fan-out streams, background responses)
    held: int = 0  # records (events, and the end) the owner held when it wrote this header
    request: bytes = b""  # the engine request (msgpack Submit) a gateway that adopts the stream continues
    options: dict[str, Any] | None = None  # the API's renderer options, for that gateway
    epoch: int = 0  # the owner's fencing epoch (0: an unfenced owner's, e.g. a peer worker's)
    at: int | None = None  # an adopter's: the events it continues the log from (None: the stream's creator)


@dataclass(frozen=True, slots=True)
class EventEntry:
    seq: int
    chunk: dict[str, Any]
    text: str
    finish_reason: str | None
    ids: tuple[int, ...] | list[int] = ()  # the output token ids of the deltas behind it


@dataclass(frozen=True, slots=True)
class EndEntry:
    state: EndState
    events: int | None  # None: the writer did not know the count
    error: APIError | None


Entry = Header | EventEntry | EndEntry


def encode_header(endpoint: str, model: str, owner: str, *, detached: bool = True, held: int = 0,
                  request: bytes = b"", options: dict[str, Any] | None = None, epoch: int = 0,
                  at: int | None = None) -> Fields:
    """A stream's header: written when it is created, and again by a gateway that adopts it (its new owner;
    ``at``: the events it continues from)."""
    fields = {b"created": model.encode(), b"endpoint": endpoint.encode(), b"owner": owner.encode(),
              b"detached": b"1" if detached else b"0", b"held": b"%d" % held}
    if epoch:
        fields[b"epoch"] = b"%d" % epoch
    if at is not None:
        fields[b"at"] = b"%d" % at
    if request:
        fields[b"request"] = request
        fields[b"options"] = orjson.dumps(options or {})
    return fields


def encode_header_of(stream: Stream, owner: str, at: int | None = None) -> Fields:
    return encode_header(stream.endpoint, stream.model, owner, detached=stream.detached, request=stream.request,
                         options=stream.options, epoch=stream.epoch, at=at)


def encode_event(seq: int, chunk: dict[str, Any], text: str, finish_reason: str | None,
                 ids: tuple[int, ...] | list[int] = ()) -> Fields:
    fields = {b"seq": b"%d" % seq, b"data": orjson.dumps(chunk), b"text": text.encode(),
              b"fin": (finish_reason or "").encode()}
    if ids:
        fields[b"ids"] = orjson.dumps(ids)
    return fields


def encode_end(state: EndState, events: int | None, error: APIError | None) -> Fields:
    """``events`` None: the writer does not know the count (an end written for a stream it lost)."""
    err = orjson.dumps({"status": error.status, **error.body()}) if error is not None else b""
    return {b"end": state.encode(), b"events": b"" if events is None else b"%d" % events, b"error": err}


def encode_event_of(ev: Event) -> Fields:
    return encode_event(ev.seq, ev.timed_payload, ev.text, ev.finish_reason, ev.ids)


def encode_end_of(stream: Stream) -> Fields:
    """The end record of a stream that ended (one still running gets ``stream_lost``: its generation
    ended without an end state, so mirrors must never take it for a normal end)."""
    if stream.state == "running" or stream.state == "moved":  # (a moved stream's end is its adopter's to write)
        return encode_end("error", stream.next_seq,
                          stream_lost(stream.id, "its generation ended without an end state"))
    return encode_end(stream.state, stream.next_seq, stream.error)


def decode(fields: Fields) -> Entry:
    """The typed entry of one Redis stream record; :class:`CodecError` if it is not one of ours."""
    try:
        if b"seq" in fields:
            return _decode_event(fields)
        if b"end" in fields:
            return _decode_end(fields)
        if b"created" in fields:
            return Header(fields.get(b"endpoint", b"").decode(), fields[b"created"].decode(),
                          fields.get(b"owner", b"").decode(), fields.get(b"detached", b"1") != b"0",
                          int(fields.get(b"held") or 0), fields.get(b"request", b""),
                          orjson.loads(fields[b"options"]) if fields.get(b"options") else None,
                          int(fields.get(b"epoch") or 0), int(fields[b"at"]) if fields.get(b"at") else None)
    except (KeyError, ValueError, TypeError) as exc:  # UnicodeDecodeError and orjson's error are ValueErrors
        raise CodecError(f"malformed broker entry ({exc!r}): {sorted(fields)}") from exc
    raise CodecError(f"unknown broker entry with fields {sorted(fields)}")


def _decode_event(fields: Fields) -> EventEntry:
    seq = int(fields[b"seq"])
    if seq < 0:
        raise ValueError(f"negative seq {seq}")
    chunk = orjson.loads(fields[b"data"])
    if not isinstance(chunk, dict):
        raise TypeError("data is not a JSON object")
    ids = orjson.loads(fields[b"ids"]) if fields.get(b"ids") else ()
    if not isinstance(ids, tuple | list) or not all(isinstance(i, int) for i in ids):
        raise TypeError("ids is not a list of token ids")
    return EventEntry(seq, chunk, fields[b"text"].decode(), fields.get(b"fin", b"").decode() or None, ids)


def _decode_end(fields: Fields) -> EndEntry:
    state = fields[b"end"].decode()
    if state not in END_STATES:
        raise ValueError(f"unknown end state {state!r}")
    raw_events = fields.get(b"events")
    events = int(raw_events) if raw_events else None
    error = None
    if fields.get(b"error"):
        obj = orjson.loads(fields[b"error"])
        e = obj["error"]
        error = APIError(int(obj.get("status", 502)), e["message"], type=e["type"], param=e.get("param"),
                         code=e.get("code"))
    return EndEntry(state, events, error)


def pack(fields: Fields) -> bytes:
    """One record as one line, what a peer worker's socket carries: a JSON object of the same fields, the
    event's ``data`` embedded as JSON rather than as a string (no second escaping), a header's ``request``
    (msgpack) in base64."""
    return orjson.dumps({k.decode(): orjson.Fragment(v) if k == b"data" else
                         base64.b64encode(v).decode() if k == b"request" else v.decode() for k, v in fields.items()})


def pack_event(ev: Event) -> bytes:
    """``pack(encode_event_of(ev))`` in one ``orjson.dumps``: the peer link's per-event path."""
    record: dict[str, Any] = {"seq": str(ev.seq), "data": ev.timed_payload, "text": ev.text, "fin": ev.finish_reason or ""}
    if ev.ids:
        record["ids"] = ev.ids
    return orjson.dumps(record)


def decode_line(line: bytes) -> Entry:
    """The typed entry of a record :func:`pack` wrote; :class:`CodecError` if it is not one of ours."""
    try:
        obj = orjson.loads(line)
        if "seq" in obj:  # the common case, decoded without a detour through Fields
            seq, chunk, text, fin, ids = int(obj["seq"]), obj["data"], obj["text"], obj.get("fin"), obj.get("ids", ())
            if seq < 0 or not isinstance(chunk, dict) or not isinstance(text, str) or not isinstance(ids, list | tuple):
                raise ValueError(f"seq {seq}, data {type(chunk).__name__}, text {type(text).__name__}")
            return EventEntry(seq, chunk, text, fin or None, ids)
        fields = {k.encode(): v.encode() for k, v in obj.items()}
        if b"request" in fields:
            fields[b"request"] = base64.b64decode(fields[b"request"], validate=True)
    except (KeyError, ValueError, TypeError, AttributeError, binascii.Error) as exc:
        raise CodecError(f"malformed peer record ({exc!r}): {line[:200]!r}") from exc
    return decode(fields)


Placement = Literal["append", "repeat", "hole"]


def place(seq: int, have: int) -> Placement:
    """Where an event with ``seq`` goes in a log that holds ``have`` events."""
    if seq < have:
        return "repeat"
    return "append" if seq == have else "hole"


def held(newest_first: list[Fields]) -> int:
    """The events a log holds, from its last entries (newest first, as ``XREVRANGE`` returns them): its last
    event's ``seq`` + 1, read back over headers (an adopter's follows the events it adopted); -1 once it holds
    an end; 0 for headers only (records that are not ours are read past). The fenced append's script reads a
    log the same way
    (:data:`gateway.scaleout.redis_fence.APPEND`)."""
    for fields in newest_first:
        if fields.get(b"seq", b"").isdigit():
            return int(fields[b"seq"]) + 1
        if b"end" in fields:
            return -1
    return 0


def end_is_complete(end: EndEntry, have: int) -> bool:
    """Whether a log of ``have`` events holds everything the owner's end says it published."""
    return end.events is None or end.events == have


@dataclass(frozen=True, slots=True)
class CancelRequest:
    stream_id: str
    reply_to: str  # the list key each listening gateway pushes its ACK_YES / ACK_NO to


def encode_cancel(req: CancelRequest) -> bytes:
    return orjson.dumps({"id": req.stream_id, "reply": req.reply_to})


def decode_cancel(data: bytes) -> CancelRequest:
    try:
        obj = orjson.loads(data)
        return CancelRequest(str(obj["id"]), str(obj["reply"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise CodecError(f"malformed cancel message: {data[:200]!r}") from exc
