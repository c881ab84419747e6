"""``tokenfan bench``: an A/B harness for the gateway's fan-out transports (SSE vs WebSocket).

Modules: :mod:`.wire` (pure decoding of what subscribers receive), :mod:`.stats` (pure metrics and
bootstrap statistics), :mod:`.clients` (the subscriber processes), :mod:`.raw_server` (the floor:
a minimal server writing pre-encoded frames), :mod:`.procs` (spawned engines, gateways, raw
servers), :mod:`.report` (results.json, summary.md, plots, the printed table), :mod:`.cli`.
"""
