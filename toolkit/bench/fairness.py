"""``python -m toolkit.bench fairness``: a small job behind a big one, fair turns against FIFO.

Job A submits 5,000 requests to 4 sim replicas, then job B submits 50. The bench reports B's
slowdown against B alone, under ``router.queue=fair`` and under ``router.queue=fifo``.
Method: docs/benchmarks.md#fairness.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from toolkit.client import RouterClient
from toolkit.config import Config, GroupConfig, RouterConfig, SimEngineConfig
from toolkit.core.protocol import Generate, Sampling
from toolkit.launch.stack import LocalStack

PROMPT = 64
MAX_TOKENS = 128


def config(queue: str) -> Config:
    return Config(
        engine=SimEngineConfig(output_len_median=64, output_len_sigma=0.6),
        groups={"sim": GroupConfig(replicas=4, max_inflight=32)},
        router=RouterConfig(policy="least_loaded", queue=queue),
    )


def _req(job: str, i: int) -> Generate:
    prompt = [1 + (i * 7 + k) % 30000 for k in range(PROMPT)]
    return Generate(f"{job}-{i}-{time.monotonic_ns()}", job=job, session_id=f"{job}-{i}", step=0,
                    prompt_token_ids=prompt, sampling=Sampling(MAX_TOKENS))


async def _job(c: RouterClient, job: str, n: int) -> float:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(c.generate(_req(job, i)) for i in range(n)))
    bad = [res.status for res, _ in outs if res.status != "ok"]
    if bad:
        raise RuntimeError(f"job {job}: {len(bad)} failed requests: {set(bad)}")
    return time.perf_counter() - t0


async def _measure(stack: LocalStack, n_a: int, n_b: int) -> tuple[float, float]:
    c = RouterClient(stack.run_dir)
    await c.connect(10)
    try:
        alone = await _job(c, "B", n_b)
        big = asyncio.create_task(_job(c, "A", n_a))
        await asyncio.sleep(0.05)  # A's whole batch is in the router's queue before B arrives
        behind = await _job(c, "B", n_b)
        await big
        return alone, behind
    finally:
        await c.close()


def run(quick: bool = False) -> dict[str, Any]:
    n_a, n_b = (1000, 50) if quick else (5000, 50)
    out: dict[str, Any] = {}
    for queue in ("fair", "fifo"):
        with tempfile.TemporaryDirectory(prefix=f"bench-fair-{queue}-") as tmp:
            with LocalStack(config(queue), Path(tmp) / "run") as stack:
                stack.start()
                alone, behind = asyncio.run(_measure(stack, n_a, n_b))
        out[queue] = {"alone_s": alone, "behind_s": behind, "slowdown": behind / alone}
    fair, fifo = out["fair"]["slowdown"], out["fifo"]["slowdown"]
    return {
        "small_job_slowdown_fair": round(fair, 3),
        "small_job_slowdown_fifo": round(fifo, 3),
        "fifo_over_fair": round(fifo / fair, 2),
        "b_alone_s": {q: round(v["alone_s"], 3) for q, v in out.items()},
        "b_behind_a_s": {q: round(v["behind_s"], 3) for q, v in out.items()},
        "job_a_requests": n_a,
        "job_b_requests": n_b,
        "replicas": 4,
        "max_inflight": 32,
    }
