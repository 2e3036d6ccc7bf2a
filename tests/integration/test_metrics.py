"""Prometheus metrics: the router, every replica and every rank serve /metrics (parsed here with
prometheus_client's own text parser) whose counts equal what their clients got and the step reports
say, and launch lists them all in file_sd targets."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.aio import with_client
from tests.helpers.procs import finish, start_launch, wait_for
from tests.helpers.prom import value
from toolkit.client import RouterClient
from toolkit.core.protocol import Generate, Sampling
from toolkit.weights import publish

ROOT = Path(__file__).resolve().parents[2]


def scrape(target: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = urllib.request.urlopen(f"http://{target}/metrics", timeout=5).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_the_router_metrics_count_what_its_clients_got(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run(["engine.time_scale=0.05", "router.heartbeat_s=0.2"])
    stack.start()
    endpoint = json.loads((rd.metrics / "router.json").read_text())
    assert endpoint["labels"] == {"component": "router"}
    target = endpoint["target"]
    assert target.startswith("127.0.0.1:")  # locally: loopback only

    async def body(c: RouterClient) -> list:
        ok = [Generate(f"a{i}", job="a", session_id=f"a{i}", step=0, prompt_token_ids=[1, 2, i + 3],
                       sampling=Sampling(max_tokens=8)) for i in range(20)]
        bad = [Generate(f"b{i}", job="b", session_id=f"b{i}", step=0, prompt_token_ids=[],
                        sampling=Sampling(max_tokens=8)) for i in range(3)]
        outs = await asyncio.gather(*(c.generate(m) for m in [*ok, *bad]))
        await asyncio.sleep(0.5)  # heartbeats after the last tokens
        return [res for res, _ in outs]

    results = asyncio.run(with_client(rd, body))
    m = scrape(target)
    by_status = {}
    for res in results:
        by_status[res.status] = by_status.get(res.status, 0) + 1
    assert by_status == {"ok": 20, "client_error": 3}
    assert value(m, "toolkit_router_requests_total", job="a", status="ok") == 20
    assert value(m, "toolkit_router_requests_total", job="b", status="client_error", group="none") == 3
    served = {res.group for res in results if res.status == "ok"}
    assert sum(value(m, "toolkit_router_requests_total", job="a", group=g) for g in served) == 20
    assert value(m, "toolkit_router_request_seconds_count") == 23  # every answer timed once
    assert value(m, "toolkit_router_queue_wait_seconds_count") == 20  # only the dispatched ones
    assert value(m, "toolkit_router_queue_depth") == 0
    assert value(m, "toolkit_router_replica_inflight") == 0
    generated = sum(len(res.output_token_ids) for res in results)
    # Every replica's engine counter, as its last heartbeat said (the readiness probes' token too).
    assert value(m, "toolkit_router_replica_generated_tokens_total") >= generated
    assert value(m, "toolkit_router_events_total", event="completed") == 23
    assert value(m, "toolkit_router_events_total", event="failed:client_error") == 3
    assert len({lab["replica"] for lab, _ in m["toolkit_router_replica_inflight"]}) == 3  # every replica
    # The example Grafana dashboard asks only for series the router serves (of its router panels).
    asked = {name for name in dashboard_series() if name.startswith("toolkit_router_")}
    assert asked and asked <= set(m), asked - set(m)


def dashboard_series() -> set[str]:
    dashboard = json.loads((ROOT / "examples" / "grafana_dashboard.json").read_text())
    return {name for p in dashboard["panels"] for t in p["targets"] for name in re.findall(r"toolkit_[a-z_]+", t["expr"])}


def test_no_metrics_when_turned_off(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run(["engine.time_scale=0.05", "report.metrics=false"])
    stack.start()
    assert not rd.metrics.exists()


@pytest.mark.mpi
@pytest.mark.slow
def test_every_component_of_a_launch_serves_counts_equal_to_the_step_report(tmp_path: Path) -> None:
    run, weights = tmp_path / "run", tmp_path / "weights"
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    # On-policy: step 1 waits for weights version 1, so every component is up, step 0 is over, and
    # nothing else runs while the test scrapes. The default tail policy starts the step's first 4
    # turns on the tail group (its room) and moves requests past 30 tokens there, so some requests
    # run on two replicas.
    proc = start_launch([f"hydra.run.dir={run}", "steps=2", "sessions_per_step=12", "router.heartbeat_s=0.2",
                         "engine.time_scale=0.2", "tail.long_tokens=30", "groups.tail.max_inflight=4",
                         f"rollout.weights_dir={weights}",
                         "rollout.max_staleness=0", "rollout.weights_timeout_s=120"])
    try:
        wait_for(lambda: (run / "steps" / "step_00000.json").exists(), 180, "step 0's report")
        report = json.loads((run / "steps" / "step_00000.json").read_text())
        targets_file = run / "prometheus_targets.json"

        def listed() -> list | None:  # type: ignore[type-arg]
            groups = json.loads(targets_file.read_text()) if targets_file.exists() else []
            names = {g["labels"]["component"] for g in groups}
            # The default fleet: 2 throughput replicas and 1 tail replica, and 2 ranks.
            want = {"router", "replica-throughput-0", "replica-throughput-1", "replica-tail-0", "rank-0", "rank-1"}
            return groups if want <= names else None

        wait_for(listed, 30, "every component in prometheus_targets.json")
        time.sleep(0.6)  # the replicas' heartbeats after step 0's last tokens
        scraped = {g["labels"]["component"]: (g["labels"], scrape(g["targets"][0])) for g in listed() or []}
    finally:
        publish(weights, 1, checkpoint)  # lets step 1 run: the launch must still succeed
        output = finish(proc, 180)
    assert proc.returncode == 0, output

    assert all(lab["run"] == str(run.absolute()) and "job" not in lab for lab, _ in scraped.values())
    ranks = [m for name, (_, m) in scraped.items() if name.startswith("rank-")]
    replicas = {name: m for name, (_, m) in scraped.items() if name.startswith("replica-")}
    router = scraped["router"][1]
    requests = report["requests_by_status"]
    sessions = report["sessions_by_status"]
    # The ranks: every session and request of step 0, as the step report counts them.
    assert [value(m, "toolkit_rank_step") for m in ranks] == [0, 0]
    for status, n in sessions.items():
        assert sum(value(m, "toolkit_rank_sessions_total", status=status) for m in ranks) == n, status
    assert sum(value(m, "toolkit_rank_step_sessions_done") for m in ranks) == report["sessions"] == 12
    for status, n in requests.items():
        assert sum(value(m, "toolkit_rank_requests_total", status=status) for m in ranks) == n, status
    for group, g in report["groups"].items():
        assert sum(value(m, "toolkit_rank_requests_total", group=group) for m in ranks) == g["requests"], group
    assert sum(value(m, "toolkit_rank_generated_tokens_total") for m in ranks) == report["generated_tokens"]
    assert sum(value(m, "toolkit_rank_request_seconds_count") for m in ranks) == report["requests"]
    # The router answered each of them once.
    for status, n in requests.items():
        assert value(router, "toolkit_router_requests_total", job="rollout", status=status) == n, status
    assert value(router, "toolkit_router_queue_depth", job="rollout") == 0
    # The replicas: the tokens of the step's Results (a moved request's tokens came from two of them),
    # every one also counted by its engine (probes on top); none held now.
    result_tokens = sum(value(m, "toolkit_replica_result_tokens_total", job="rollout") for m in replicas.values())
    assert result_tokens == report["generated_tokens"]
    engine_tokens = sum(value(m, "toolkit_replica_generated_tokens_total") for m in replicas.values())
    assert engine_tokens >= result_tokens
    moved = report["tail"]["moves"]
    assert moved > 0
    ok = sum(value(m, "toolkit_replica_requests_total", job="rollout", status="ok") for m in replicas.values())
    assert ok == requests.get("ok", 0)  # a move's first part ends cancelled, its last part ok
    cancelled = sum(value(m, "toolkit_replica_requests_total", job="rollout", status="cancelled")
                    for m in replicas.values())
    assert cancelled == moved
    assert all(value(m, "toolkit_replica_inflight") == 0 for m in replicas.values())
    assert {lab["group"] for name, (lab, _) in scraped.items() if name.startswith("replica-")} == {"throughput", "tail"}
    # The example Grafana dashboard asks only for series the components serve.
    served = {name for _, m in scraped.values() for name in m}
    assert dashboard_series() <= served, dashboard_series() - served
    # Step 1 ended, and every component took its endpoint file with it.
    assert not list((run / "metrics").glob("*.json"))
