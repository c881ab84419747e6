"""Chat and completions, OpenAI-compatible: the request (:mod:`.request`), its chunks (:mod:`.render`), their
frames on every path (:mod:`.framing`) and the routes: POST (:mod:`.routes`), ``/v1/streams`` (:mod:`.fanout`),
``/v1/ws`` (:mod:`.ws_mux`)."""
