"""The Responses API (``/v1/responses``): the request (:mod:`.api`), conversation transcripts (:mod:`.chat`), its
events and their frames (:mod:`.stream`), WebSocket mode (:mod:`.ws`, :mod:`.ws_route`) and the HTTP routes
(:mod:`.routes`)."""
