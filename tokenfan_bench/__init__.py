"""``tokenfan bench``: an A/B harness for the gateway's fan-out transports (SSE, WebSocket, over
HTTP/1.1 and HTTP/2).

Pure modules: :mod:`.wire` (SSE events, chunk samples, WebSocket frames), :mod:`.http1` (HTTP/1.1
responses, chunked), :mod:`.h2wire` (a minimal HTTP/2 client), :mod:`.stats` (metrics and bootstrap
statistics). Clients: :mod:`.fastclient` and :mod:`.h2client` (``--client fast``), :mod:`.pyclient`
(``--client python``), both recording through :mod:`.record`; :mod:`.clients` (worker processes),
:mod:`.runner` (one measurement). Servers: :mod:`.raw_server` (the floor), :mod:`.procs` (spawned
engines, gateways, raw servers). :mod:`.report` (results.json, summary.md, plots), :mod:`.cli`,
:mod:`.clientcost` (client CPU per event).
"""
