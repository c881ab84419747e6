"""CPU placement of the vLLM engine on CPU hosts (engine_worker.backends.vllm.cpu_placement)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_worker.backends.vllm import SPLIT_BELOW_WEIGHT_BYTES, CpuPlacement, cpu_placement, weight_bytes


def test_all_puts_every_cpu_in_the_openmp_pool_and_pins_nothing() -> None:
    assert cpu_placement("all", [0, 1]) == CpuPlacement("0,1")


def test_vllm_is_vllms_own_auto() -> None:
    assert cpu_placement("vllm", [0, 1]) == CpuPlacement("auto")


def test_split_confines_the_engine_to_all_cpus_but_the_last() -> None:
    assert cpu_placement("split", [0, 1]) == CpuPlacement("0", frozenset({0}))
    assert cpu_placement("split", [2, 3, 4, 5]) == CpuPlacement("2,3,4", frozenset({2, 3, 4}))
    assert cpu_placement("split", [3]) == CpuPlacement("3", frozenset({3}))


def test_auto_splits_small_models_on_small_hosts_and_is_vllms_auto_otherwise() -> None:
    assert cpu_placement("auto", [0, 1], model_bytes=4 << 20) == cpu_placement("split", [0, 1])
    assert cpu_placement("auto", [0, 1], model_bytes=SPLIT_BELOW_WEIGHT_BYTES) == CpuPlacement("auto")
    assert cpu_placement("auto", list(range(64)), model_bytes=4 << 20) == CpuPlacement("auto")
    assert cpu_placement("auto", [0, 1], parallel=2) == CpuPlacement("auto")


def test_weight_bytes_counts_safetensors_else_bins(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 99)
    assert weight_bytes(tmp_path) == 10
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 7)
    assert weight_bytes(tmp_path) == 7


def test_other_values_are_vllms_own_syntax_passed_through() -> None:
    assert cpu_placement("0-3|4-7", list(range(8)), parallel=2) == CpuPlacement("0-3|4-7")
    assert cpu_placement("nobind", [0, 1]) == CpuPlacement("nobind")


@pytest.mark.parametrize("mode", ["all", "split"])
def test_single_worker_modes_refuse_parallelism(mode: str) -> None:
    with pytest.raises(ValueError, match="one model worker"):
        cpu_placement(mode, list(range(8)), parallel=2)
