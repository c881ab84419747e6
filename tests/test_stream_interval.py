"""The engine's stream interval: steps of one request merged into deltas of at least N tokens."""

from __future__ import annotations

from engine_worker.backends.base import Step
from engine_worker.server import IntervalMerger


def _push_all(interval: int, steps: list[Step]) -> list[Step]:
    merger = IntervalMerger(interval)
    return [out for s in steps if (out := merger.push(s)) is not None]


def test_interval_one_sends_every_step_unchanged() -> None:
    steps = [Step("a", 1), Step("b", 1), Step("c", 1, "stop")]
    assert _push_all(1, steps) == steps


def test_first_step_goes_out_at_once_then_every_n_tokens() -> None:
    steps = [Step(t, 1) for t in "abcdefg"] + [Step("h", 1, "length")]
    sent = _push_all(3, steps)
    assert [s.text for s in sent] == ["a", "bcd", "efg", "h"]
    assert [s.token_count for s in sent] == [1, 3, 3, 1]


def test_finish_flushes_held_text_with_the_finish_reason() -> None:
    sent = _push_all(4, [Step("a", 1), Step("b", 1), Step("c", 1, "stop")])
    assert sent == [Step("a", 1), Step("bc", 2, "stop")]


def test_no_text_is_lost_or_repeated() -> None:
    steps = [Step(str(i % 10), 1 + i % 2) for i in range(50)] + [Step("", 0, "stop")]
    for interval in (1, 2, 5, 16, 100):
        sent = _push_all(interval, steps)
        assert "".join(s.text for s in sent) == "".join(s.text for s in steps)
        assert sum(s.token_count for s in sent) == sum(s.token_count for s in steps)
        assert sent[-1].finish_reason == "stop"
        assert all(s.token_count >= interval for s in sent[1:-1])


def test_steps_of_several_tokens_pass_through_when_they_reach_the_interval() -> None:
    # vLLM applies the same interval itself: its deltas then already carry N tokens.
    steps = [Step("a", 1), Step("bcd", 3), Step("efg", 3), Step("h", 1, "stop")]
    assert _push_all(3, steps) == steps
