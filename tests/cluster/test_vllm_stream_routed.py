"""Streamed weights through the router into two real vLLM replicas (the CPU build),
``rollout.weights_transport=stream``: the test is the trainer (a ``Streamer``), and a trainer in its
own process dies mid-update. The engine's part alone (staging, apply, rollback):
tests/cluster/test_vllm_stream.py; the router's plan: tests/unit/test_stream_router.py."""

from __future__ import annotations

import asyncio
import collections
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers.requests import gen
from toolkit.client import RouterClient, router_status
from toolkit.config import compose_config
from toolkit.launch.stack import LocalStack
from toolkit.launch.validation import validate

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[(7 * i + k) % 500 + 3 for i in range(40)] for k in range(3)]
LONG = 1900
"""Tokens of the requests that run through an update: 10 s and more of decoding on 2 cores (the tiny
model's 2,048 positions less the prompt)."""


def greedy(stack: LocalStack, version: int, tag: str) -> list[list[int]]:
    """Each prompt's greedy tokens, asked of both replicas (several sessions each: the router spreads
    them); every answer must be the same whatever replica gave it, on weights ``version``."""

    async def body() -> list[list[int]]:
        c = RouterClient(stack.run_dir)
        await c.connect(10)
        try:
            reqs = [gen(f"{tag}-{k}-{j}", p, 20, temperature=0.0, ignore_eos=True, job="t")
                    for k, p in enumerate(PROMPTS) for j in range(6)]
            outs = [r for r, _ in await asyncio.gather(*(c.generate(g) for g in reqs))]
        finally:
            await c.close()
        assert all(r.status == "ok" and r.weight_versions == [version] for r in outs), \
            [(r.status, r.error, r.weight_versions) for r in outs]
        assert len({r.replica_id for r in outs}) == 2, "both replicas answered"
        by_prompt = collections.defaultdict(set)
        for r, g in zip(outs, reqs, strict=True):
            by_prompt[tuple(g.prompt_token_ids)].add(tuple(r.output_token_ids))
        assert all(len(v) == 1 for v in by_prompt.values()), by_prompt
        return [list(next(iter(by_prompt[tuple(p)]))) for p in PROMPTS]

    return asyncio.run(asyncio.wait_for(body(), 180))


def ready(stack: LocalStack) -> int:
    st = router_status(stack.frontend, 5.0)
    return st.groups["throughput"].ready if st is not None else -1


@pytest.mark.timeout(900)
def test_streamed_updates_reach_both_replicas_survive_a_dying_trainer_and_a_restarted_replica(
        models: dict[str, Path], tmp_path: Path) -> None:
    from toolkit.engine.vllm_receiver import read_checkpoint, to_torch
    from toolkit.weights import Streamer, publish

    cfg = compose_config(["model=tiny", f"engine.cache_dir={models['cache']}", "groups=single",
                          "groups.throughput.replicas=2", "rollout.weights_transport=stream",
                          "router.policy=round_robin", "engine.max_model_len=2048"])
    validate(cfg)
    ckpt = read_checkpoint(str(models["ckpt"]))
    rng = np.random.default_rng(1)

    def nudged(share: float) -> list[tuple[str, Any]]:
        out = []
        for name, (b, dtype) in ckpt.items():
            b = b.copy()
            flat = b.reshape(-1)
            flat[rng.choice(flat.size, max(1, int(flat.size * share)), replace=False)] ^= 1
            out.append((name, to_torch(b, dtype)))
        return out

    w1 = [(n, to_torch(b, d)) for n, (b, d) in ckpt.items()]
    w2 = nudged(0.01)
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start(timeout_s=400)
        g0 = greedy(stack, 0, "g0")
        streamer = Streamer(stack.run_dir.root, bucket_mb=0.0625, timeout_s=60)
        try:
            # 1. A dense update while requests run on both replicas: none aborted, both versions in them.
            async def during(update: Any) -> list[Any]:
                c = RouterClient(stack.run_dir)
                await c.connect(10)
                try:
                    running = [asyncio.create_task(c.generate(gen(f"long{k}", PROMPTS[k % 3], LONG, temperature=1.0,
                                                                  seed=k, ignore_eos=True, job="t")))
                               for k in range(4)]
                    # Until every one decodes (the replicas' heartbeats count their tokens), far from done.
                    st0 = await c.status()
                    base = st0.groups["throughput"].generated_tokens
                    while (await c.status()).groups["throughput"].generated_tokens < base + 4 * 20:
                        await asyncio.sleep(0.1)
                    await asyncio.to_thread(update)
                    return [r for r, _ in await asyncio.gather(*running)]
                finally:
                    await c.close()

            done = asyncio.run(asyncio.wait_for(during(lambda: streamer.send(1, w1)), 300))
            assert all(r.status == "ok" and len(r.output_token_ids) == LONG for r in done), \
                [(r.status, r.error) for r in done]
            assert any(r.weight_versions == [0, 1] for r in done), [r.weight_versions for r in done]
            assert streamer.last["replicas"] == 2 and not streamer.last["delta"]
            g1 = greedy(stack, 1, "g1")
            assert g1 != g0

            # 2. A delta (1% of the elements changed): a small share of the bytes, the same tokens as the
            # same weights loaded from a checkpoint.
            streamer.send(2, w2)
            assert streamer.last["delta"] and streamer.last["bytes"] < 0.1 * streamer.last["dense_bytes"]
            g2 = greedy(stack, 2, "g2")
            path = publish(tmp_path / "weights", 3, dict(w2), config=None, files=[models["ckpt"] / "config.json"])

            async def load() -> None:
                c = RouterClient(stack.run_dir)
                await c.connect(10)
                try:
                    await c.update_weights(str(path), 3, timeout_s=300)
                finally:
                    await c.close()

            asyncio.run(load())
            assert greedy(stack, 3, "g3") == g2

            # 3. A trainer in its own process dies mid-update: both replicas serve version 3 on, and the
            # next send lands (dense: no replica holds the streamer's last version, 2).
            dying = subprocess.run([sys.executable, "-m", "tests.helpers.stream_trainer", str(stack.run_dir.root),
                                    str(models["base"]), "4", "--die-after-buckets", "3"],
                                   capture_output=True, text=True, timeout=300)
            assert dying.returncode == 17, dying.stderr[-3000:]
            st = router_status(stack.frontend, 5.0)
            assert st is not None and st.weights_version == 3
            assert greedy(stack, 3, "g4") == g2 and ready(stack) == 2
            streamer.send(5, w1)
            assert not streamer.last["delta"] and streamer.last["replicas"] == 2
            assert greedy(stack, 5, "g5") == g1

            # 4. A replica restarted mid-run holds the model's own weights: out of dispatch until the
            # streamer's dense copy of version 5 reached it.
            old = stack.replicas[("throughput", 1)]
            old.send_signal(signal.SIGTERM)
            # 0: it left and closed its engine; 1: its cleanup hung and the watchdog (STOP_GRACE_S) ended
            # it, every thread's stack in logs/replica-throughput-1.out.
            assert old.wait(60) == 0
            stack.start_replica("throughput", 1)
            stack.wait_ready(300)
            assert any(rid.startswith("throughput-1@") and v == 5 for v, rid in streamer.caught_up), streamer.caught_up
            assert greedy(stack, 5, "g6") == g1
        finally:
            streamer.close()


@pytest.mark.timeout(900)
def test_a_tensor_parallel_replica_takes_dense_and_delta_streams_on_every_worker(
        models: dict[str, Path], tmp_path: Path) -> None:
    """Both workers of a replica of tensor_parallel_size 2 are ranks of the chain, each keeping its own shard
    of the update. Greedy tokens equal those of the same weights from a checkpoint."""
    from toolkit.engine.vllm_receiver import read_checkpoint, to_torch
    from toolkit.weights import Streamer, publish

    cfg = compose_config(["model=tiny", f"engine.cache_dir={models['cache']}", "groups=single",
                          "engine.tensor_parallel_size=2", "rollout.weights_transport=stream"])
    validate(cfg)
    ckpt = read_checkpoint(str(models["ckpt"]))
    rng = np.random.default_rng(2)
    w1 = [(n, to_torch(b, d)) for n, (b, d) in ckpt.items()]
    w2 = []
    for name, (b, dtype) in ckpt.items():
        b = b.copy()
        flat = b.reshape(-1)
        flat[rng.choice(flat.size, max(1, flat.size // 100), replace=False)] ^= 1
        w2.append((name, to_torch(b, dtype)))

    async def ask(stack: LocalStack, version: int, tag: str) -> list[list[int]]:
        c = RouterClient(stack.run_dir)
        await c.connect(10)
        try:
            outs = [r for r, _ in await asyncio.gather(*(
                c.generate(gen(f"{tag}-{k}", p, 20, temperature=0.0, ignore_eos=True, job="t"))
                for k, p in enumerate(PROMPTS)))]
        finally:
            await c.close()
        assert all(r.status == "ok" and r.weight_versions == [version] for r in outs), outs
        return [r.output_token_ids for r in outs]

    async def load(stack: LocalStack, path: Path, version: int) -> None:
        c = RouterClient(stack.run_dir)
        await c.connect(10)
        try:
            await c.update_weights(str(path), version, timeout_s=300)
        finally:
            await c.close()

    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start(timeout_s=600)
        with Streamer(stack.run_dir.root, bucket_mb=0.0625, timeout_s=60) as streamer:
            streamer.send(1, w1)
            assert streamer.last["replicas"] == 1 and not streamer.last["delta"]
            g1 = asyncio.run(ask(stack, 1, "tp1"))
            streamer.send(2, w2)
            assert streamer.last["delta"]
            g2 = asyncio.run(ask(stack, 2, "tp2"))
        asyncio.run(load(stack, models["ckpt"], 3))
        assert asyncio.run(ask(stack, 3, "tp3")) == g1
        path = publish(tmp_path / "weights", 4, dict(w2), config=None, files=[models["ckpt"] / "config.json"])
        asyncio.run(load(stack, path, 4))
        assert asyncio.run(ask(stack, 4, "tp4")) == g2
