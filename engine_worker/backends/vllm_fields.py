"""The fields of vLLM's chat and completions request models with their defaults (vLLM 0.32), for the synthetic
engine's refusals without importing vLLM (seconds) on its request path.

Generated from vLLM's models (required fields and ``request_id``, which the gateway sets, left out); ``tests/test_scripted.py`` fails when vLLM's differ:
``python -c "import engine_worker.backends.vllm_fields as m; m.write()"`` regenerates this file.
"""

from __future__ import annotations

from pathlib import Path
from pprint import pformat
from typing import Any

_MARK = "\n# generated:\n"


def from_vllm() -> dict[str, dict[str, Any]]:
    """Endpoint -> {field: default} of vLLM's request models (imports vLLM)."""
    from pydantic_core import PydanticUndefined
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {endpoint: {name: default for name, info in model.model_fields.items()  # request_id: random default
                       if name != "request_id"
                       and (default := info.get_default(call_default_factory=True)) is not PydanticUndefined}
            for endpoint, model in (("chat.completions", ChatCompletionRequest), ("completions", CompletionRequest))}


def write() -> None:
    text = Path(__file__).read_text()
    head = text[:text.index(_MARK)] if _MARK in text else text.rstrip("\n") + "\n\n"
    Path(__file__).write_text(f"{head}{_MARK}DEFAULTS: dict[str, dict[str, Any]] = "
                              f"{pformat(from_vllm(), width=110)}\n")


# generated:
DEFAULTS: dict[str, dict[str, Any]] = {'chat.completions': {'add_generation_prompt': True,
                      'add_special_tokens': False,
                      'allowed_token_ids': None,
                      'bad_words': [],
                      'cache_salt': None,
                      'chat_template': None,
                      'chat_template_kwargs': None,
                      'continue_final_message': False,
                      'documents': None,
                      'ec_transfer_params': None,
                      'echo': False,
                      'frequency_penalty': None,
                      'ignore_eos': False,
                      'include_reasoning': True,
                      'include_stop_str_in_output': False,
                      'kv_transfer_params': None,
                      'length_penalty': 1.0,
                      'logit_bias': None,
                      'logprob_token_ids': None,
                      'logprobs': False,
                      'max_completion_tokens': None,
                      'max_tokens': None,
                      'media_io_kwargs': None,
                      'min_p': None,
                      'min_tokens': 0,
                      'mm_payload': 'tensors',
                      'mm_processor_kwargs': None,
                      'model': None,
                      'n': 1,
                      'parallel_tool_calls': True,
                      'presence_penalty': None,
                      'priority': 0,
                      'prompt_logprobs': None,
                      'reasoning_effort': None,
                      'repetition_detection': None,
                      'repetition_penalty': None,
                      'response_format': None,
                      'return_mm_kwargs': None,
                      'return_prompt_text': None,
                      'return_token_ids': None,
                      'return_token_offsets': False,
                      'return_tokens_as_token_ids': None,
                      'routed_experts_prompt_start': 0,
                      'seed': None,
                      'session_id': None,
                      'skip_special_tokens': True,
                      'spaces_between_special_tokens': True,
                      'stop': [],
                      'stop_token_ids': [],
                      'stream': False,
                      'stream_interval': None,
                      'stream_options': None,
                      'structured_outputs': None,
                      'temperature': None,
                      'thinking_token_budget': None,
                      'tool_choice': 'none',
                      'tools': None,
                      'top_k': None,
                      'top_logprobs': 0,
                      'top_p': None,
                      'truncate_prompt_tokens': None,
                      'truncation_side': None,
                      'use_beam_search': False,
                      'user': None,
                      'vllm_xargs': None,
                      'watermarking': None},
 'completions': {'add_special_tokens': True,
                 'allowed_token_ids': None,
                 'bad_words': [],
                 'cache_salt': None,
                 'ec_transfer_params': None,
                 'echo': False,
                 'frequency_penalty': None,
                 'ignore_eos': False,
                 'include_stop_str_in_output': False,
                 'kv_transfer_params': None,
                 'length_penalty': 1.0,
                 'logit_bias': None,
                 'logprob_token_ids': None,
                 'logprobs': None,
                 'max_tokens': 16,
                 'min_p': None,
                 'min_tokens': 0,
                 'mm_payload': 'tensors',
                 'model': None,
                 'n': 1,
                 'presence_penalty': None,
                 'priority': 0,
                 'prompt': None,
                 'prompt_embeds': None,
                 'prompt_logprobs': None,
                 'repetition_detection': None,
                 'repetition_penalty': None,
                 'response_format': None,
                 'return_mm_kwargs': None,
                 'return_token_ids': None,
                 'return_token_offsets': False,
                 'return_tokens_as_token_ids': None,
                 'routed_experts_prompt_start': 0,
                 'seed': None,
                 'session_id': None,
                 'skip_special_tokens': True,
                 'spaces_between_special_tokens': True,
                 'stop': [],
                 'stop_token_ids': [],
                 'stream': False,
                 'stream_interval': None,
                 'stream_options': None,
                 'structured_outputs': None,
                 'suffix': None,
                 'temperature': None,
                 'thinking_token_budget': None,
                 'top_k': None,
                 'top_p': None,
                 'truncate_prompt_tokens': None,
                 'truncation_side': None,
                 'use_beam_search': False,
                 'user': None,
                 'vllm_xargs': None,
                 'watermarking': None}}
