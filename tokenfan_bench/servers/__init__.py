"""Servers and processes the bench (and the test suite) start: the raw floor server, engines and gateways."""
