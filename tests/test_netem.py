"""The shaping proxy's model (tokenfan_bench/network/shaping_proxy.py): delay, bandwidth, jitter and stall arithmetic on
an explicit clock, and profile parsing. The proxy itself is tested end to end in tests/e2e/test_bench_net.py."""

from __future__ import annotations

import itertools
import random

import pytest

from tokenfan_bench.network.shaping_proxy import (
    PROFILES,
    SEGMENT,
    Link,
    PathJitter,
    Profile,
    Stalls,
    parse_profile,
    segments,
)

NO_JITTER = PathJitter(0.0, seed=0)


def no_stalls() -> Stalls:
    return Stalls(0.0, 0.0, 0.0, random.Random(0))


def test_named_profiles_parse_to_themselves_and_round_trip_through_the_custom_form():
    for name, p in PROFILES.items():
        assert parse_profile(name) is p
        again = parse_profile(p.spec())
        assert (again.rtt_ms, again.jitter_ms, again.down_bps, again.up_bps, again.stall_fraction, again.stall_ms) == \
            (p.rtt_ms, p.jitter_ms, p.down_bps, p.up_bps, p.stall_fraction, p.stall_ms)


def test_custom_profile_reads_units():
    p = parse_profile("rtt=80ms,jitter=10ms,down=5mbit,up=1mbit,stall=0.5%/300ms")
    assert (p.rtt_ms, p.jitter_ms, p.down_bps, p.up_bps) == (80, 10, 5e6, 1e6)
    assert p.stall_fraction == pytest.approx(0.005) and p.stall_ms == 300
    q = parse_profile("rtt=0.2s,down=800kbit")
    assert (q.rtt_ms, q.down_bps, q.up_bps, q.jitter_ms) == (200, 800e3, None, 0)
    assert parse_profile("none").rtt_ms == 0


@pytest.mark.parametrize("bad", ["rtt=80", "speed=3mbit", "rtt=10ms,jitter=20ms", "stall=60%/1s", "4G", "down=fast"])
def test_bad_profiles_are_refused_with_a_message(bad):
    with pytest.raises(ValueError, match="--net"):
        parse_profile(bad)


def test_one_way_delay_is_half_the_rtt():
    link = Link(0.040, None, NO_JITTER, no_stalls())
    assert link.schedule(10.0, 100) == pytest.approx(10.040)


def test_bandwidth_serializes_reads_back_to_back():
    link = Link(0.0, 8000.0, NO_JITTER, no_stalls())  # 1000 bytes per second
    assert link.schedule(0.0, 500) == pytest.approx(0.5)
    assert link.schedule(0.0, 500) == pytest.approx(1.0)  # queued behind the first
    assert link.schedule(5.0, 1000) == pytest.approx(6.0)  # an idle link starts at once


def test_a_new_connection_carries_nothing_before_its_handshake():
    link = Link(0.05, None, NO_JITTER, no_stalls(), not_before=1.1)
    assert link.schedule(1.0, 10) == pytest.approx(1.15)


def test_jitter_is_bounded_deterministic_and_slow_enough_to_keep_order():
    j = PathJitter(0.020, seed=3)
    ts = [i * 0.001 for i in range(20_000)]
    values = [j(t) for t in ts]
    assert max(values) <= 0.020 and min(values) >= -0.020
    assert max(values) - min(values) > 0.02  # it does vary
    assert values == [PathJitter(0.020, seed=3)(t) for t in ts]
    assert values != [PathJitter(0.020, seed=4)(t) for t in ts]
    slopes = [abs(b - a) / 0.001 for a, b in itertools.pairwise(values)]
    assert max(slopes) <= 0.5 + 1e-9


def test_arrivals_never_go_backwards():
    link = Link(0.030, None, PathJitter(0.030, seed=1, period_s=0.001), no_stalls())  # a steep jitter on purpose
    arrivals = [link.schedule(i * 0.0005, 10) for i in range(5000)]
    assert arrivals == sorted(arrivals)


def test_bytes_due_inside_a_stall_arrive_when_it_ends():
    s = Stalls(0.1, 0.5, 0.0, random.Random(7))
    start = s.next_start
    assert s.release(start - 0.01) == start - 0.01
    assert s.release(start + 0.2) == pytest.approx(start + 0.5)
    assert s.release(start + 0.4) == pytest.approx(start + 0.5)
    assert s.count == 1


def test_stalls_freeze_the_link_the_given_fraction_of_the_time():
    s = Stalls(0.05, 0.2, 0.0, random.Random(11))
    instants = [i * 0.01 for i in range(500_000)]  # 5000 s
    frozen = sum(s.release(t) != t for t in instants)
    assert frozen / len(instants) == pytest.approx(0.05, rel=0.15)
    assert s.count == pytest.approx(5000 * 0.05 / 0.2, rel=0.15)


def test_no_stalls_when_the_fraction_is_zero():
    s = no_stalls()
    assert all(s.release(t) == t for t in (0.0, 1.0, 1e6))


def test_reads_are_cut_into_segments_without_losing_a_byte():
    data = bytes(range(256)) * 100
    parts = segments(data)
    assert b"".join(parts) == data and max(map(len, parts)) == SEGMENT
    assert segments(b"x") == [b"x"]


def test_describe_names_every_dimension():
    text = Profile("x", 80, 10, 5e6, 1e6, 0.005, 300).describe()
    for part in ("RTT 80 ms", "10 ms jitter", "down 5 Mbit/s", "up 1 Mbit/s", "0.5% of the time", "300 ms"):
        assert part in text
