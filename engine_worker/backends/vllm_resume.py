"""Continuing a request of vLLM's OpenAI layer where it was: parsers, grammar, logprobs, ``n`` and penalties.

A request served by vLLM's OpenAI layer (tools, reasoning, structured outputs, logprobs, ``n`` > 1 …) keeps
state the plain path does not: the tool and reasoning parsers of vLLM's chat stream generator (the text and
ids they have seen, the tool call they are streaming and its id) and, in the engine core, the request's
grammar. When its engine dies, the gateway re-submits it with ``Submit.resume_steps``: the output token ids
it has delivered, in the engine steps they came in (``Delta.steps``). The new engine runs the request through
a fresh serving path whose ``generate`` is :func:`resumed`:

1. **Replay.** The delivered steps are fed to vLLM's stream generator as ``RequestOutput``s, grouped as they
   were and with the text vLLM's own detokenizer gives them (:class:`Retext`), so every parser reaches the
   state it had. The chunks it writes for them are dropped (:attr:`_Run.live` is false until the replay is
   done): a tool call's header is never sent again, its id and index stay those the client has.
2. **Live.** Each unfinished choice continues as its own engine request (``n`` = 1) whose prompt is the
   original prompt plus that choice's delivered ids, with the rest of the token budget and ``min_tokens``,
   and :data:`RESUME_KEY` in ``SamplingParams.extra_args``. In the engine core, the grammar of a structured
   output accepts those ids before it masks a token (:mod:`engine_worker.backends.vllm_grammar`, the shim
   the project's vLLM plugin installs) and presence/frequency penalties count them as output (:class:`engine_worker.backends.vllm_penalties.ResumePenalties`); the
   repetition penalty already counts them (it reads prompt and output). Its text is decoded again by
   :class:`Retext` over the original prompt and *all* output ids, so stop strings that span the join, held
   back text and characters split across tokens come out as in the uninterrupted run.

What it reproduces exactly for greedy requests: content, reasoning, tool calls, structured outputs,
logprobs of the new tokens, usage (the original prompt, every completion token). A seeded sampled request
continues with a new sample: vLLM does not let a request's generator be advanced.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

from engine_worker.protocol import EngineSteps

log = logging.getLogger(__name__)

RESUME_KEY = "tokenfan_resume"  # SamplingParams.extra_args: the output ids a continuation's prompt ends with


class ReplayError(ValueError):
    """``resume_steps`` that cannot be this request's delivered output."""


@dataclass(frozen=True, slots=True)
class Replay:
    """The delivered steps of a request: each a list of ``[choice_index, finished, *token_ids]``."""

    steps: EngineSteps

    @classmethod
    def parse(cls, steps: EngineSteps, choices: int, vocab: int) -> Replay:
        for step in steps:
            for entry in step:
                if len(entry) < 2 or not 0 <= entry[0] < choices or entry[1] not in (0, 1) \
                        or any(not 0 <= t < vocab for t in entry[2:]):
                    raise ReplayError("resume_steps: not output of this request and model")
        return cls(steps)

    def ids(self, index: int) -> list[int]:
        """Every delivered output id of one choice."""
        return [t for step in self.steps for entry in step if entry[0] == index for t in entry[2:]]

    def finished(self, index: int) -> bool:
        return any(entry[0] == index and entry[1] for step in self.steps for entry in step)


def step_record(outputs: Sequence[Any]) -> list[list[int]]:
    """One engine step's outputs as :attr:`engine_worker.protocol.Delta.steps` records them."""
    return [[o.index, int(o.finish_reason is not None), *o.token_ids] for o in outputs]


class Retext:
    """One choice's text as vLLM's output processor makes it (``IncrementalDetokenizer``: stop strings, the
    text held back for them, ``min_tokens``), over the original prompt and every output id so far."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: Any) -> None:
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        request = SimpleNamespace(request_id="", prompt_token_ids=prompt_ids, sampling_params=params)
        self._detok = IncrementalDetokenizer.from_new_request(tokenizer, request)  # type: ignore[arg-type]

    def step(self, ids: list[int], finish: str | None, stop_reason: int | str | None
             ) -> tuple[str, list[int], str | None, int | str | None]:
        """(text, kept ids, finish reason, stop reason) of one step; a stop string ends the choice."""
        before = self._detok.num_output_tokens()
        hit = self._detok.update(ids, finish == "stop")  # an engine-core "stop" is a stop token
        if hit is not None:
            ids = ids[:self._detok.num_output_tokens() - before]
            finish, stop_reason = "stop", hit
        return self._detok.get_next_output_text(finish is not None, delta=True), ids, finish, stop_reason


async def resumed(engine: Any, prompt: Any, params: Any, request_id: str, replay: Replay, run: Any,
                  **kwargs: Any) -> AsyncGenerator[Any, None]:
    """``RequestOutput``s of a continued request: the replayed steps, then the live ones (module docstring).
    ``run.live`` turns true when the replay is done."""
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import RequestOutputKind
    from vllm.utils.async_utils import merge_async_iterators

    if params.output_kind != RequestOutputKind.DELTA:
        raise ReplayError("resume_steps: only a streamed request continues from its steps")
    original = list(prompt["prompt_token_ids"])
    prompt_text = prompt.get("prompt") if isinstance(prompt.get("prompt"), str) else None
    texts = [Retext(engine.renderer.tokenizer, original, params) for _ in range(params.n)]
    logprobs = params.logprobs is not None

    # the prompt's logprobs (completions' echo) are written with the first step: placeholders, not sent
    prompt_logprobs = cast("Any", [None] * len(original)) if params.prompt_logprobs is not None else None

    def output(outputs: list[Any], finished: bool, first: bool = False) -> Any:
        return RequestOutput(request_id=request_id, prompt=prompt_text, prompt_token_ids=original,
                             prompt_logprobs=prompt_logprobs if first else None, outputs=outputs, finished=finished)

    for k, step in enumerate(replay.steps):
        outs = []
        for index, done, *ids in step:
            # A choice finished before the loss is done: any finish reason puts its parser to rest.
            text, _ids, _, _ = texts[index].step(ids, "length" if done else None, None)
            outs.append(CompletionOutput(index=index, text=text, token_ids=ids, cumulative_logprob=None,
                                         # placeholders: the chunks of a replayed step are not sent
                                         logprobs=cast("Any", [None] * len(ids)) if logprobs else None,
                                         finish_reason="length" if done else None))
        yield output(outs, False, first=k == 0)
    run.live = True
    open_ = [i for i in range(params.n) if not replay.finished(i)]
    spent = [i for i in open_ if params.max_tokens is not None and len(replay.ids(i)) >= params.max_tokens]
    if spent:  # the budget was spent but the finishing chunk was lost with the engine
        open_ = [i for i in open_ if i not in spent]
        yield output([CompletionOutput(index=i, text=texts[i].step([], "length", None)[0], token_ids=[],
                                       cumulative_logprob=None, logprobs=[] if logprobs else None,
                                       finish_reason="length") for i in spent], not open_)
    children: list[AsyncGenerator[Any, None]] = []
    for i in open_:
        ids = replay.ids(i)
        child = params.clone()
        child.n = 1
        if child.max_tokens is not None:
            child.max_tokens -= len(ids)
        child.min_tokens = max(0, child.min_tokens - len(ids))
        child.stop = []  # stop strings are found by Retext, over the whole output
        child.prompt_logprobs = None  # the client had them with the first chunk
        child.extra_args = {**(child.extra_args or {}), RESUME_KEY: ids}
        child_id = request_id if len(open_) == 1 else f"{request_id}-{i}"
        children.append(engine.generate({**prompt, "prompt_token_ids": original + ids}, child, child_id, **kwargs))
    if not children:
        if not spent:  # every choice had finished: only the closing chunks were lost
            yield output([], True)
        return
    pending = set(range(len(children)))
    merged = merge_async_iterators(*children)
    try:
        async for k, res in merged:
            out = res.outputs[0]
            i = open_[k]
            text, ids, finish, stop_reason = texts[i].step(list(out.token_ids), out.finish_reason, out.stop_reason)
            if not ids and finish is None and not text:
                continue  # an empty output (prefill): the uninterrupted stream had none here
            lp = out.logprobs
            if lp is not None and len(ids) < len(out.token_ids):
                lp = lp[:len(ids)]
            if finish is not None:
                pending.discard(k)
                if out.finish_reason is None:  # a stop string across the join: the engine stops here
                    await children[k].aclose()
            yield output([CompletionOutput(index=i, text=text, token_ids=ids, cumulative_logprob=None, logprobs=lp,
                                           finish_reason=finish, stop_reason=stop_reason)], not pending)
            if not pending:
                return
    finally:
        await merged.aclose()
        for child_gen in children:
            await child_gen.aclose()


# --------------------------------------------------------------------------- in the engine core


def resume_ids(params: Any) -> list[int]:
    extra = getattr(params, "extra_args", None) or {}
    ids = extra.get(RESUME_KEY)
    return list(ids) if isinstance(ids, list) else []
