"""Where each arm's bytes travel: straight to the gateway, through nginx (``--via``, or per arm
``--arms sse,sse@nginx``) and through the shaping proxy (``--net``, :mod:`tokenfan_bench.network.shaping_proxy`).

Every arm gets its own route through the shaping proxy (same profile, same path jitter), so the bytes
on the wire are counted per arm; stream creation (``POST /v1/streams``) has a route of its own, and the
server's ``/metrics`` is read directly (never shaped). With ``--net`` the profile's RTT and bandwidth
are measured once through the proxy (:func:`tokenfan_bench.network.shaping_proxy.probe`) and reported beside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenfan_bench.network.nginx import VARIANTS, nginx_in_front
from tokenfan_bench.network.shaping_proxy import Profile, Shaper
from tokenfan_bench.stats.metrics import ArmSamples

VIAS = ("direct", *VARIANTS)


def split_arm(spec: str) -> tuple[str, str | None]:
    """``sse@nginx`` -> ``("sse", "nginx")``; ``sse`` -> ``("sse", None)`` (the run's ``--via``)."""
    transport, _, via = spec.partition("@")
    if via and via not in VIAS:
        raise ValueError(f"arm {spec!r}: unknown path {via!r} (one of {', '.join(VIAS)})")
    return transport, via or None


@dataclass
class Paths:
    """The URLs of one run's arms and the proxy counting their bytes."""

    gateway_url: str
    post_url: str
    arm_urls: tuple[str, ...]
    vias: tuple[str, ...]
    shaper: Shaper | None = None
    info: dict[str, Any] = field(default_factory=dict)
    last_stats: list[dict[str, Any]] = field(default_factory=list)

    def start_counting(self) -> None:
        if self.shaper is not None:
            self.shaper.reset()

    def stop_counting(self) -> None:
        if self.shaper is not None:
            self.last_stats = self.shaper.stats()

    def mark_jitter(self, arms: Iterable[ArmSamples]) -> None:
        """Give each event of ``arms`` the path jitter the proxy added to it (:attr:`ArmSamples.path_ns`),
        looked up at the gateway's send stamp (the engine's, where the event has none). Without a
        shaping proxy, nothing."""
        if self.shaper is None:
            return
        for a in arms:
            a.path_ns = np.array(self.shaper.down_jitter_ns(np.where(a.sent_ns > 0, a.sent_ns, a.emit_ns).tolist()))

    def wire(self, result: dict[str, Any]) -> dict[str, Any] | None:
        """Bytes on the wire per delivered token, per arm, from the last run's route counters (None
        without a shaping proxy). ``deflated``: the down bytes deflated per read with a sync flush
        (plaintext routes only: what a compressing transport would at best send)."""
        if not self.last_stats:
            return None
        out: dict[str, Any] = {"post": self.last_stats[0]}
        for (arm, metrics), via, stats in zip(result["arms"].items(), self.vias, self.last_stats[1:]):
            tokens = metrics["deltas_delivered"]
            plaintext = self.arm_urls[list(result["arms"]).index(arm)].startswith("http:")
            out[arm] = {"transport": metrics["transport"], "via": via, "tls": not plaintext, **stats,
                        "down_bytes_per_token": stats["down_bytes"] / tokens if tokens else None,
                        "up_bytes_per_token": stats["up_bytes"] / tokens if tokens else None,
                        "deflated_down_bytes_per_token": (stats["down_deflated"] / tokens
                                                          if tokens and plaintext else None)}
        return out


@contextlib.contextmanager
def open_paths(gateway_url: str, vias: tuple[str, ...], net: Profile | None, log_dir: Path,
               seed: int = 0, probe: bool = True) -> Iterator[Paths]:
    """Start nginx for every ``via`` that needs one and the shaping proxy for ``net`` (also started,
    unshaped, just to count bytes when ``net`` is the ``none`` profile); stop them afterwards."""
    gateway_url = gateway_url.rstrip("/")
    with contextlib.ExitStack() as stack:
        via_urls = {"direct": gateway_url}
        for via in dict.fromkeys(vias):
            if via != "direct":
                via_urls[via] = stack.enter_context(nginx_in_front(gateway_url, via, log_dir))
        upstreams = [via_urls[vias[0]], *(via_urls[v] for v in vias)]
        info: dict[str, Any] = {"vias": {v: via_urls[v] for v in dict.fromkeys(vias)}, "profile": None}
        if net is None:
            yield Paths(gateway_url, upstreams[0], tuple(upstreams[1:]), vias, info=info)
            return
        shaper = stack.enter_context(Shaper(net, upstreams, seed=seed))
        info["profile"] = {"name": net.name, "spec": net.spec(), "describe": net.describe(),
                           "measured": shaper.probe() if probe else None}
        yield Paths(gateway_url, shaper.urls[0], tuple(shaper.urls[1:]), vias, shaper, info)
