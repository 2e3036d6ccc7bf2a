"""Metrics on in-process objects: run labels of sweeps, the router's lock-free histogram, a component's
own bind address. Scraped from real processes: tests/integration/test_metrics.py."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def test_two_sweeps_runs_of_the_same_name_stay_apart_in_prometheus(tmp_path: Path) -> None:
    """Multirun dirs are ``0``, ``1``... in every sweep: the ``run`` label is the whole path, and no
    target carries ``job`` (Prometheus' scrape job; it would rename the series' own ``job``)."""
    from prometheus_client import CollectorRegistry

    from toolkit.core.metrics import Endpoint, write_targets
    from toolkit.core.rundir import RunDir

    runs = [RunDir(tmp_path / sweep / "0") for sweep in ("sweep-a", "sweep-b")]
    labels = []
    for rd in runs:
        rd.make()
        endpoint = Endpoint(CollectorRegistry(), "127.0.0.1", rd, "rank-0", {"rank": "0"})
        try:
            [target] = write_targets(rd)
            labels.append(target["labels"])
        finally:
            endpoint.close()
    assert [lab["run"] for lab in labels] == [str(rd.root.absolute()) for rd in runs]
    assert labels[0]["run"] != labels[1]["run"] and all("job" not in lab for lab in labels)


def test_the_routers_lock_free_histogram_exposes_what_prometheus_clients_would() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from toolkit.router.metrics import LATENCY_BUCKETS, LoopHistogram

    values = [0.0, 0.01, 0.010001, 0.3, 1, 2.5, 599.9, 600, 601, 1e9]
    reference = CollectorRegistry()
    h = Histogram("x_seconds", "x", buckets=LATENCY_BUCKETS, registry=reference)
    ours = LoopHistogram("x_seconds", "x", LATENCY_BUCKETS)
    for v in values:
        h.observe(v)
        ours.observe(v)

    def samples(text: str) -> list:  # type: ignore[type-arg]
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value) for f in text_string_to_metric_families(text)
                      for s in f.samples if not s.name.endswith("_created"))

    class One:
        def collect(self):  # type: ignore[no-untyped-def]
            yield ours.family()

    mine = CollectorRegistry()
    mine.register(One())  # type: ignore[arg-type]
    assert samples(generate_latest(mine).decode()) == samples(generate_latest(reference).decode())


def test_a_component_off_the_routers_node_serves_its_metrics_on_its_own(tmp_path: Path) -> None:
    """router.host names the router's node: a replica or rank elsewhere binding it would fail (EADDRNOTAVAIL)."""
    from prometheus_client import CollectorRegistry

    from toolkit.core.metrics import Endpoint
    from toolkit.core.rundir import RunDir
    from toolkit.core.sockets import node_address, own_bind_host

    assert own_bind_host("127.0.0.1", "local") == "127.0.0.1" and own_bind_host(None, "local") == "127.0.0.1"
    host = own_bind_host("192.0.2.7", "slurm")  # TEST-NET-1: no interface of this machine has it
    ep = Endpoint(CollectorRegistry(), host, RunDir(tmp_path), "rank-1", {})
    try:
        assert ep.target == f"{node_address()}:{ep.port}"
    finally:
        ep.close()
