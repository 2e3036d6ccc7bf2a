"""Prometheus metrics: the router serves /metrics (parsed here with prometheus_client's own text
parser) whose counts equal what its clients got, and launch lists it in file_sd targets."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import with_client
from toolkit.client import RouterClient
from toolkit.protocol import Generate, Sampling

ROOT = Path(__file__).resolve().parent.parent


def scrape(target: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = urllib.request.urlopen(f"http://{target}/metrics", timeout=5).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(metrics: dict, name: str, **labels: str) -> float:
    return sum(v for lab, v in metrics.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def test_the_router_metrics_count_what_its_clients_got(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run(["engine.time_scale=0.05", "router.heartbeat_s=0.2"])
    stack.start()
    endpoint = json.loads((rd.metrics / "router.json").read_text())
    assert endpoint["labels"] == {"component": "router", "job": "rollout"}
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
    # The example Grafana dashboard asks only for series the router serves.
    dashboard = json.loads((ROOT / "examples" / "grafana_dashboard.json").read_text())
    asked = {name for p in dashboard["panels"] for t in p["targets"]
             for name in re.findall(r"toolkit_[a-z_]+", t["expr"])}
    assert asked and asked <= set(m), asked - set(m)


def test_no_metrics_when_turned_off(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run(["engine.time_scale=0.05", "report.metrics=false"])
    stack.start()
    assert not rd.metrics.exists()
