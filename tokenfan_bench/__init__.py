"""``tokenfan bench``: an A/B harness for the gateway's fan-out transports (SSE, WebSocket, over
HTTP/1.1 and HTTP/2), and the gateway's costs beside a floor and beside ``vllm serve``.

One subpackage per job:

- :mod:`.wire`: what a subscriber receives, decoded (pure, sans I/O): SSE events, chunk samples and
  WebSocket frames (``events``), HTTP/1.1 responses (``http1``), the client side of HTTP/2 (``http2``).
- :mod:`.clients`: the subscriber worker processes (``workers``) and their clients: ``fast`` and
  ``fast_h2`` (``--client fast``), ``httpx_websockets`` (``--client python``), the Responses API arms
  (``responses``), headless Chromium (``browser``), all recording through ``recorder``.
- :mod:`.network`: where the bytes travel: the shaping proxy and its profiles (``shaping_proxy``), each
  arm's route (``paths``), nginx in front (``nginx``), ``tokenfan bench net`` (``watch_pages``).
- :mod:`.stats`: per-arm metrics (``metrics``) and the A/B difference with its interval (``ab_difference``).
- :mod:`.report`: one run's outputs (``run_outputs``), ``tokenfan bench report``'s matrix (``matrix``), its
  verdicts (``verdicts``), markdown (``markdown``) and plots (``plots``).
- :mod:`.cpu`: CPU costs: the gateway per token beside the floor (``gateway_cost``, ``tokenfan bench cpu``)
  under its load (``load_client``), the engine-step pass in-process (``step_pass_cost``, ``tokenfan bench
  pass``), the bench client itself (``client_cost``).
- :mod:`.servers`: the raw floor server (``raw_floor``) and the processes the bench and the tests start
  (``processes``).

At the top: :mod:`.cli` (``tokenfan bench``), :mod:`.runner` (one measurement), :mod:`.vs_vllm` (``tokenfan bench
vs-vllm``) and its equal-rate runs (:mod:`.offered_load`).
"""
