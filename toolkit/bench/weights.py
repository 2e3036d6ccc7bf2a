"""``python -m toolkit.bench weights``: a weight update as a checkpoint against the same update streamed
(dense, and as a delta after real AdamW steps) into two real vLLM replicas (the CPU build), with
requests running through every update.

A random Llama of about 1 GB in bf16 is built on the spot; the router and two replicas serve it
(``rollout.weights_transport=stream``); the trainer runs in its own process
(``toolkit/bench/weights_trainer.py``) and alternates the arms run by run. ``update_s`` is the
trainer's call to every replica serving the version. ``link_bound_s`` is a raw gloo broadcast of the
same bytes from the trainer's process to two processes on this host, into buffers each keeps. Method and results:
docs/benchmarks.md#weights.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from toolkit.client import RouterClient
from toolkit.config import compose_config
from toolkit.core.protocol import Generate, Sampling
from toolkit.core.rundir import RunDir
from toolkit.launch.stack import LocalStack
from toolkit.launch.validation import validate

logger = logging.getLogger(__name__)

FULL = {"hidden": 2048, "layers": 10, "heads": 16, "intermediate": 5632}
"""516M parameters: 1.03 GB in bf16."""
QUICK = {"hidden": 256, "layers": 2, "heads": 4, "intermediate": 704}

MODELLED = {
    "link_bytes_per_s": 45e9,
    "link_source": "400 Gb/s NDR InfiniBand, 46-48 GB/s per NIC in NCCL's bus bandwidth "
                   "(https://github.com/NVIDIA/nccl-tests/issues/290)",
    "nfs_read_bytes_per_s": 1.5e9,
    "nfs_source": "Amazon EFS, 1,500 MiB/s per client in elastic throughput mode "
                  "(https://docs.aws.amazon.com/efs/latest/ug/performance.html)",
    "lustre_read_bytes_per_s": 10e9,
    "lustre_source": "a Lustre client over one 100-200 Gb/s NIC, 5-25 GB/s per client (Alibaba CPFS states 25 "
                     "GB/s per client; FSx for Lustre without EFA about 12 GB/s)",
    "delta_fraction_source": "verl measured 2.1-2.6% of the elements changed per step on a 72B model, 0.8-1.1% "
                             "on a 30B MoE (its delta_sharded weight sync); this run's fraction after lr-1e-6 steps "
                             "is below",
}
"""The rates the modelled 8B/70B comparison assumes, with their sources (docs/benchmarks.md#weights)."""


class Load:
    """Requests through the router for the whole run, ``concurrency`` at a time: every update happens
    while some run. Counts what did not end ``ok`` (an update must abort nothing)."""

    def __init__(self, run_dir: RunDir, concurrency: int, max_tokens: int) -> None:
        self.run_dir, self.concurrency, self.max_tokens = run_dir, concurrency, max_tokens
        self.done = 0
        self.not_ok: dict[str, int] = {}
        self.spanning = 0
        """Requests whose tokens came from two versions or more (an update landed while they ran)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(300)

    async def _run(self) -> None:
        c = RouterClient(self.run_dir)
        await c.connect(60)
        try:
            await asyncio.gather(*(self._worker(c, w) for w in range(self.concurrency)))
        finally:
            await c.close()

    async def _worker(self, c: RouterClient, w: int) -> None:
        k = 0
        while not self._stop.is_set():
            k += 1
            g = Generate(f"load-{w}-{k}", job="bench", session_id=f"load-{w}-{k}",
                         prompt_token_ids=[(7 * i + w + k) % 500 + 3 for i in range(48)],
                         sampling=Sampling(max_tokens=self.max_tokens, temperature=1.0, seed=k, ignore_eos=True))
            res, _ = await c.generate(g)
            self.done += 1
            if res.status != "ok":
                self.not_ok[res.status] = self.not_ok.get(res.status, 0) + 1
            if len(res.weight_versions) > 1:
                self.spanning += 1


def _interval(xs: list[float]) -> dict[str, float]:
    """Median, min, max and a normal 95% interval of the mean."""
    mean = statistics.fmean(xs)
    half = 1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3),
            "mean_ci95": [round(mean - half, 3), round(mean + half, 3)]}


STREAMED = re.compile(r"streamed weights version (\d+): staged in ([\d.]+)s, applied in ([\d.]+)s")
KEPT = re.compile(r"streamed weights version (\d+) staged: its workers kept \[([\d, ]+)\] of its (\d+) bytes "
                  r"and hold \[([\d, ]+)\]")


def _replica_phases(logs: Path) -> dict[int, list[tuple[float, float]]]:
    """Per streamed version, each replica's (stage, apply) seconds, from the replicas' own logs."""
    out: dict[int, list[tuple[float, float]]] = {}
    for log in sorted(logs.glob("replica-*.log")):
        for m in STREAMED.finditer(log.read_text(errors="replace")):
            out.setdefault(int(m.group(1)), []).append((float(m.group(2)), float(m.group(3))))
    return out


def _worker_bytes(logs: Path) -> dict[int, dict[str, Any]]:
    """Per streamed version: what each worker of the (one) replica kept of it and holds, from its log."""
    out = {}
    for log in sorted(logs.glob("replica-*.log")):
        for m in KEPT.finditer(log.read_text(errors="replace")):
            out[int(m.group(1))] = {"kept": [int(x) for x in m.group(2).split(",")], "total": int(m.group(3)),
                                    "held": [int(x) for x in m.group(4).split(",")]}
    return out


def _serve_and_train(root: Path, name: str, model: Path, overrides: list[str], runs: int, max_tokens: int,
                     ) -> tuple[list[dict[str, Any]], Load, Path]:
    """A stack serving ``model`` under ``overrides`` with requests running, and the trainer's ``runs``
    runs against it: the trainer's JSON lines, the load, and the run's logs (kept)."""
    cfg = compose_config(["model=tiny", f"engine.model={model}", "groups=single", "rollout.weights_transport=stream",
                          "engine.kv_cache_gib=0.25", "engine.max_model_len=512", "engine.args.max_num_seqs=16",
                          *overrides])
    validate(cfg)
    with LocalStack(cfg, root / name) as stack:
        stack.start(timeout_s=1200)
        load = Load(stack.run_dir, concurrency=4, max_tokens=max_tokens)
        load.start()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "toolkit.bench.weights_trainer", "--run", str(stack.run_dir.root),
                 "--model", str(model), "--weights", str(root / f"weights-{name}"), "--runs", str(runs)],
                capture_output=True, text=True, timeout=3600)
        finally:
            load.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"the trainer failed ({proc.returncode}): {proc.stderr[-4000:]}")
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")], load, stack.run_dir.logs


def tensor_parallel(root: Path, model: Path, runs: int, max_tokens: int) -> dict[str, Any]:
    """One replica of tensor_parallel_size 2: its updates' times, and what each worker kept of each
    streamed update and holds (its shard: docs/weights.md)."""
    lines, load, logs = _serve_and_train(root, "tp2", model, ["groups.throughput.replicas=1",
                                                              "engine.tensor_parallel_size=2"], runs, max_tokens)
    updates = [x for x in lines if "arm" in x]
    kept = _worker_bytes(logs)
    arms = {a: [u["update_s"] for u in updates if u["arm"] == a] for a in ("checkpoint", "stream_dense", "stream_delta")}
    dense = [kept[u["version"]] for u in updates if u["arm"] == "stream_dense" and u["version"] in kept]
    model_bytes = next(x for x in lines if "link_bound_s" in x)["bytes"]
    return {
        "workers": 2,
        "update_s": {a: _interval(xs[1:] if len(xs) > 2 else xs) for a, xs in arms.items()},
        "dense_kept_fraction_per_worker": [round(statistics.fmean(d["kept"][w] / d["total"] for d in dense), 4)
                                           for w in range(2)] if dense else [],
        "held_fraction_per_worker": [round(h / model_bytes, 4) for h in dense[-1]["held"]] if dense else [],
        "aborted_requests": sum(load.not_ok.values()),
    }


def modelled(delta_fraction: float) -> list[dict[str, Any]]:
    """An update of an 8B and a 70B model in bf16 to every node: checkpoint (the trainer writes, every node
    reads at the shared file system's per-client rate) against streaming over a 400 Gb/s link (a chain:
    one copy's time, whatever the node count), dense and as a delta of ``delta_fraction`` of the bytes."""
    m = MODELLED
    rows = []
    for name, params in (("8B", 8e9), ("70B", 70e9)):
        b = params * 2
        rows.append({
            "model": name, "bytes": b,
            "checkpoint_nfs_s": round(2 * b / m["nfs_read_bytes_per_s"], 1),  # written once, read by each node
            "checkpoint_lustre_s": round(2 * b / m["lustre_read_bytes_per_s"], 1),
            "stream_dense_s": round(b / m["link_bytes_per_s"], 2),
            "stream_delta_s": round(delta_fraction * b / m["link_bytes_per_s"], 3),
        })
    return rows


def run(quick: bool = False) -> dict[str, Any]:
    from toolkit.model.tiny import build_llama

    shape = QUICK if quick else FULL
    runs = 2 if quick else 5
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        root = Path(tmp)
        t0 = time.monotonic()
        model = build_llama(root / "model", seed=0, **shape)
        logger.info("built a random Llama %s in %.0fs", shape, time.monotonic() - t0)
        lines, load, logs = _serve_and_train(root, "run", model, ["groups.throughput.replicas=2"], runs,
                                             32 if quick else 64)
        phases = _replica_phases(logs)
        tp = tensor_parallel(root, model, 2 if quick else 3, 32 if quick else 64)
    updates = [x for x in lines if "arm" in x]
    bound = next(x for x in lines if "link_bound_s" in x)
    arms = {a: [u for u in updates if u["arm"] == a] for a in ("checkpoint", "stream_dense", "stream_delta")}
    update_s = {a: [u["update_s"] for u in us] for a, us in arms.items()}
    # The first update of each arm pays first-touch costs (page faults of fresh buffers): reported, and
    # left out of the medians when there are more than two runs.
    steady = {a: (xs[1:] if len(xs) > 2 else xs) for a, xs in update_s.items()}
    link = bound["link_bound_s"][1:] if len(bound["link_bound_s"]) > 1 else bound["link_bound_s"]
    link_s = statistics.median(link)
    dense_s, ckpt_s, delta_s = (statistics.median(steady[a]) for a in ("stream_dense", "checkpoint", "stream_delta"))
    fraction = statistics.fmean(u["bytes"] / u["dense_bytes"] for u in arms["stream_delta"])

    def phase(arm: str, i: int) -> list[float]:
        us = arms[arm][1:] if len(arms[arm]) > 2 else arms[arm]
        return [p[i] for u in us for p in phases.get(u["version"], [])]

    stage_dense = statistics.median(phase("stream_dense", 0))
    return {
        "model_bytes": bound["bytes"],
        "model_shape": shape,
        "replicas": 2,
        "runs": runs,
        "update_s": {a: _interval(xs) for a, xs in steady.items()},
        "update_s_all": {a: [round(x, 3) for x in xs] for a, xs in update_s.items()},
        # The checkpoint arm's part of it spent writing the checkpoint (safetensors, fsync) before any replica reads.
        "checkpoint_publish_s_all": [round(u["publish_s"], 3) for u in arms["checkpoint"]],
        "ratio_stream_vs_checkpoint": round(dense_s / ckpt_s, 3),
        "ratio_delta_vs_dense": round(delta_s / dense_s, 3),
        "link_bound_s": round(link_s, 3),
        "link_bound_rounds": [round(x, 3) for x in bound["link_bound_s"]],
        "stream_vs_link_bound": round(dense_s / link_s, 3),
        # Where a streamed update's time goes, from the replicas' logs: the transfer into the staging
        # buffer while the engine serves, and the pause that puts it in (vLLM's layerwise reload).
        "stage_s": {a: _interval(phase(a, 0)) for a in ("stream_dense", "stream_delta")},
        "apply_s": {a: _interval(phase(a, 1)) for a in ("stream_dense", "stream_delta")},
        "stage_vs_link_bound": round(stage_dense / link_s, 3),
        # The engine's own part, which no transfer shortens: on CPUs vLLM rebuilds its packed weights.
        "apply_vs_link_bound": round(statistics.median(phase("stream_dense", 1)) / link_s, 3),
        "delta_bytes_fraction": round(fraction, 5),
        "delta_losses": [round(u["loss"], 4) for u in arms["stream_delta"]],
        "aborted_requests": sum(load.not_ok.values()),
        "requests_not_ok": load.not_ok,
        "requests_during_run": load.done,
        "requests_spanning_an_update": load.spanning,
        "modelled": {"rates": MODELLED, "delta_bytes_fraction": round(fraction, 5), "rows": modelled(fraction)},
        "tensor_parallel": tp,
    }
