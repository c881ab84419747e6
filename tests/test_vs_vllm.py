"""`tokenfan bench vs-vllm`: server specs, process roles and the ratio table (pure parts)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tokenfan_bench import vs_vllm as v


def test_servers_default_to_their_kind_as_label_and_take_label_prefixes() -> None:
    specs = v.parse_servers("tokenfan,fast:tokenfan,vllm")
    assert [(s.label, s.kind) for s in specs] == [("tokenfan", "tokenfan"), ("fast", "tokenfan"), ("vllm", "vllm")]


@pytest.mark.parametrize("bad", ["sglang", "a:tokenfan,a:vllm", ""])
def test_unknown_kinds_duplicate_labels_and_empty_lists_are_refused(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        v.parse_servers(bad)


def test_env_and_arg_overrides_reach_only_the_named_server() -> None:
    specs = v.parse_servers("a:tokenfan,vllm")
    v.apply_overrides(specs, ["a:TOKENFAN_CPU_PLACEMENT=all"], ["vllm:--max-num-seqs=64"])
    assert specs[0].env == {"TOKENFAN_CPU_PLACEMENT": "all"} and specs[0].args == []
    assert specs[1].args == ["--max-num-seqs=64"] and specs[1].env == {}
    with pytest.raises(SystemExit):
        v.apply_overrides(specs, ["nope:X=1"], [])


@pytest.mark.parametrize(("name", "cmdline", "root", "kind", "role"), [
    ("python", "python -m tokenfan.cli serve", True, "tokenfan", "gateway"),
    ("python", "python -m engine_worker --engine vllm", False, "tokenfan", "engine_worker"),
    ("python", "python -m vllm.entrypoints.openai.api_server", True, "vllm", "api_server"),
    ("VLLM::EngineCor", "VLLM::EngineCore", False, "vllm", "engine_core"),
    ("VLLM::Worker", "VLLM::Worker", False, "tokenfan", "model_worker"),
    ("python", "python -c from multiprocessing.resource_tracker import main", False, "vllm", "other"),
])
def test_processes_are_named_by_role(name: str, cmdline: str, root: bool, kind: str, role: str) -> None:
    assert v.role_of(name, cmdline, is_root=root, kind=kind) == role


def test_prompt_count_scales_with_concurrency_above_a_floor() -> None:
    assert v.num_prompts(8, 4, 128) == 128
    assert v.num_prompts(256, 4, 128) == 1024


def _run(server: str, kind: str, c: int, rnd: int, tput: float, itl99: float, cpu: float) -> dict[str, Any]:
    roles = {"gateway": cpu / 4, "engine_worker": cpu / 4} if kind == "tokenfan" else {"api_server": cpu / 2}
    return {"server": server, "kind": kind, "concurrency": c, "round": rnd, "load_before": (1.0, 1.0, 1.0),
            "client": {"output_throughput": tput, "p50_ttft_ms": 10.0, "p99_ttft_ms": 20.0, "p50_itl_ms": 5.0,
                       "p99_itl_ms": itl99, "failed": 0},
            "cpu_s": {**roles, "engine_core": cpu / 4, "model_worker": cpu / 4, "total": cpu},
            "cpu_ms_per_token": cpu, "rss_mb": {"total_peak": 1000.0}}


def _results(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"meta": {"model": "tiny", "command": ["tokenfan", "bench", "vs-vllm"], "machine": "2 CPUs",
                     "load_start": "1 1 1", "rounds": 3, "concurrency": [8]},
            "servers": [{"label": "tokenfan", "kind": "tokenfan"}, {"label": "vllm", "kind": "vllm"}],
            "runs": runs}


def test_aggregate_takes_the_median_over_rounds() -> None:
    runs = [_run("tokenfan", "tokenfan", 8, r, t, 10.0, 4.0) for r, t in enumerate((100.0, 300.0, 200.0))]
    agg = v.aggregate(runs)["tokenfan"][8]
    assert agg["output_throughput"] == 200.0
    assert agg["front_end_cpu_s"] == 2.0
    assert agg["rounds"] == 3


def test_summary_has_a_ratio_row_against_vllm() -> None:
    md = v.summary_md(_results([_run("tokenfan", "tokenfan", 8, 0, 300.0, 30.0, 2.0),
                                _run("vllm", "vllm", 8, 0, 200.0, 20.0, 4.0)]))
    ratio = next(line for line in md.splitlines() if line.startswith("| tokenfan / vllm | 8 |"))
    cells = [c.strip() for c in ratio.strip("|").split("|")]
    assert cells[2] == "**1.50×**"  # output tok/s
    assert cells[6] == "**1.50×**"  # ITL p99
    assert cells[7] == "–"  # TTFT¹ p99: no per-request figures in this run
    assert cells[9] == "**0.50×**"  # CPU-s


def test_cpu_per_token_is_reported_per_role_and_for_each_front_end() -> None:
    per = v.cpu_per_token_by_role({"gateway": 1.0, "engine_worker": 0.5, "engine_core": 2.0, "total": 3.5}, 10_000)
    assert per is not None
    assert per["gateway"] == pytest.approx(100.0) and per["engine_worker"] == pytest.approx(50.0)
    assert per["front_end"] == pytest.approx(150.0) and per["total"] == pytest.approx(350.0)
    assert v.cpu_per_token_by_role({"api_server": 1.0}, 0) is None
    runs = [{**_run("tokenfan", "tokenfan", 8, 0, 300.0, 30.0, 2.0),
             "cpu_us_per_token": v.cpu_per_token_by_role({"gateway": 0.2, "engine_worker": 0.1}, 10_000)},
            {**_run("vllm", "vllm", 8, 0, 200.0, 20.0, 4.0),
             "cpu_us_per_token": v.cpu_per_token_by_role({"api_server": 1.2}, 10_000)}]
    md = v.summary_md(_results(runs))
    row = next(line for line in md.splitlines() if line.startswith("| tokenfan | 8 | 20.0 | 10.0 |"))
    assert row.endswith("| 30.0 | **0.25×** |")


def test_events_per_request_counts_the_first_chunk_and_every_gap() -> None:
    assert v.events_per_request([[1.0, 2.0, 3.0], [4.0]]) == 3.0
    assert v.events_per_request([]) is None


def test_content_latencies_skip_the_role_chunk_on_both_sides() -> None:
    # request 1: role chunk at 0.1 s, first token 2.0 s later, then gaps of 0.01 s; request 2 likewise.
    out = v.content_latencies([0.1, 0.2], [[2.0, 0.01, 0.01], [3.0, 0.01]])
    assert out["p50_content_ttft_ms"] == pytest.approx(2650.0)
    assert out["p99_content_itl_ms"] == pytest.approx(10.0)
    assert v.content_latencies([0.1], [[]])["p50_content_ttft_ms"] is None


def test_a_model_with_serving_hints_is_served_through_a_view_without_them(tmp_path: Path) -> None:
    model = tmp_path / "gemma"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "transcript.jinja").write_text("{{ messages }}")
    (model / "tokenfan.json").write_text(json.dumps({"chat_template": "transcript.jinja", "chat_stop": ["\n\n"]}))
    raw = v.resolve_bench_model(str(model), tmp_path / "cache", None)
    assert raw.name == "gemma" and raw.stop == () and raw.chat_template is None
    assert sorted(p.name for p in raw.path.iterdir()) == ["config.json", "transcript.jinja"]
    hinted = v.resolve_bench_model(str(model), tmp_path / "cache", None, hints=True)
    assert hinted.path == model and hinted.stop == ("\n\n",) and hinted.chat_template == model / "transcript.jinja"


# -- --isolate-engine -----------------------------------------------------------------------------


def _tree(kind: str, model: str = "0", others: str = "1") -> list[v.Placed]:
    front = ["gateway", "engine_worker"] if kind == "tokenfan" else ["api_server"]
    procs = [v.Placed(10 + i, 10 + i, role, others) for i, role in enumerate([*front, "engine_core"])]
    return [*procs, v.Placed(90, 90, "model_worker", model), v.Placed(90, 91, "model_worker", model)]


def test_cpu_lists_parse_as_proc_and_taskset_write_them() -> None:
    assert v.parse_cpu_list("0-2,5") == {0, 1, 2, 5}
    assert v.parse_cpu_list("1") == {1} and v.parse_cpu_list(" 0 ") == {0}


@pytest.mark.parametrize("kind", ["tokenfan", "vllm"])
def test_isolate_engine_accepts_the_model_worker_on_cpu_0_and_everything_else_on_cpu_1(kind: str) -> None:
    assert v.placement_errors(_tree(kind), kind) == []


@pytest.mark.parametrize("kind", ["tokenfan", "vllm"])
def test_isolate_engine_refuses_any_process_or_model_thread_off_its_cpus(kind: str) -> None:
    assert v.placement_errors(_tree(kind, model="1"), kind)  # vLLM's binding did not take
    assert v.placement_errors(_tree(kind, others="0-1"), kind)  # the front end not confined
    stray = [*_tree(kind), v.Placed(90, 92, "model_worker", "0-1")]  # one thread of the model worker
    (err,) = v.placement_errors(stray, kind)
    assert "thread 92" in err
    other_thread = [*_tree(kind), v.Placed(10, 12, _tree(kind)[0].role, "0-1")]
    assert v.placement_errors(other_thread, kind) == []  # only the model worker's threads are pinned each


@pytest.mark.parametrize("kind", ["tokenfan", "vllm"])
def test_isolate_engine_refuses_a_tree_without_its_model_worker(kind: str) -> None:
    # a tree whose model worker is not there yet (or was not recognised) would pass any placement check
    (err,) = v.placement_errors([p for p in _tree(kind) if p.role != "model_worker"], kind)
    assert "no model_worker" in err


def test_isolate_engine_starts_both_arms_under_taskset_with_the_same_binding(tmp_path: Path) -> None:
    ns = v.parser().parse_args(["--isolate-engine"])
    model = v.Model(tmp_path, "m")
    for kind in v.KINDS:
        spec = v.ServerSpec(kind, kind)
        assert v.server_command(spec, model, ns, 8000)[:3] == ["taskset", "-c", "1"]
        assert v.server_env(spec, ns)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    plain = v.parser().parse_args([])
    assert v.server_command(v.ServerSpec("vllm", "vllm"), model, plain, 8000)[0] != "taskset"


def test_the_placement_record_counts_each_process_threads_per_cpu_list() -> None:
    rec = v.placement_record([*_tree("vllm"), v.Placed(90, 93, "model_worker", "0-1")])
    assert rec[-1] == {"pid": 90, "role": "model_worker", "cpus": "0", "threads": {"0": 2, "0-1": 1}}
    assert rec[0] == {"pid": 10, "role": "api_server", "cpus": "1", "threads": {"1": 1}}
