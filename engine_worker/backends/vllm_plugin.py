"""vLLM general plugin (entry point ``vllm.general_plugins``): AMX for vLLM's CPU kernels, and continuations.

vLLM loads general plugins in every process (front end, engine core, workers). This one:

* lets a continued request's grammar start where the lost engine's was
  (:func:`engine_worker.backends.vllm_grammar.install`, in the engine core; on a vLLM it was not written
  for it logs why and patches nothing);
* asks the kernel for AMX (below).

On Linux a process must ask the kernel for permission to use the AMX tile registers
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``); PyTorch does so lazily inside its own AMX paths, but vLLM's CPU
attention/GEMM kernels and oneDNN bfloat16 paths may execute AMX instructions first and die with
SIGILL. vLLM loads general plugins in every process (front end, engine core, workers), so this is the
one hook that runs inside the worker before the model loads. It is a no-op without AMX (older CPUs,
ARM) and harmless on GPU machines.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register() -> None:
    """Install the grammar's resume hook; request AMX permission for this process when the CPU has AMX."""
    import torch

    from engine_worker.backends import vllm_grammar

    vllm_grammar.install()

    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    init = getattr(torch.cpu, "_init_amx", None)
    if supported is None or init is None or not supported():
        return
    if init():
        log.debug("AMX tile permission granted")
    else:
        log.warning("the CPU has AMX but the kernel refused permission; bfloat16 on CPU may crash")
