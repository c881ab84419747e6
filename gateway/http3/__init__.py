"""HTTP/3 and WebTransport for the gateway (``--http3-port``): a thin adapter in front of the same ASGI app."""
