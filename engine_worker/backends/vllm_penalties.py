"""Presence and frequency penalties over the output a continuation resumed from (a vLLM v1 logits processor).

Imported by vLLM in the engine core (``AsyncEngineArgs(logits_processors=[...])``): it imports vLLM at once.
See :mod:`engine_worker.backends.vllm_resume`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from engine_worker.backends.vllm_resume import resume_ids

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class ResumePenalties(LogitsProcessor):
    """Presence and frequency penalties over the output a continuation resumed from (vLLM's own penalties
    see it as prompt): frequency for every earlier occurrence, presence for tokens the new output has not
    repeated yet (vLLM penalizes those). A v1 logits processor, passed to the engine at start."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, tuple[float, float, dict[int, int], list[int]]] = {}
        self._device = device

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _prompt, output in batch_update.added:
            ids = resume_ids(params)
            if ids and (params.presence_penalty or params.frequency_penalty):
                counts: dict[int, int] = {}
                for t in ids:
                    counts[t] = counts.get(t, 0) + 1
                self._rows[index] = (params.presence_penalty, params.frequency_penalty, counts, output)
            else:
                self._rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self._rows.pop(a, None), self._rows.pop(b, None)
            if row_a is not None:
                self._rows[b] = row_a
            if row_b is not None and direction.name == "SWAP":
                self._rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (presence, frequency, counts, output) in self._rows.items():
            tokens = list(counts)
            index = torch.tensor(tokens, dtype=torch.long, device=logits.device)
            seen = set(output)
            penalty = [frequency * counts[t] + (presence if t not in seen else 0.0) for t in tokens]
            logits[row].index_add_(0, index, -torch.tensor(penalty, dtype=logits.dtype, device=logits.device))
        return logits
