"""The plain path against ``vllm serve``, property-based: hypothesis generates chat and completions bodies made
only of the plain path's fields (string, null and text-part content, the three roles, stops, penalties, seeds,
top-p/top-k, token budgets up to past the context, ``ignore_eos``, ``stream`` and ``stream_options``, ``n`` = 1,
``user``) and sends each to ``vllm serve`` and to tokenfan's plain path on the same tiny model (float32, greedy
or seeded), comparing the status, the text, the finish reason and the usage, streamed or not.

tokenfan's plain path for chat is the session's parser-less gateway (``vllm_gateway_url``: on an engine with a
tool or reasoning parser every chat body takes vLLM's layer); for completions it is ``parser_gateway`` (parsers
apply to chat only), which runs with the same flags as ``vllm serve``. ``vllm serve`` runs vLLM's qwen3
reasoning parser, so its chat bodies also carry ``chat_template_kwargs: {"enable_thinking": false}``: the tiny
model's template ignores the variable (the prompt is the same) and the parser then leaves the text in
``content``. vLLM's parsers also turn ``skip_special_tokens`` off for every chat request
(``vllm/parser/engine/parser_engine.py``: ``adjust_request``), so the reference's chat text keeps the special
tokens the random model writes now and then (``<s>``), which a parser-less ``vllm serve`` and tokenfan's plain
path skip: they are taken out of the reference's chat text, and chat stops hold a character no special token
has, so none matches inside one. The bodies omit nothing else tokenfan serves differently on purpose (docs/api-fields.md): every
body sets a token budget (tokenfan's default is ``--default-max-tokens``, vllm serve's the rest of the context).

Examples: ``TOKENFAN_PARITY_EXAMPLES`` per endpoint (default 25, with hypothesis's fixed derandomized seed, so
``make test`` sends the same bodies every run); with ``TOKENFAN_PARITY_SEED`` a random run is repeatable
(``TOKENFAN_PARITY_EXAMPLES=300 TOKENFAN_PARITY_SEED=$RANDOM pytest tests/e2e/test_vllm_parity_plain.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

from engine_worker.models import TINY_SPECIAL_TOKENS
from tests.e2e.helpers import sse_events
from tests.e2e.test_vllm_parity import NO_THINK, PATHS, _ws_chunks, assembled, both

pytestmark = pytest.mark.vllm
log = logging.getLogger(__name__)

EXAMPLES = int(os.environ.get("TOKENFAN_PARITY_EXAMPLES", "25"))
SEED = os.environ.get("TOKENFAN_PARITY_SEED")
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=SEED is None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
MAX_MODEL_LEN = 512  # both servers' --max-model-len (tests/conftest.py)


def _seeded(test: Any) -> Any:
    return seed(int(SEED))(test) if SEED is not None else test


# -- bodies --------------------------------------------------------------------------------------------------

# Words and characters the tiny model's tokenizer splits in various ways: BPE merges, spaces, newlines,
# multi-byte characters; short, so prompts stay far below the context.
_words = st.sampled_from(["Tell me", " about rivers.", "The", " weather", " in Paris", "?", "\n", " ", "",
                          "Be brief.", "sea", " snow", "été", "🙂", "a", "<|user|>", "  two  spaces"])
text = st.lists(_words, max_size=5).map("".join)
parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3)
content = st.one_of(text, parts)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": content}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none()}),
)
# Stop strings that the tiny model's output contains now and then (its vocabulary is the corpus's); chat's
# hold a character no special token has (see the module docstring).
_STOPS = {"completion": ["e", " t", "the", ".", "\n", "ing", "zzz", "a", "s", "2"],
          "chat": [" t", "the", ".", "\n", "ing", "zzz", "2", " Take", "gh"]}
_SPECIAL_CHARS = set("".join(TINY_SPECIAL_TOKENS))
assert all(set(stop) - _SPECIAL_CHARS for stop in _STOPS["chat"])


def stops(endpoint: str) -> st.SearchStrategy[str | list[str]]:
    words = st.sampled_from(_STOPS[endpoint])
    return st.one_of(words, st.lists(words, min_size=1, max_size=3))
# One body in five starts with a long text (about 300 to 650 tokens) and asks for 20 tokens, the context
# length or more (both servers refuse a budget above the context length, lower one within it to what the
# prompt leaves, and refuse a prompt longer than the context).
_FILLER = "The weather in Paris. "
long_text = st.integers(60, 130).map(lambda n: _FILLER * n)


@st.composite
def sampling(draw: st.DrawFn, chat: bool, long: bool) -> dict[str, Any]:
    """The plain path's sampling fields; any temperature above 0 comes with a seed (else two servers differ by
    chance, not by design)."""
    body: dict[str, Any] = {}
    budget_field = draw(st.sampled_from(["max_tokens", "max_completion_tokens"])) if chat else "max_tokens"
    body[budget_field] = draw(st.sampled_from([20, MAX_MODEL_LEN, 4000]) if long else st.integers(1, 24))
    temperature = draw(st.sampled_from([0, 0, 0.7, 1.0, 1.5]))
    body["temperature"] = temperature
    if temperature > 0:
        body["seed"] = draw(st.integers(0, 2**31 - 1))
        optional = {"top_p": st.sampled_from([0.5, 0.9, 1.0]), "top_k": st.sampled_from([-1, 0, 1, 5, 50])}
    else:
        optional = {"seed": st.integers(0, 2**31 - 1)}
    penalty = st.sampled_from([-2.0, -0.5, 0.0, 1.0, 2.0])
    optional |= {"stop": stops("chat" if chat else "completion"), "presence_penalty": penalty,
                 "frequency_penalty": penalty, "ignore_eos": st.booleans(), "n": st.just(1), "user": st.just("someone")}
    for name, values in optional.items():
        if draw(st.booleans()):
            body[name] = draw(values)
    stream = draw(st.booleans())
    if stream or draw(st.integers(0, 9)) == 0:  # stream_options without stream now and then: a 400 on both
        body["stream"] = stream
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    messages = draw(st.lists(message, min_size=1, max_size=4))
    long = draw(st.integers(0, 4)) == 0
    if long:
        messages.insert(0, {"role": "user", "content": draw(long_text)})
    return {"messages": messages, **draw(sampling(chat=True, long=long))}


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict[str, Any]:
    long = draw(st.integers(0, 4)) == 0
    prompt = draw(long_text) + draw(text) if long else draw(text)
    return {"prompt": [prompt] if draw(st.booleans()) else prompt, **draw(sampling(chat=False, long=long))}


# -- comparison ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_servers(vllm_serve: str, parser_gateway: str, vllm_gateway_url: str) -> dict[str, dict[str, str]]:
    """Per endpoint: the reference and tokenfan's plain path (see the module docstring)."""
    return {"chat": {"vllm": vllm_serve, "tokenfan": vllm_gateway_url},
            "completion": {"vllm": vllm_serve, "tokenfan": parser_gateway}}


def _send(url: str, endpoint: str, body: dict[str, Any], reference: bool) -> dict[str, Any]:
    """What a client gets: the status, and the text, finish reason and usage (assembled from the chunks of a
    stream; ``usage`` None when no chunk carries it)."""
    body = {"model": "tiny", **body, **(NO_THINK if reference and endpoint == "chat" else {})}
    r = httpx.post(url + PATHS[endpoint], json=body, timeout=180)
    if r.status_code != 200:
        return {"status": r.status_code}
    if not body.get("stream"):
        answer = r.json()
        choice = answer["choices"][0]
        text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
        return {"status": 200, "text": _skip_special(text or "", reference and endpoint == "chat"),
                "finish": choice["finish_reason"], "usage": _counts(answer["usage"]), "choices": len(answer["choices"])}
    events = sse_events(r.text)
    assert events[-1]["data"] == "[DONE]", r.text[-500:]
    whole = assembled([json.loads(e["data"]) for e in events[:-1]])
    choice = whole["choices"][0]
    return {"status": 200, "text": _skip_special(choice["content"], reference and endpoint == "chat"),
            "finish": choice["finish"], "usage": _counts(whole["usage"]),
            "choices": len(whole["choices"])}


def _skip_special(text: str, skip: bool) -> str:
    """``text`` without the tiny model's special tokens (the reference's parsers kept them; docstring)."""
    if skip:
        for token in TINY_SPECIAL_TOKENS:
            text = text.replace(token, "")
    return text


def _counts(usage: dict[str, Any] | None) -> dict[str, int] | None:
    """The token counts of a usage object. (vllm serve also writes ``prompt_tokens_details: null``, and with its
    reasoning parser ``completion_tokens_details``: ``reasoning_tokens`` 0 here; tokenfan omits null fields.)"""
    return None if usage is None else {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _compare(servers: dict[str, str], endpoint: str, body: dict[str, Any]) -> None:
    answers = _both(servers, endpoint, body)
    ours, theirs = answers["tokenfan"], answers["vllm"]
    event(f"{endpoint}: status {theirs['status']}, finish {theirs.get('finish')}")  # --hypothesis-show-statistics
    messages = body.get("messages") or ()
    event(f"{endpoint}: text parts {any(isinstance(m['content'], list) for m in messages)}, "
          f"stream {bool(body.get('stream'))}, stop {'stop' in body}, long {len(json.dumps(body)) > 1000}")
    assert ours == theirs, f"{endpoint} {json.dumps(body)}\n tokenfan:   {ours}\n vllm serve: {theirs}"


def _both(servers: dict[str, str], endpoint: str, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return both(lambda url: _send(url, endpoint, body, reference=url == servers["vllm"]), servers)


@PROPERTY
@_seeded
@given(body=chat_bodies())
def test_plain_chat_answers_as_vllm_serve(plain_servers: dict[str, dict[str, str]], body: dict[str, Any]) -> None:
    _compare(plain_servers["chat"], "chat", body)


@PROPERTY
@_seeded
@given(body=completion_bodies())
def test_plain_completions_answer_as_vllm_serve(plain_servers: dict[str, dict[str, str]],
                                                body: dict[str, Any]) -> None:
    _compare(plain_servers["completion"], "completion", body)


def test_text_parts_give_vllm_serves_prompt_and_answer(plain_servers: dict[str, dict[str, str]]) -> None:
    """The case found by hand (tokenfan joined the parts with nothing: one prompt token fewer than vllm serve,
    and another answer): text parts, as the OpenAI SDKs and the AI SDK send them, give vllm serve's prompt and
    greedy answer on every transport of the plain path (POST, /v1/ws, a /v1/streams subscriber)."""
    parts = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": " about rivers."}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 12, "temperature": 0}
    servers = plain_servers["chat"]
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    reference = _both(servers, "chat", streamed)["vllm"]
    for sent in (body, streamed):
        assert _both(servers, "chat", sent)["tokenfan"] == reference
    # vLLM joins the parts of a string template's message with a newline; without one it is another prompt
    as_string = _both(servers, "chat", {**body, "messages": [{"role": "user", "content": "Tell me\n about rivers."}]})
    assert as_string["vllm"]["usage"] == as_string["tokenfan"]["usage"] == reference["usage"]
    unjoined = _send(servers["vllm"], "chat", {**body, "messages": [{"role": "user", "content": "Tell me about rivers."}]},
                     reference=True)
    assert unjoined["usage"] != reference["usage"]

    url = servers["tokenfan"]
    over_ws = assembled(asyncio.run(_ws_chunks(url, "chat", streamed)))
    made = httpx.post(url + "/v1/streams", json={"endpoint": "chat.completions", "model": "tiny", **streamed}, timeout=60)
    assert made.status_code == 201, made.text
    fanned = assembled([json.loads(e["data"]) for e in sse_events(httpx.get(made.json()["events_url"], timeout=120).text)
                        if e.get("data") not in (None, "[DONE]") and e.get("event", "message") == "message"])
    for whole in (over_ws, fanned):
        choice = whole["choices"][0]
        assert (choice["content"], choice["finish"], whole["usage"]) == \
            (reference["text"], reference["finish"], reference["usage"])


def test_budgets_past_the_context_and_empty_messages_answer_as_vllm_serve(
        plain_servers: dict[str, dict[str, str]]) -> None:
    """Edges the generated bodies reach rarely: a budget above the context length is a 400 on both (below it,
    both lower it to what the prompt leaves); an empty ``messages`` is a 400 on both."""
    for endpoint, body in (("completion", {"prompt": "The"}), ("chat", {"messages": [{"role": "user", "content": "The"}]})):
        over = _both(plain_servers[endpoint], endpoint, {**body, "max_tokens": MAX_MODEL_LEN + 1, "temperature": 0})
        assert over["tokenfan"]["status"] == over["vllm"]["status"] == 400
    empty = _both(plain_servers["chat"], "chat", {"messages": [], "max_tokens": 1, "temperature": 0})
    assert empty["tokenfan"]["status"] == empty["vllm"]["status"] == 400
