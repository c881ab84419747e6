"""``tokenfan bench net``: a gateway's pages through every network profile, for a person to watch.

One shaping proxy (:mod:`tokenfan_bench.network.shaping_proxy`) per profile in front of ``--url``; each profile's RTT
and bandwidth are measured through it, and the ``/ab`` link printed for each carries the whole list
(``?net=NAME&routes=NAME:PORT,…``), so the page's "Network" menu switches between them. Runs until
interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time

from tokenfan_bench.network.shaping_proxy import PROFILES, Shaper, parse_profile


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench net", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--profiles", default=",".join(PROFILES), help=f"default: {','.join(PROFILES)}")
    ap.add_argument("--for", dest="seconds", type=float, default=None, help="stop after this many seconds")
    return ap


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    # Ctrl-C and SIGTERM stop the proxies, also when this runs as a background job (whose shell starts it with
    # SIGINT ignored, and then Python raises no KeyboardInterrupt: Ctrl-C was lost and the run went on)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)  # raises KeyboardInterrupt
    profiles = [parse_profile(p) for p in ns.profiles.split(",") if p.strip()]
    with contextlib.ExitStack() as stack:
        shapers = [stack.enter_context(Shaper(p, [ns.url.rstrip("/")])) for p in profiles]
        routes = ",".join(f"{p.name}:{s.ports[0]}" for p, s in zip(profiles, shapers))
        for p, s in zip(profiles, shapers):
            m = s.probe()
            print(f"{p.name:14} {p.describe()}\n{'':14} measured RTT {m['rtt_ms']:.1f} ms, down "
                  f"{m['down_mbit']:.2f} Mbit/s, up {m['up_mbit']:.2f} Mbit/s\n{'':14} {s.urls[0]}/ab?net={p.name}"
                  f"&routes={routes}", flush=True)
        print("Ctrl-C stops the proxies.", file=sys.stderr, flush=True)
        deadline = time.monotonic() + ns.seconds if ns.seconds else None
        with contextlib.suppress(KeyboardInterrupt):
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.5)
    return 0
