"""A scripted model under vLLM's OpenAI layer: the synthetic engine's tool calls and reasoning.

With ``--synthetic-script FILE`` and ``--model DIR`` (a local model directory; only its tokenizer and chat
template are read, never its weights), the synthetic engine serves every request beyond plain text through
vLLM's own OpenAI layer (:mod:`engine_worker.backends.vllm_openai`), exactly as the vLLM engine does, with
:class:`ScriptedEngine` where ``AsyncLLM`` would be. The "model" writes the script's reply to the request,
one engine step per piece, so vLLM's real tool and reasoning parsers meet a Hermes ``<tool_call>`` block or
a ``<think>`` section split wherever the script splits it. Agent clients can be tested without a model.

The script is a JSON list of ``{"match": REGEX, "reply": [PIECE, ...]}``: the first entry whose regex is
found in the rendered prompt answers (list the more specific entries first); a prompt no entry matches
gets the corpus text of the synthetic engine. The reply stops at ``max_tokens`` tokens (finish ``length``)
or at its end (finish ``stop``). The script *is* the output: sampling, stop strings and structured-output
constraints do not change it. A continuation (``tokenfan_resume`` in ``SamplingParams.extra_args``, see
:mod:`engine_worker.backends.vllm_resume`) plays the rest of the reply after the ids it resumes from. Requests
for what only a model has (``logprobs``, ``n`` > 1, beam search)
are refused with a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_worker.backends.vllm_resume import resume_ids
from engine_worker.config import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Entry:
    match: re.Pattern[str]
    reply: tuple[str, ...]


def load_script(path: str | Path) -> list[Entry]:
    """The entries of a script file; a clear ``ValueError`` for a malformed one (checked at start-up)."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--synthetic-script {path}: {exc}") from None
    if not isinstance(raw, list):
        raise TypeError(f"--synthetic-script {path}: a JSON list of {{\"match\", \"reply\"}} objects expected")
    entries = []
    for i, item in enumerate(raw):
        reply = item.get("reply") if isinstance(item, dict) else None
        if not (isinstance(item, dict) and isinstance(item.get("match"), str) and isinstance(reply, list)
                and reply and all(isinstance(piece, str) for piece in reply)):
            raise ValueError(f"--synthetic-script {path}: entry {i} needs \"match\" (a regex) and \"reply\" "
                             "(a non-empty list of strings)")
        try:
            entries.append(Entry(re.compile(item["match"]), tuple(reply)))
        except re.error as exc:
            raise ValueError(f"--synthetic-script {path}: entry {i}: bad regex: {exc}") from None
    return entries


class ScriptedEngine:
    """What vLLM's serving classes use of ``AsyncLLM`` (config, renderer, ``generate``), with a script for
    a model. Built from the model directory's configuration alone: no weights, no engine process."""

    def __init__(self, config: EngineConfig, model_dir: Path, model_name: str, script: list[Entry],
                 fallback: tuple[str, ...]) -> None:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        from engine_worker.backends import vllm_openai

        self.vllm_config = EngineArgs(
            model=str(model_dir), served_model_name=[model_name], max_model_len=config.max_model_len,
            dtype="float32", reasoning_parser=config.reasoning_parser or "",
            structured_outputs_config=vllm_openai.structured_outputs_config(config),
        ).create_engine_config()
        self.model_config = self.vllm_config.model_config
        self.renderer = renderer_from_config(self.vllm_config)
        self.input_processor = InputProcessor(self.vllm_config, self.renderer)
        self.tokenizer = self.renderer.tokenizer
        self.errored = False
        self.dead_error = RuntimeError("the scripted engine does not fail")
        self._script = script
        self._fallback = fallback
        self._interval = 1.0 / config.synthetic_tokens_per_s
        self._ttft = config.synthetic_ttft_ms / 1000.0

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        return None

    async def abort(self, request_id: str | list[str], *_: Any, **__: Any) -> None:
        return None  # generate() is a plain async generator: closing it is the abort

    def reply_for(self, prompt_text: str) -> tuple[str, ...]:
        for entry in self._script:
            if entry.match.search(prompt_text):
                return entry.reply
        return self._fallback

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **_: Any) -> AsyncGenerator[Any, None]:
        """The script's reply as vLLM's ``RequestOutput``s: one per piece (``DELTA``), the running text
        (``CUMULATIVE``) or one at the end (``FINAL_ONLY``), paced like the synthetic engine. What only a
        model can produce is refused here, before the stream (a 400 naming the field)."""
        from vllm.exceptions import VLLMValidationError

        for name, wanted in (("logprobs", sampling_params.logprobs is not None),
                             ("prompt_logprobs", sampling_params.prompt_logprobs is not None),
                             ("n", sampling_params.n != 1)):
            if wanted:
                raise VLLMValidationError(f"the scripted synthetic engine has no model: `{name}` needs "
                                          "--engine vllm", parameter=name)
        return self._reply(prompt, sampling_params, request_id)

    async def _reply(self, prompt: Any, sampling_params: Any, request_id: str) -> AsyncGenerator[Any, None]:
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind

        prompt_ids = list(prompt.get("prompt_token_ids") or ()) if isinstance(prompt, dict) else []
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        resumed = len(resume_ids(sampling_params))
        prompt_text = text if isinstance(text, str) else \
            self.tokenizer.decode(prompt_ids[:len(prompt_ids) - resumed] if resumed else prompt_ids)
        budget = sampling_params.max_tokens if sampling_params.max_tokens is not None else 1 << 30
        steps: list[tuple[str, list[int]]] = []  # (text, token ids) of each engine step
        used, finish = 0, "stop"
        skip = resumed  # a continuation: the reply goes on after what was delivered
        for piece in self.reply_for(prompt_text):
            ids = self.tokenizer.encode(piece, add_special_tokens=False)
            if skip:
                cut = min(skip, len(ids))
                skip -= cut
                ids = ids[cut:]
                piece = self.tokenizer.decode(ids) if ids else ""
            if used + len(ids) > budget:
                ids, finish = ids[:budget - used], "length"
                if ids:
                    steps.append((self.tokenizer.decode(ids), ids))
                break
            if ids:
                steps.append((piece, ids))
                used += len(ids)
        kind = sampling_params.output_kind
        all_ids: list[int] = []
        all_text = ""
        start = time.monotonic() + self._ttft
        for i, (delta, ids) in enumerate(steps or [("", [])]):
            delay = start + (len(all_ids) + len(ids)) * self._interval - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            all_ids += ids
            all_text += delta
            last = i == len(steps) - 1 or not steps
            if kind == RequestOutputKind.FINAL_ONLY and not last:
                continue
            cumulative = kind != RequestOutputKind.DELTA
            out = CompletionOutput(index=0, text=all_text if cumulative else delta,
                                   token_ids=list(all_ids) if cumulative else ids, cumulative_logprob=None,
                                   logprobs=None, finish_reason=finish if last else None)
            yield RequestOutput(request_id=request_id, prompt=prompt_text, prompt_token_ids=prompt_ids,
                                prompt_logprobs=None, outputs=[out], finished=last)
