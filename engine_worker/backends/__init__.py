"""Engine backends behind one small Protocol (see :mod:`engine_worker.backends.base`)."""

from __future__ import annotations

from engine_worker.backends.base import Backend, BackendInfo, Prepared, RequestRejected, Step

__all__ = ["Backend", "BackendInfo", "Prepared", "RequestRejected", "Step"]
