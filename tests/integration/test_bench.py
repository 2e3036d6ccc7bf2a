"""Benchmarks run and report their fields (smoke runs; no assertion on timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def bench(name: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "toolkit.bench", name, "--json", str(out), "--quick"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_router_bench_reports_its_fields(tmp_path: Path) -> None:
    r = bench("router", tmp_path)
    assert {"router_rps", "raw_broker_rps", "ratio", "decision_us_p50", "decision_us_p99", "replicas",
            "decision_us_p99_4096"} <= set(r)
    assert r["replicas"] == 512
    assert set(r["register_s_4096"]) == {"consistent_hash", "kv_aware"} and min(r["register_s_4096"].values()) > 0
    assert r["router_rps"] > 0 and r["raw_broker_rps"] > 0
    assert r["ratio"] == pytest.approx(r["router_rps"] / r["raw_broker_rps"], rel=0.01)
    assert 0 < r["decision_us_p50"] <= r["decision_us_p99"]
    assert r["router_rps_metrics_on"] > 0 and r["router_rps_metrics_off"] > 0
    assert r["ratio_metrics_on"] == pytest.approx(r["router_rps_metrics_on"] / r["router_rps_metrics_off"], rel=0.01)


def test_fairness_bench_reports_its_fields(tmp_path: Path) -> None:
    r = bench("fairness", tmp_path)
    assert {"small_job_slowdown_fair", "small_job_slowdown_fifo"} <= set(r)
    assert r["small_job_slowdown_fair"] > 0 and r["small_job_slowdown_fifo"] > 0


def test_tail_bench_reports_its_fields(tmp_path: Path) -> None:
    r = bench("tail", tmp_path)
    arms = ("off", "steer", "migrate", "age", "predict", "age+count", "age+kv", "age+trade+kv")
    fields = {"flip_at", "expected_flip_at", "spillover", "best_policy", "speedup_best", "bound_ratio_best",
              "prefix_hit_best", "moves_per_step", "requests_not_ok",
              *(f"step_time_{a}_s" for a in arms), *(f"prefix_hit_{a}" for a in arms),
              *(f"speedup_{a}" for a in arms if a != "off")}
    assert fields <= set(r)
    best = r["best_policy"]
    assert best in arms[1:] and r["speedup_best"] == r[f"speedup_{best}"]
    assert r["bound_ratio_best"] == r["bound_ratio"][best] and r["ci95"]["speedup_best"] == r["ci95"][f"speedup_{best}"]
    assert r["requests_not_ok"] == dict.fromkeys(arms, 0)  # every move kept its request whole
    assert r["moves_per_step"]["off"] == r["moves_per_step"]["steer"] == 0
    assert r["flip_at"] == r["expected_flip_at"]  # a count, exact by construction (not a timing)
    assert 0 <= r["spillover"] <= 1
    assert 0 < r["tail10_share_requests_off"] < 1 and 0 < r["tail10_share_sessions_off"] < 1
    assert 0 < r["flip_share_of_step_off"] <= 1
    for lo, hi in r["ci95"].values():
        assert lo <= hi
    assert set(r["bound_ratio"]) == set(arms) and all(v > 0 for v in r["bound_ratio"].values())
    # The fleet twin of every arm on the same sessions: no step under its bound.
    twin = r["model_twin"]
    assert twin["steps"] == r["steps_per_arm"] and set(twin["speedup"]) == set(arms[1:])
    assert set(twin["bound_ratio"]) == {"off", *twin["speedup"]} and min(twin["bound_ratio"].values()) >= 1


def test_gateway_bench_reports_its_fields_and_finds_every_id_exact(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    r = bench("gateway", tmp_path)
    fields = {"sessions_per_s_gateway", "sessions_per_s_direct", "ratio", "added_latency_ms_p50",
              "added_latency_ms_p99", "token_mismatches", "turns_checked", "roundtrip_failures", "unloaded"}
    assert fields <= set(r)
    assert r["ratio"] == pytest.approx(r["sessions_per_s_gateway"] / r["sessions_per_s_direct"], rel=0.01)
    # Correctness, not timing: every turn's ids in the samples are the engine's, on a tokenizer whose
    # decode + encode does not give them back.
    assert r["turns_checked"] == 2 * r["sessions"] * r["turns_per_session"] and r["token_mismatches"] == 0
    assert r["roundtrip_failures"] > 0


@pytest.mark.mpi
def test_loop_bench_reports_its_fields_and_aborts_nothing(tmp_path: Path) -> None:
    r = bench("loop", tmp_path)
    assert {"steps_per_s_sync", "steps_per_s_async", "ratio", "aborted_requests", "mean_staleness"} <= set(r)
    assert r["ratio"] == pytest.approx(r["steps_per_s_async"] / r["steps_per_s_sync"], rel=0.01)
    # Counts and versions, not timings: nothing aborted or retried, on-policy is never stale, one step
    # of overlap is at most one behind.
    assert r["aborted_requests"] == 0 and r["async_mid_step"]["aborted_requests"] == 0
    assert r["mean_staleness"]["sync"] == 0 and 0 <= r["mean_staleness"]["async"] <= 1


@pytest.mark.mpi
def test_partial_bench_reports_its_fields_and_loses_no_token(tmp_path: Path) -> None:
    r = bench("partial", tmp_path)
    assert set(r["arms"]) == {"off", "tail", "partial", "partial+tail", "partial+updates", "partial+affinity"}
    for name, arm in r["arms"].items():
        assert {"samples_per_s", "ratio_vs_off", "ci95", "staleness_mean", "staleness_max", "tokens_discarded",
                "tokens_lost", "fleet_busy", "throughput_bound_ratio"} <= set(arm)
        assert arm["samples_per_s"] > 0 and arm["ci95"][0] <= arm["ratio_vs_off"] <= arm["ci95"][1], name
        # Every generated token of a landed session in exactly one row; every session in one step.
        assert arm["tokens_lost"] == 0 and arm["sessions_in_two_steps"] == 0, name
        assert 0 < arm["fleet_busy"] <= 1 and arm["throughput_bound_ratio"] > 0
        # The fleet's replica-seconds taken apart from the sim's own counts (every first prompt is prefilled).
        split = arm["fleet_time"]
        assert set(split) == {"idle", "behind_model", "underfull_batches", "prefill", "placement", "aborted",
                              "at_peak", "other"}, name
        assert split["at_peak"] > 0 and split["prefill"] > 0 and split["aborted"] >= 0, (name, split)
    assert r["arms"]["off"]["ratio_vs_off"] == 1.0
    for name in ("partial", "partial+tail", "partial+updates", "partial+affinity"):
        assert r["arms"][name]["staleness_max"] <= 1
    f = r["filter"]
    assert f["useful_groups"] > 0 and f["group_starts"] > 0 and f["filtered_groups"] >= 0
    assert f["tokens_lost"] == 0 and f["sessions_twice"] == 0


def test_twin_bench_reports_its_fields(tmp_path: Path) -> None:
    r = bench("twin", tmp_path)
    arms = r["workloads"]["tail"]["arms"]
    assert set(arms) == {"off", "age+trade+kv"}
    for a in arms.values():
        assert a["real_s"] > 0 and a["twin_s"] > 0 and a["error"] == pytest.approx(a["twin_s"] / a["real_s"] - 1, abs=1e-3)
    assert set(r["workloads"]["tail"]["pairs"]) == {"off vs age+trade+kv"}
    assert isinstance(r["workloads"]["tail"]["order_same"], bool)
    assert r["twin_s_headline_12_steps"] > 0 and r["twin_s_65536_sessions_4096_replicas"] > 0
    assert r["twin_s_headline_12_steps_runs"] == [r["twin_s_headline_12_steps"]]  # one run in quick mode
    assert 0 < r["decision_us_p50_4096"] <= r["decision_us_p99_4096"]


def test_kv_bench_reports_its_fields(tmp_path: Path) -> None:
    r = bench("kv", tmp_path)
    assert set(r["arms"]) >= {"consistent_hash", "best_cap", "kv_aware", "churn_consistent_hash", "churn_kv_aware",
                              "churn_oracle"}
    for a in r["arms"].values():
        assert a["step_s"] > 0 and 0 <= a["prefix_hit"] <= 1 and len(a["steps_s"]) == r["steps_per_arm"] - r["warmup_steps"]
    assert r["arms"]["best_cap"]["setting"] in r["cap_sweep"]
    assert r["arms"]["best_cap"]["step_s"] == min(a["step_s"] for a in r["cap_sweep"].values())
    assert r["ratio_step_vs_best_cap"] == pytest.approx(r["arms"]["kv_aware"]["step_s"] / r["arms"]["best_cap"]["step_s"],
                                                        abs=1e-3)
    assert r["hit_gap_vs_oracle"] == pytest.approx(
        r["arms"]["churn_oracle"]["prefix_hit"] - r["arms"]["churn_kv_aware"]["prefix_hit"], abs=1e-3)
    assert 0 < r["decision_us_p50"] <= r["decision_us_p99"]
    turns = r["router_throughput"]["turns"]
    assert r["router_throughput_ratio_events_on"] == turns["ratio_events_on"] > 0
    assert all(v > 0 for v in turns["rps"].values()) and all(v > 0 for v in turns["router_cpu_us_per_request"].values())
    alone = r["router_cpu_in_process"]
    assert set(alone["router_cpu_us_per_request"]) == {"events", "no_events", "consistent_hash"}
    assert all(v > 0 for v in alone["router_cpu_us_per_request"].values()) and alone["cpu_ratio_events_on"] > 0
