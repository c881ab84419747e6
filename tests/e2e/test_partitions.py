"""One answer per stream, whatever the network does: real partitions (network namespaces, veth, iptables DROP)
against sampled listed streams read on two gateways, checked by :func:`tokenfan_bench.partitions.check` over
every reader's history (each event once and in order, an end for every reader, one answer per stream).

The scenarios are ``tokenfan bench partitions``' own (tokenfan_bench/partitions.py), run here on the session's
vLLM engine (the tiny random-weight Llama, temperature 1 and no seed: two continuations of a stream differ
within a few tokens, so a second owner would show) with the suite's short lease (0.8 s): docs/failures.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.procs import ARTIFACTS, Proc
from tests.system import require
from tokenfan_bench.network.partition import available
from tokenfan_bench.partitions import LEASE, Run, engine_scenario, failover_scenario, redis_scenario


def _needs_islands() -> None:
    require("redis-server")
    require("iptables")
    assert available() is None, available()


def _report(run: Run) -> None:
    s = run.summary()
    print(f"\n[figure] {run.scenario}: fault {s['fault_s']:.1f} s, recovery {s['recovery_s']} s, largest gap "
          f"{s['largest_gap_s']} s, {s['resumes']} resumes, outcomes {s['outcomes']}")
    assert not run.problems, "\n".join(run.problems)
    assert s["outcomes"] == {"done": s["readers"]}, s
    assert run.engine_idle, "the engine still runs requests after every stream ended"
    assert run.notes["running_at_fault"] == s["streams"], "the fault struck generations that had ended"


@pytest.mark.vllm
def test_a_gateway_cut_from_redis_for_three_leases_delivers_nothing_another_reader_does_not_read(
        vllm_gateway_url: str, vllm_engine: tuple[str, Proc], tmp_path: Path) -> None:
    """Gateway A keeps its engine and its readers while its link to Redis holds every packet for 3 x the lease:
    it fences itself (its readers resume on B, its /health says 503), B adopts each stream (6 fan-out streams
    and a background response) once A's lease expired, and once healed A's writes are refused by their epoch:
    it gives the streams up."""
    _needs_islands()
    run = redis_scenario("redis-cut", vllm_engine[0], tmp_path, ARTIFACTS, streams=6, tokens=480, cut=3.0,
                         lease=LEASE)
    _report(run)
    assert run.notes["health_during_cut"] == 503
    assert run.notes["adopted_b"] >= 1 and run.notes["adopted_b"] == run.notes["fenced_a"], run.notes


@pytest.mark.vllm
def test_a_redis_restart_mid_stream_keeps_one_answer_per_stream(
        vllm_gateway_url: str, vllm_engine: tuple[str, Proc], tmp_path: Path) -> None:
    """Redis is killed for 3 x the lease and started again empty: the owner writes its streams anew (its epoch
    with them) and they go on; every reader on either gateway reads the same answer to ``[DONE]``."""
    _needs_islands()
    _report(redis_scenario("redis-restart", vllm_engine[0], tmp_path, ARTIFACTS, streams=6, tokens=480, cut=3.0,
                           lease=LEASE))


@pytest.mark.vllm
@pytest.mark.parametrize("kind", ["redis-failover", "sentinel-failover"])
def test_a_failover_to_a_replica_2s_behind_keeps_what_every_reader_read(
        kind: str, vllm_gateway_url: str, vllm_engine: tuple[str, Proc], tmp_path: Path) -> None:
    """A Redis primary with one replica 2 s behind (its replication link held, the connection open); the primary
    and gateway A SIGKILLed together and the replica promoted: by the bench, which switches the one endpoint both
    gateways reach Redis at to it (``redis-failover``), or by three sentinels the gateways ask for the primary
    (``sentinel-failover``). A's readers (two per stream) resume on B, which adopts each stream from the
    promoted replica's log; one more reader per stream starts on B after the failover. Each pipeline waited for
    the replica (--broker-replicas auto), so that log holds whatever A's readers read: every reader reads one
    answer, each event once, to [DONE] (docs/failures.md)."""
    require("redis-server")
    if kind == "sentinel-failover":
        require("redis-sentinel")
    run = failover_scenario(kind, vllm_engine[0], tmp_path, ARTIFACTS, streams=6, tokens=480, lag=2.0, lease=LEASE)
    _report(run)
    assert run.notes["replica_role"] == "master"
    assert run.notes["adopted_b"] == 6, run.notes


def test_an_engine_link_cut_past_heartbeat_and_grace_continues_elsewhere_and_the_old_run_never_shows(
        tmp_path: Path) -> None:
    """A tcp:// + CURVE engine link cut for 3 x its grace: the gateway migrates the requests to its other engine;
    healed, the old engine runs nothing of them (it aborted them) and no delta of the old run reaches a reader
    (each reader's text is the control's)."""
    _needs_islands()
    _report(engine_scenario(tmp_path, ARTIFACTS, streams=6, tokens=300, cut=3.0))
