"""``router.policy=kv_aware`` on real vLLM (the CPU build, the tiny model): two replicas, one per group.
The engines' own KV events reach the router, its index predicts what vLLM then finds cached, and a
session whose turn was forced onto the other replica has its next turn sent there, where vLLM's own
prefix-cache counters count the hit."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("TOOLKIT_REQUIRE_VLLM"):
    import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm")

from tests.helpers.aio import with_client  # noqa: E402
from tests.helpers.requests import gen  # noqa: E402
from toolkit.client import RouterClient, router_status  # noqa: E402
from toolkit.config import compose_config  # noqa: E402
from toolkit.core import protocol as P  # noqa: E402
from toolkit.launch.stack import LocalStack  # noqa: E402
from toolkit.launch.validation import validate  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _status(stack: LocalStack) -> P.Status:
    st = router_status(stack.frontend, 5.0)
    assert st is not None and st.kv is not None
    return st


async def _index_has(stack: LocalStack, replica: str, blocks: int, timeout_s: float = 30.0) -> None:
    """vLLM publishes a step's events from its own thread: they trail the step's outputs by a moment."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kv = (await asyncio.to_thread(_status, stack)).kv
        assert kv is not None
        if kv.cached_blocks.get(replica, 0) >= blocks:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the index never showed {blocks} blocks on {replica}")


@pytest.mark.timeout(900)
def test_a_turn_goes_to_the_vllm_replica_that_holds_its_prefix(models: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    cfg = compose_config(["model=tiny", f"engine.cache_dir={models['cache']}", "groups.throughput.replicas=1",
                          "groups.tail.replicas=1", "groups.tail.engine.tensor_parallel_size=1",
                          "tail.policy=count", "tail.threshold=null", "router.policy=kv_aware"])
    validate(cfg)
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start(timeout_s=400)

        async def body(c: RouterClient) -> None:
            kv = (await asyncio.to_thread(_status, stack)).kv
            assert kv is not None and len(kv.cached_blocks) == 2  # both replicas report events
            prompts = {f"s{k}": [(13 * k + 7 * i) % 400 + 3 for i in range(300)] for k in range(4)}
            first: dict[str, Any] = {}
            for sid, p in prompts.items():  # forced onto the tail replica: the group named
                res, _ = await c.generate(gen(f"{sid}-1", p, 40, session=sid, group="tail", temperature=0.0,
                                              ignore_eos=True))
                assert res.status == "ok" and res.group == "tail", res
                first[sid] = res
            tail = first["s0"].replica_id
            before = (await asyncio.to_thread(_status, stack)).kv
            assert before is not None
            await _index_has(stack, tail, sum(len(p) + 39 for p in prompts.values()) // 128)
            second = {}
            for sid, p in prompts.items():  # no group named: where the prefix is
                ctx = p + first[sid].output_token_ids + [9] * 8
                res, _ = await c.generate(gen(f"{sid}-2", ctx, 8, session=sid, temperature=0.0, ignore_eos=True))
                assert res.status == "ok", res
                second[sid] = res
            for sid, res in second.items():
                assert res.replica_id == tail, (sid, res.replica_id)
                assert res.cached_tokens >= 300, (sid, res.cached_tokens)  # vLLM's own count of its hit
            after = (await asyncio.to_thread(_status, stack)).kv
            assert after is not None
            # The index predicted exactly what vLLM found for these turns, and vLLM's counters saw the hits.
            assert after.predicted_tokens - before.predicted_tokens == sum(r.cached_tokens for r in second.values())
            for _ in range(100):  # the engines' counters come with their next heartbeat
                kv = (await asyncio.to_thread(_status, stack)).kv
                assert kv is not None
                if kv.reported_hit > 0:
                    break
                await asyncio.sleep(0.1)
            assert kv.reported_hit > 0

        asyncio.run(with_client(stack.run_dir, body, timeout_s=600))
