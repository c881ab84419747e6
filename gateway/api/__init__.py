"""The APIs: OpenAI chat/completions, /v1/ws, /v1/streams and the Responses API."""
