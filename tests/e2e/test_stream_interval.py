"""--stream-interval end to end: a synthetic engine started with it sends the same text in fewer,
larger chunks (first token at once, then every N tokens, the finish at once), usage unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.procs import start_engine, start_gateway


@pytest.fixture(scope="module")
def interval_gateway_url(ipc_dir: Path) -> Iterator[str]:
    address = f"ipc://{ipc_dir / 'synthetic-interval.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-ttft-ms", "5",
                          "--synthetic-tokens-per-s", "400", "--stream-interval", "4", name="engine-interval")
    gateway, url = start_gateway(address, name="gateway-interval")
    yield url
    gateway.stop()
    engine.stop()


def _stream(url: str) -> list[openai.types.chat.ChatCompletionChunk]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    return list(client.chat.completions.create(
        model="synthetic", messages=[{"role": "user", "content": "same"}], max_tokens=10, seed=5, stream=True,
        stream_options={"include_usage": True}))


def test_stream_interval_merges_tokens_into_fewer_chunks_without_losing_text(
        interval_gateway_url: str, gateway_url: str) -> None:
    merged, single = _stream(interval_gateway_url), _stream(gateway_url)

    def contents(chunks: list[openai.types.chat.ChatCompletionChunk]) -> list[str]:
        return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]

    assert "".join(contents(merged)) == "".join(contents(single))
    assert single[-1].usage is not None and single[-1].usage.completion_tokens == 10
    assert len(contents(merged)) < len(contents(single)) <= 10
    # 1 + 4 + 4 + the finishing 1 when every engine step is one token; a step that carries several tokens
    # (the synthetic engine catches up after a late wake-up) can only reduce the count.
    assert 2 <= len(contents(merged)) <= 4
    assert merged[-2].choices[0].finish_reason == "length"
    assert merged[-1].usage is not None and merged[-1].usage.completion_tokens == 10
