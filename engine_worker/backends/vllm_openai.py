"""``vllm serve``'s own OpenAI layer, run inside the engine worker for requests that need more than text.

tokenfan's plain path (text in, text deltas out, chunks built by the gateway) covers chat and
completions requests made only of messages/prompt and the common sampling fields. Everything else that
``vllm serve`` accepts (tools and ``tool_choice``, ``response_format`` and ``structured_outputs``,
logprobs, ``n`` > 1, ``echo``, ``logit_bias``, ``min_p`` …, and every chat request when a tool or
reasoning parser is configured) goes through vLLM's classes, unchanged:

* the body is validated by vLLM's pydantic request models (``ChatCompletionRequest`` /
  ``CompletionRequest``), so refusals have vllm serve's status and message;
* ``OpenAIServingChat`` / ``OpenAIServingCompletion`` render the prompt (tools in the chat template),
  build the sampling parameters (structured outputs, logit bias …), drive :class:`AsyncLLM` and run
  vLLM's tool and reasoning parsers (``vllm.parser``);
* their output, the exact chunk JSON vllm serve would write after ``data:``, goes to the gateway as
  :attr:`engine_worker.protocol.Delta.chunk`, one per chunk, and the gateway frames it for every
  transport. A non-streamed request gets the whole response object as one chunk.

The serving classes call ``engine_client.generate``; :class:`_ObservedEngine` wraps the
:class:`AsyncLLM` so that call reports the request's prompt length (the engine's ``Accepted``) and the
tokens each step produced (token counts for the gateway's metrics).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import orjson

from engine_worker.backends.base import Prepared, RequestRejected, Step
from engine_worker.backends.vllm_resume import Replay, ReplayError, resumed, step_record
from engine_worker.plain_path import is_plain
from engine_worker.protocol import Endpoint, EngineSteps, FinishReason, Submit
from engine_worker.tracing import trace_headers

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from engine_worker.config import EngineConfig

log = logging.getLogger(__name__)

def decode_body(raw: bytes) -> dict[str, Any]:
    """The request object the gateway forwarded (it already checked it is a JSON object)."""
    body = orjson.loads(raw)
    if not isinstance(body, dict):
        raise RequestRejected("the request body must be a JSON object", param="body")
    return body


@dataclass(slots=True)
class _Run:
    """One request in vLLM's layer: set by :meth:`_ObservedEngine.generate`."""

    accepted: asyncio.Future[int]  # the prompt length, once vLLM submitted the request
    tokens: int = 0  # generated tokens not yet reported with a chunk
    finish: FinishReason = "stop"  # the last choice's finish reason, for the engine's log and Delta
    outputs: AsyncGenerator[Any, None] | None = None  # the engine's output stream, closed on abort
    replay: Replay | None = None  # a continuation: the delivered steps (engine_worker.backends.vllm_resume)
    live: bool = True  # False while a continuation's replay runs: the chunks written for it are not sent
    steps: EngineSteps = field(default_factory=list)  # steps not yet reported with a chunk
    trace_headers: dict[str, str] | None = None  # the gateway's trace context: vLLM's request span joins it
    # a continuation's suffix of its engine request id (".a1"): its id in vLLM's engine, so that aborting the
    # request it continues (an orphan of a killed gateway, on this engine) does not abort it; chunks keep the
    # generation's id (the serving layer's own)
    suffix: str = ""


_CONTINUATION = re.compile(r"(\.[am]\d+)+$")  # a continuation's suffixes: .m<k> (migrated), .a<k> (adopted)
_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("tokenfan_openai_run", default=None)
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", "error": "error",
                                    "tool_calls": "stop", "repetition": "stop"}


class _ObservedEngine:
    """The :class:`AsyncLLM` as vLLM's serving classes see it, with ``generate`` observed."""

    def __init__(self, engine: AsyncLLM) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> AsyncGenerator[Any, None]:
        from vllm.renderers.inputs.preprocess import extract_prompt_len

        run = _RUN.get()
        if run is None:  # not one of ours (vLLM-internal use): unobserved
            return self._engine.generate(prompt, sampling_params, request_id, **kwargs)
        if run.trace_headers:  # the gateway's generation span: vLLM's llm_request span is its child
            kwargs["trace_headers"] = run.trace_headers
        request_id += run.suffix
        if run.replay is not None:
            if run.accepted.done():  # a second prompt (a completions batch): one replay cannot feed two
                raise ReplayError("a continued request has one prompt")
            stream = resumed(self._engine, prompt, sampling_params, request_id, run.replay, run, **kwargs)
        else:
            stream = self._engine.generate(prompt, sampling_params, request_id, **kwargs)
        if not run.accepted.done():
            run.accepted.set_result(int(extract_prompt_len(self._engine.model_config, prompt)))
        run.outputs = _counted(stream, run)
        return run.outputs


async def _counted(stream: AsyncGenerator[Any, None], run: _Run) -> AsyncGenerator[Any, None]:
    try:
        async for out in stream:
            if run.live:  # replayed steps were counted and recorded by the lost engine
                run.tokens += sum(len(o.token_ids) for o in out.outputs)
                run.steps.append(step_record(out.outputs))
            yield out
    finally:
        await stream.aclose()


@dataclass(slots=True)
class Started:
    """A request vLLM's layer accepted: its output is :meth:`OpenAILayer.steps`."""

    run: _Run
    task: asyncio.Task[Any]  # create_chat_completion / create_completion
    stream: bool
    prompt_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)


class OpenAILayer:
    """vLLM's ``OpenAIServingChat`` and ``OpenAIServingCompletion`` over this worker's :class:`AsyncLLM`,
    configured as ``vllm serve`` would be with the same flags."""

    def __init__(self, config: EngineConfig, engine: AsyncLLM, model_name: str, model_path: str,
                 chat_template: str | None) -> None:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.renderers.online_renderer import OnlineRenderer

        observed: Any = _ObservedEngine(engine)
        reasoning = config.reasoning_parser or ""
        models = OpenAIServingModels(engine_client=observed,
                                     base_model_paths=[BaseModelPath(name=model_name, model_path=model_path)])
        renderer = OnlineRenderer(
            model_config=engine.model_config, renderer=engine.renderer, request_logger=None,
            chat_template=chat_template, chat_template_content_format="auto",
            trust_request_chat_template=False, trust_request_mm_kwargs=False,
            enable_auto_tools=config.enable_auto_tool_choice, exclude_tools_when_tool_choice_none=False,
            tool_parser=config.tool_call_parser, tool_strict_level="auto", reasoning_parser=reasoning,
            default_chat_template_kwargs=None, log_error_stack=False,
        )
        self.chat = OpenAIServingChat(
            observed, models, "assistant", online_renderer=renderer, request_logger=None,
            chat_template=chat_template, chat_template_content_format="auto",
            enable_auto_tools=config.enable_auto_tool_choice, tool_parser=config.tool_call_parser,
            reasoning_parser=reasoning,
        )
        self.completion = OpenAIServingCompletion(observed, models, online_renderer=renderer, request_logger=None)
        self.renderer = renderer
        self.parsers = bool(config.tool_call_parser or reasoning)
        self.config = config
        self.vocab_size = int(engine.model_config.get_vocab_size())
        self.model_name = model_name

    def wants(self, endpoint: Endpoint, body: dict[str, Any]) -> bool:
        """Whether this request takes vLLM's layer: it is not plain, or a parser reads every chat output."""
        return (self.parsers and endpoint == "chat.completions") or not is_plain(body)

    async def prepare(self, submit: Submit, body: dict[str, Any]) -> Prepared | None:
        """``submit`` started in this layer (:meth:`start`), or None when it takes the backend's plain path."""
        if not self.wants(submit.endpoint, body):
            return None
        started = await self.start(submit, body)
        return Prepared(submit=submit, prompt_tokens=started.prompt_tokens, payload=started, openai=True)

    async def start(self, submit: Submit, body: dict[str, Any]) -> Started:
        """Validate, render and submit ``body``; returns once vLLM handed the request to the engine.

        Raises :class:`RequestRejected` with vllm serve's status and message."""
        request = self._validate(submit, body)
        continuation = _CONTINUATION.search(submit.request_id)
        run = _Run(asyncio.get_running_loop().create_future(), trace_headers=trace_headers(self.config, submit),
                   suffix=continuation.group(0) if continuation else "")
        if submit.resume_steps:
            try:
                run.replay = Replay.parse(submit.resume_steps, int(getattr(request, "n", 1) or 1), self.vocab_size)
            except ReplayError as exc:
                raise RequestRejected(str(exc), param="resume_steps") from None
            run.live = False
        token = _RUN.set(run)
        try:
            create = (self.chat.create_chat_completion if submit.endpoint == "chat.completions"
                      else self.completion.create_completion)
            task = asyncio.ensure_future(create(request))  # type: ignore[arg-type]
        finally:
            _RUN.reset(token)
        waits: list[asyncio.Future[Any]] = [task, run.accepted]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not run.accepted.done():  # refused before reaching the engine
            raise _rejection(_outcome(task))
        return Started(run=run, task=task, stream=bool(request.stream), prompt_tokens=run.accepted.result())

    async def render_plain_chat(self, submit: Submit) -> list[int]:
        """The prompt token ids of a plain chat request, rendered exactly as ``vllm serve`` renders its
        messages: vLLM's request model and ``OnlineRenderer.render_chat`` (content parts parsed and joined as
        the template's content format requires, template kwargs, tokenization and the context-length check).

        Raises :class:`RequestRejected` with vllm serve's message (context length: ``context_length_exceeded``)."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMValidationError

        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else [{"type": "text", "text": t} for t in m.content]} for m in submit.messages or ()]
        try:
            request = ChatCompletionRequest.model_validate(
                {"model": self.model_name, "messages": messages, "max_tokens": submit.sampling.max_tokens})
            rendered = await self.renderer.render_chat(request)
        except ValidationError as exc:
            raise _validation_rejection(exc) from None
        except VLLMValidationError as exc:
            if exc.parameter in ("input_tokens", "input_text"):
                raise RequestRejected(str(exc.args[0]), code="context_length_exceeded", param="messages") from None
            raise _rejection(_error_response(exc)) from None
        except Exception as exc:  # noqa: BLE001 - as vllm serve's handlers answer it (a template error: 400)
            raise _rejection(_error_response(exc)) from None
        if not isinstance(rendered, tuple):  # an ErrorResponse
            raise _rejection(rendered)
        _conversation, (engine_input, *_) = rendered
        return list(cast("dict[str, Any]", engine_input)["prompt_token_ids"])  # a decoder-only prompt

    def _validate(self, submit: Submit, body: dict[str, Any]) -> Any:
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.exceptions import VLLMClientError

        kind = ChatCompletionRequest if submit.endpoint == "chat.completions" else CompletionRequest
        obj = dict(body)
        if submit.stream:  # /v1/ws and /v1/streams always stream, whatever the body says
            obj["stream"] = True
        # vLLM's ids are "chatcmpl-<this>" / "cmpl-<this>": the gateway's generation id, as vllm serve's (a
        # continuation's engine request id is "<generation id>.m<k>" or ".a<k>": its chunks keep the generation's id).
        obj["request_id"] = _CONTINUATION.sub("", submit.request_id.split("-", 1)[-1])
        obj["model"] = self.model_name  # the gateway checked the name the client sent
        if obj.get("max_tokens") is None and obj.get("max_completion_tokens") is None:
            obj["max_tokens"] = submit.sampling.max_tokens  # tokenfan's --default-max-tokens
        try:
            return kind.model_validate(obj)
        except ValidationError as exc:
            raise _validation_rejection(exc) from None
        except (ValueError, TypeError, VLLMClientError) as exc:  # vLLM's validators raise VLLMValidationError
            raise _rejection(_error_response(exc)) from None

    async def steps(self, started: Started) -> AsyncIterator[Step]:
        """The request's chunks as steps (``Step.chunk``), then one end step with its finish reason."""
        run = started.run
        try:
            await asyncio.wait([started.task])
            result = _outcome(started.task)
            if not started.stream or not hasattr(result, "__aiter__"):
                yield self._whole(result, run)
                return
            async for line in result:
                data = line[6:].rstrip("\n")  # "data: {...}\n\n"
                if data == "[DONE]":
                    break
                chunk = data.encode()
                if data.startswith('{"error"'):
                    raise _rejection_from_json(chunk)
                if not run.live:  # written for a replayed step: the client has it
                    continue
                self._note_finish(chunk, run)
                tokens, run.tokens = run.tokens, 0
                steps, run.steps = run.steps, []
                yield Step(text="", token_count=tokens, chunk=chunk, steps=steps)
            yield Step(text="", token_count=run.tokens, finish_reason=run.finish, steps=run.steps)
        finally:
            if not started.task.done():
                started.task.cancel()
            elif not started.task.cancelled() and started.task.exception() is None:
                result = started.task.result()
                if hasattr(result, "aclose"):
                    await result.aclose()
            if run.outputs is not None:
                await run.outputs.aclose()  # AsyncLLM aborts a request whose output stream closes early

    def _whole(self, result: Any, run: _Run) -> Step:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if isinstance(result, ErrorResponse):
            raise _rejection(result)
        obj = result.model_dump()
        for choice in obj.get("choices", ()):
            run.finish = _FINISH.get(str(choice.get("finish_reason")), "stop")
        # OPT_NON_STR_KEYS: prompt_logprobs are keyed by token id (vllm serve's json.dumps makes them strings)
        return Step(text="", token_count=run.tokens, finish_reason=run.finish,
                    chunk=orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS))

    @staticmethod
    def _note_finish(chunk: bytes, run: _Run) -> None:
        if b'"finish_reason":"' in chunk:
            for choice in orjson.loads(chunk).get("choices", ()):
                if choice.get("finish_reason"):
                    run.finish = _FINISH.get(choice["finish_reason"], "stop")


def _outcome(task: asyncio.Task[Any]) -> Any:
    """A finished serving call's result; an exception it raised becomes the ``ErrorResponse`` vllm serve's
    exception handlers would answer with (``create_error_response``: status by exception class)."""
    exc = task.exception()
    if exc is None:
        return task.result()
    if not isinstance(exc, Exception):
        raise exc
    return _error_response(exc)


def _error_response(exc: Exception) -> Any:
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    log.debug("vLLM's OpenAI layer raised %s: %s", type(exc).__name__, exc)
    return create_error_response(exc)


def _rejection(result: Any) -> RequestRejected:
    error = result.error
    status = int(error.code) if isinstance(error.code, int) else 400
    return RequestRejected(error.message, code="invalid_request" if status < 500 else "engine_error",
                           param=error.param, status=status, type=error.type)


def _rejection_from_json(chunk: bytes) -> RequestRejected:
    error = orjson.loads(chunk)["error"]
    status = error.get("code") if isinstance(error.get("code"), int) else 500
    return RequestRejected(str(error.get("message")), code="engine_error" if status >= 500 else "invalid_request",
                           param=error.get("param"), status=status, type=str(error.get("type") or ""))


def _validation_rejection(exc: Any) -> RequestRejected:
    """A pydantic error as vllm serve's handler words it (``vllm...handlers.validation``)."""
    from vllm.entrypoints.serve.exception_handling.handlers.validation import (
        _format_error,
        clean_loc_for_param,
    )
    from vllm.exceptions import VLLMValidationError

    errors = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]
    param = None
    for e in errors:
        ctx_error = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_error, VLLMValidationError):
            param = ctx_error.parameter
            break
    if param is None and errors:
        param = clean_loc_for_param(tuple(errors[0]["loc"]))
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {_format_error(e)}\n" for e in errors[:10])
    return RequestRejected(message.rstrip(), param=param, status=400, type="Bad Request")


def check_parser_flags(config: EngineConfig) -> None:
    """vllm serve's start-up checks of the parser flags (a bad name fails the start, not a request)."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    if config.tool_parser_plugin:
        ToolParserManager.import_tool_parser(config.tool_parser_plugin)
    if config.enable_auto_tool_choice and not config.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if config.tool_call_parser and config.tool_call_parser not in ToolParserManager.list_registered():
        raise ValueError(f"invalid --tool-call-parser {config.tool_call_parser!r}; choose from "
                         f"{', '.join(sorted(ToolParserManager.list_registered()))}")
    if config.reasoning_parser and config.reasoning_parser not in ReasoningParserManager.list_registered():
        raise ValueError(f"invalid --reasoning-parser {config.reasoning_parser!r}; choose from "
                         f"{', '.join(sorted(ReasoningParserManager.list_registered()))}")


def structured_outputs_config(config: EngineConfig) -> Any:
    """vLLM's ``StructuredOutputsConfig`` from ``--structured-outputs-config`` JSON and ``--reasoning-parser``
    (vllm serve keeps the reasoning parser in it too)."""
    from vllm.config import StructuredOutputsConfig

    value = json.loads(config.structured_outputs_config or "{}")
    if not isinstance(value, dict):
        raise TypeError("--structured-outputs-config must be a JSON object")
    if config.reasoning_parser:
        value.setdefault("reasoning_parser", config.reasoning_parser)
    return StructuredOutputsConfig(**value)
