"""The bench's subscribers: worker processes, their HTTP/1.1, HTTP/2 and WebSocket clients, the Responses API
arms and the browser arm, all recording through :mod:`.recorder`."""
