"""tokenfan engine worker: runs an LLM backend and publishes token deltas over ZeroMQ."""
