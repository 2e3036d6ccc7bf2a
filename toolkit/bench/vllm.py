"""``python -m toolkit.bench vllm``: real vLLM engines behind the toolkit against the same engine called
directly.

Both arms run ``model=tiny`` with the same seeded requests: arm ``router`` through a client, the
router and one replica; arm ``direct`` straight into an ``AsyncLLM`` in this process. The arms
alternate round by round and report output tokens/s. Method: docs/benchmarks.md#vllm.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from toolkit.client import RouterClient
from toolkit.config import compose_config
from toolkit.core.protocol import Generate, Result, Sampling
from toolkit.engine.vllm import VllmEngine
from toolkit.launch.stack import LocalStack
from toolkit.launch.validation import validate

logger = logging.getLogger(__name__)

IDLE_S = 1.5  # vLLM's worker busy-polls its queue for 1 s after its last step


def bench_config(cache_dir: str) -> Any:
    """``model=tiny`` as launch composes it, one group of one replica."""
    cfg = compose_config(["model=tiny", "groups=single", "groups.throughput.replicas=1",
                          f"engine.cache_dir={cache_dir}"])
    cfg.groups["throughput"].max_inflight = 2 * int(cfg.engine.args.get("max_num_seqs", 64))
    validate(cfg)
    return cfg


def make_requests(tag: str, rnd: int, n: int, prompt_tokens: int, max_tokens: int, vocab: int) -> list[Generate]:
    rng = random.Random(rnd)
    return [Generate(f"{tag}-{rnd}-{i}", job="bench", session_id=f"s{rnd}-{i}", step=rnd,
                     prompt_token_ids=[rng.randrange(3, vocab) for _ in range(prompt_tokens)],
                     sampling=Sampling(max_tokens=max_tokens, temperature=1.0, seed=rnd * 100003 + i,
                                       ignore_eos=True))
            for i in range(n)]


def _tokens(results: list[Result]) -> int:
    bad = {r.status for r in results if r.status != "ok"}
    if bad:
        raise RuntimeError(f"failed requests in the benchmark: {bad}")
    return sum(len(r.output_token_ids) for r in results)


async def _compare(stack: Any, cfg: Any, batches: list[list[Generate]]) -> dict[str, list[float]]:
    engine = VllmEngine(cfg.engine)
    await engine.start()
    client = RouterClient(stack.run_dir)
    await client.connect(30)
    v, llm = engine.v, engine.llm
    assert v is not None and llm is not None

    async def direct_one(g: Generate) -> Result:
        final = None
        async for out in llm.generate(v.TokensPrompt(prompt_token_ids=g.prompt_token_ids),
                                      engine.sampling_params(g.sampling), g.request_id):
            final = out
        return engine.to_result(g.request_id, final)

    async def router_one(g: Generate) -> Result:
        return (await client.generate(g))[0]

    arms = {"router": router_one, "direct": direct_one}
    rates: dict[str, list[float]] = {"router": [], "direct": []}
    try:
        for i, reqs in enumerate(batches):
            for arm in (("router", "direct") if i % 2 == 0 else ("direct", "router")):
                await asyncio.sleep(IDLE_S)
                one = arms[arm]
                tagged = [msgspec.structs.replace(g, request_id=f"{arm}-{g.request_id}") for g in reqs]
                t0 = time.perf_counter()
                outs = await asyncio.gather(*(one(g) for g in tagged))
                rates[arm].append(_tokens(list(outs)) / (time.perf_counter() - t0))
        return rates
    finally:
        await client.close()
        await engine.close()


def run(quick: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        cfg = bench_config(str(Path(tmp) / "cache"))
        with LocalStack(cfg, Path(tmp) / "run") as stack:
            stack.start(timeout_s=600)
            return measure(stack, quick)


def measure(stack: Any, quick: bool = False) -> dict[str, Any]:
    """Both arms against the started ``stack`` (a router and one vLLM replica); the direct engine is
    built from the stack's own engine config."""
    cfg = stack.cfg
    n, prompt_tokens, max_tokens, rounds = (32, 64, 16, 1) if quick else (256, 64, 64, 5)
    # Round 0 warms both arms up; the rest are measured.
    batches = [make_requests("q", r, n, prompt_tokens, max_tokens, cfg.engine.vocab_size) for r in range(rounds + 1)]
    rates = asyncio.run(_compare(stack, cfg, batches))
    router_rates, direct_rates = rates["router"][1:], rates["direct"][1:]
    router_tps, direct_tps = max(router_rates), max(direct_rates)
    return {
        "router_tokens_per_s": round(router_tps, 1),
        "direct_tokens_per_s": round(direct_tps, 1),
        "ratio": round(router_tps / direct_tps, 3),
        # Less sensitive than best-over-best to a slow phase of a shared machine.
        "ratio_median_paired": round(statistics.median(r / d for r, d in zip(router_rates, direct_rates, strict=True)), 3),
        "router_rounds": [round(x, 1) for x in router_rates],
        "direct_rounds": [round(x, 1) for x in direct_rates],
        "requests": n,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "model": "tiny",
        "engine_args": dict(cfg.engine.args),
        "kv_cache_gib": cfg.engine.kv_cache_gib,
        "max_inflight": cfg.groups["throughput"].max_inflight,
    }
