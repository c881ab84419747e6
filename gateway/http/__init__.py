"""Server plumbing: the ASGI app, middleware, auth, per-client limits, access log, service endpoints."""
