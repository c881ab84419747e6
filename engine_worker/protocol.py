"""Wire protocol between gateway and engine worker (pure: no sockets, no asyncio).

Every ZeroMQ message is two frames: ``[MAGIC, payload]``. ``MAGIC`` carries the
protocol version; the payload is msgpack of one of the tagged structs below
(array-like, so the tag is the first element). Decoding is typed and strict:
msgspec builds only these structs, never arbitrary objects (no pickle anywhere).
A frame that fails to decode raises :class:`WireError`; callers drop and count it.

Directions:
  gateway -> engine: Submit, Abort, Ping
  engine  -> gateway: Accepted, DeltaBatch, Error, Heartbeat
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec

PROTOCOL_VERSION = 4  # 3: list content parts, Delta.token_ids, Submit.resume; 4: Delta.steps, Submit.resume_steps
MAGIC = b"tokenfan/%d" % PROTOCOL_VERSION

Endpoint = Literal["chat.completions", "completions"]
FinishReason = Literal["stop", "length", "abort", "error"]



EngineSteps = list[list[list[int]]]
"""Engine steps of a request of vLLM's OpenAI layer: per step, per output ``[choice_index, finished (0 or 1),
*token_ids]`` (:attr:`Delta.steps`, :attr:`Submit.resume_steps`; :func:`pack_steps` flattens them)."""

class WireError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class VersionMismatch(WireError):
    """A frame of another version of this protocol: the gateway and the engine are of releases that cannot
    work together (CHANGELOG.md lists which can)."""


class ChatMessage(msgspec.Struct, array_like=True, frozen=True):
    """One plain chat message. ``content`` is the string the client sent, or the texts of its text parts
    in order (``null`` content: no parts). The engine renders it with vLLM's chat layer, which joins parts
    as the chat template's content format requires (a newline between parts for string templates), so
    the parts travel unjoined."""

    role: str
    content: str | list[str]

    @property
    def text(self) -> str:
        """The content as a chat template taking string content sees it: parts joined by a newline, as
        vLLM's chat layer joins them (for a model-free engine; the vLLM engine renders with vLLM itself)."""
        return self.content if isinstance(self.content, str) else "\n".join(self.content)


class Sampling(msgspec.Struct, array_like=True, frozen=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = []
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False


class Submit(msgspec.Struct, tag="submit", array_like=True, frozen=True):
    """Start a generation. Exactly one of ``prompt`` / ``messages`` is set.

    ``body`` is the client's OpenAI request object (JSON): the engine serves it through vLLM's own
    OpenAI layer when it needs more than the plain path (tools, structured outputs, logprobs, ``n`` …)
    and says so in :class:`Accepted`. ``stream``: whether the client reads chunks or one response.

    A *continuation* (the request's engine was lost mid-answer; see docs/failures.md) is the same request
    with ``resume``: the output token ids already delivered, to be appended to the prompt, and
    ``resume_chars``: how many characters of their text the client already has (text the old engine held
    back, for a stop string or an unfinished character, is sent first). The engine generates the rest of
    the token budget and reports usage as one request (the original prompt, every completion token)."""

    request_id: str
    endpoint: Endpoint
    sampling: Sampling
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    trace_id: str = ""
    body: bytes = b""
    stream: bool = True
    resume: list[int] = []
    resume_chars: int = 0
    resume_steps: EngineSteps = []
    # W3C trace context of the gateway's generation span (``traceparent``, ``tracestate``): the engine's spans
    # and vLLM's request span join that trace (docs/observability.md); empty when the gateway does not trace.
    # Last, with a default: a gateway of an earlier release sends no such field, and an engine of one ignores it.
    trace_headers: dict[str, str] = {}


class Abort(msgspec.Struct, tag="abort", array_like=True, frozen=True):
    request_ids: list[str]


class Ping(msgspec.Struct, tag="ping", array_like=True, frozen=True):
    sent_ns: int


class Accepted(msgspec.Struct, tag="accepted", array_like=True, frozen=True):
    """The engine validated and queued the request (prompt tokenized)."""

    request_id: str
    prompt_tokens: int
    openai: bool = False  # the deltas carry whole OpenAI chunks (``Delta.chunk``) built by vLLM's layer


class Usage(msgspec.Struct, array_like=True, frozen=True):
    prompt_tokens: int
    completion_tokens: int


class Delta(msgspec.Struct, array_like=True, frozen=True):
    """New text of one request after one engine step.

    ``seq`` starts at 0 and increases by one per delta of a request. ``emit_ns`` is
    the engine's wall clock (``time.time_ns()``) when the delta left the backend. ``chunk`` (requests
    served by vLLM's OpenAI layer) is one whole OpenAI chunk, exactly as vllm serve writes it after
    ``data:``, or the whole response of a non-streamed request; ``text`` is then empty. ``token_ids``:
    the output token ids of the step (the plain path; what a continuation resumes from). ``steps``
    (vLLM's OpenAI layer): the engine steps whose chunks are complete with this delta, each a list of its
    outputs as ``[choice_index, finished (0 or 1), *token_ids]``; all deltas of one step travel in one :class:`DeltaBatch`, the
    step on its last (a step that made no chunk rides on the next delta).
    """

    request_id: str
    seq: int
    text: str
    token_count: int
    emit_ns: int
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    chunk: bytes = b""
    token_ids: list[int] = []
    steps: EngineSteps = []


class DeltaBatch(msgspec.Struct, tag="deltas", array_like=True, frozen=True):
    """All deltas one engine step produced for one gateway."""

    deltas: list[Delta]


class Error(msgspec.Struct, tag="error", array_like=True, frozen=True):
    """A request failed (``request_id`` set) or the engine itself did (empty id).

    ``code`` is machine-readable: ``invalid_request``, ``context_length_exceeded``,
    ``engine_error``, ``engine_overloaded``, ``bad_frame``, ``version_mismatch`` (to a peer of another
    protocol version, which can only log it).
    """

    request_id: str
    code: str
    message: str
    param: str | None = None
    status: int = 0  # HTTP status when not derived from ``code`` (vLLM's layer: vllm serve's status)
    error_type: str = ""  # OpenAI error type, likewise


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True, frozen=True):
    """Engine liveness and load; sent in answer to every Ping."""

    engine_id: str
    backend: str
    model: str
    max_model_len: int
    running: int
    waiting: int
    ping_sent_ns: int
    sent_ns: int
    bad_frames: int = 0  # malformed frames the engine dropped since it started
    version: str = ""  # the engine's tokenfan release (tokenfan_settings.release); "" from an engine before it


Message = Submit | Abort | Ping | Accepted | DeltaBatch | Error | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> list[bytes]:
    """Frames for one message."""
    return [MAGIC, _encoder.encode(msg)]


def decode(frames: list[bytes]) -> Message:
    """Decode the frames of one message; raises :class:`WireError` on anything invalid."""
    if len(frames) != 2:
        raise WireError(f"expected 2 frames, got {len(frames)}")
    magic, payload = frames
    if magic != MAGIC:
        if magic[:9] == b"tokenfan/" and magic[9:].isdigit():
            raise VersionMismatch(f"the peer speaks wire protocol {bytes(magic).decode()}, this process "
                                  f"{MAGIC.decode()}: run a gateway and an engine of the same protocol version "
                                  "(CHANGELOG.md); its frames are dropped")
        raise WireError(f"unsupported protocol header {bytes(magic[:32])!r}, expected {MAGIC!r}")
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # a str of invalid UTF-8: UnicodeDecodeError
        raise WireError(f"undecodable payload: {exc!r}") from exc


def pack_steps(steps: EngineSteps) -> list[int]:
    """:attr:`Delta.steps` as one flat list of ints (what a stream log's token ids field holds for a request
    of vLLM's OpenAI layer): per step its number of outputs, per output its length, then the output."""
    out: list[int] = []
    for step in steps:
        out.append(len(step))
        for entry in step:
            out.append(len(entry))
            out += entry
    return out


def unpack_steps(flat: list[int]) -> EngineSteps:
    """The inverse of :func:`pack_steps`; raises :class:`WireError` on a list it did not make."""
    steps: EngineSteps = []
    i = 0
    try:
        while i < len(flat):
            n, i = flat[i], i + 1
            step = []
            for _ in range(n):
                size, i = flat[i], i + 1
                if size < 2 or i + size > len(flat):
                    raise WireError("packed steps: an output runs past the end")
                step.append(flat[i:i + size])
                i += size
            steps.append(step)
    except IndexError:
        raise WireError("packed steps: truncated") from None
    return steps


def now_ns() -> int:
    """Wall clock in epoch nanoseconds, the clock of every ``*_ns`` field."""
    return time.time_ns()
