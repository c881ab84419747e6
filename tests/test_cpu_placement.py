"""CPU placement of the vLLM engine on CPU hosts (engine_worker.backends.vllm.cpu_placement)."""

from __future__ import annotations

import pytest

from engine_worker.backends.vllm import AUTO_PLACEMENT, CpuPlacement, cpu_placement


def test_all_puts_every_cpu_in_the_openmp_pool_and_pins_nothing() -> None:
    assert cpu_placement("all", [0, 1]) == CpuPlacement("0,1")


def test_vllm_is_vllms_own_auto() -> None:
    assert cpu_placement("vllm", [0, 1]) == CpuPlacement("auto")


def test_split_confines_the_engine_to_all_cpus_but_the_last() -> None:
    assert cpu_placement("split", [0, 1]) == CpuPlacement("0", frozenset({0}))
    assert cpu_placement("split", [2, 3, 4, 5]) == CpuPlacement("2,3,4", frozenset({2, 3, 4}))
    assert cpu_placement("split", [3]) == CpuPlacement("3", frozenset({3}))


def test_auto_is_the_measured_choice_on_small_hosts_and_vllms_auto_on_big_ones() -> None:
    assert cpu_placement("auto", [0, 1]) == cpu_placement(AUTO_PLACEMENT, [0, 1])
    assert cpu_placement("auto", list(range(64))) == CpuPlacement("auto")
    assert cpu_placement("auto", [0, 1], parallel=2) == CpuPlacement("auto")


def test_other_values_are_vllms_own_syntax_passed_through() -> None:
    assert cpu_placement("0-3|4-7", list(range(8)), parallel=2) == CpuPlacement("0-3|4-7")
    assert cpu_placement("nobind", [0, 1]) == CpuPlacement("nobind")


@pytest.mark.parametrize("mode", ["all", "split"])
def test_single_worker_modes_refuse_parallelism(mode: str) -> None:
    with pytest.raises(ValueError, match="one model worker"):
        cpu_placement(mode, list(range(8)), parallel=2)
