"""``rollout.update_mode=pause`` on real vLLM (the CPU build) with the tiny model: a weight update in
the middle of long generations. vLLM pauses between steps (``pause_generation(mode="keep")``), reloads
another checkpoint of the same architecture (different random weights), resets its prefix cache with
the running requests' KV (they prefill their context again with the new weights) and resumes: every
request finishes with its whole budget, none is aborted or retried, each lists both versions, and the
tokens after the switch are not those of a run without the update."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("TOOLKIT_REQUIRE_VLLM"):
    import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm")

from tests.helpers.aio import with_client  # noqa: E402
from toolkit.client import RouterClient, router_status  # noqa: E402
from toolkit.config import compose_config  # noqa: E402
from toolkit.core import protocol as P  # noqa: E402
from toolkit.core.lifecycle import read_pidfiles  # noqa: E402
from toolkit.launch.stack import LocalStack  # noqa: E402
from toolkit.launch.validation import validate  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BUDGET = 1900  # seconds of generation for the tiny model on 2 cores (max_model_len 2048): the update lands mid-way
PROMPTS = [[(7 * i + k) % 500 + 3 for i in range(40)] for k in range(6)]


@pytest.fixture(scope="module")
def stack(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    # models["ckpt"]: seed 1; the engine's model (model=tiny, built in models["cache"]) is seed 0.
    # On these 2 cores the engine's worker threads spin on both of them; the replica keeps its CPU
    # because they run at a lower priority (engine.cpu_engine_nice, by default). A replica is dropped
    # only after 10 s without heartbeats: what this test checks is the update. Heartbeats come every
    # 0.1 s so the test sees generation under way (and sends the update) early in the requests' budget.
    cfg = compose_config(["model=tiny", f"engine.cache_dir={models['cache']}", "groups=single",
                          "engine.max_model_len=2048", "rollout.update_mode=pause", "++engine.args.max_num_seqs=8",
                          "router.heartbeat_s=0.1", "router.missed_heartbeats=100"])
    validate(cfg)
    with LocalStack(cfg, tmp_path_factory.mktemp("paused") / "run") as st:
        st.start(timeout_s=300)
        engines = [r for r in read_pidfiles(st.run_dir.pids) if r.name.endswith("-engine") and r.alive()]
        assert engines and all(os.getpriority(os.PRIO_PROCESS, r.pid) >= 10 for r in engines)
        yield st, models["ckpt"]


def requests(tag: str) -> list[P.Generate]:
    """Six greedy generations and two seeded sampled ones, each to its whole budget (ignore_eos)."""
    greedy = [P.Generate(f"{tag}-g{k}", job="t", session_id=f"g{k}", step=0, prompt_token_ids=p,
                         sampling=P.Sampling(max_tokens=BUDGET, temperature=0.0, ignore_eos=True))
              for k, p in enumerate(PROMPTS)]
    seeded = [P.Generate(f"{tag}-s{k}", job="t", session_id=f"s{k}", step=0, prompt_token_ids=PROMPTS[k],
                         sampling=P.Sampling(max_tokens=BUDGET, temperature=1.0, seed=7, ignore_eos=True))
              for k in range(2)]
    return greedy + seeded


async def generated(stack: LocalStack) -> int:
    st = await asyncio.to_thread(router_status, stack.frontend, 2.0)
    assert st is not None
    return sum(g.generated_tokens for g in st.groups.values())


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.timeout(900)
def test_an_update_mid_generation_aborts_nothing_and_the_later_tokens_change(stack: Any) -> None:
    st, ckpt = stack

    async def body(c: RouterClient) -> None:
        before = await generated(st)
        base = await asyncio.gather(*(c.generate(m) for m in requests("base")))
        for res, _ in base:
            assert res.status == "ok" and len(res.output_token_ids) == BUDGET and res.weight_versions == [0]
        # The same requests again; once they are well under way (the engine's count, from heartbeats,
        # past the baseline's tokens), the update.
        start = before + len(base) * BUDGET
        running = [asyncio.create_task(c.generate(m)) for m in requests("live")]
        while await generated(st) < start + len(running) * 8:
            await asyncio.sleep(0.02)
        assert not any(t.done() for t in running)
        ack = await c.update_weights(str(ckpt), 1)
        assert (ack.version, ack.replicas, ack.error) == (1, 1, "")
        live = await asyncio.gather(*running)
        for (res, route), (old, _) in zip(live, base, strict=True):
            assert res.status == "ok" and res.finish_reason == "length" and not res.error, res
            assert len(res.output_token_ids) == len(res.logprobs) == BUDGET
            assert route is not None and route.dispatches == 1  # never aborted, retried nor moved
            assert res.weight_versions == [0, 1] and res.weight_version == 1
            assert res.output_token_ids != old.output_token_ids
        for (res, _), (old, _) in list(zip(live, base, strict=True))[:len(PROMPTS)]:  # greedy: same start, other ending
            k = common_prefix(res.output_token_ids, old.output_token_ids)
            assert 0 < k < BUDGET, k
            assert res.output_token_ids[-50:] != old.output_token_ids[-50:]
        # After the update: the new version only, and the engine serves on.
        after, _ = await c.generate(requests("after")[0])
        assert after.status == "ok" and after.weight_versions == [1] and len(after.output_token_ids) == BUDGET
        assert after.output_token_ids != base[0][0].output_token_ids

    asyncio.run(with_client(st.run_dir, body, timeout_s=600))


def test_an_update_that_fails_half_way_resumes_nothing_on_its_weights(stack: Any, tmp_path: Any) -> None:
    """A checkpoint whose weights vLLM cannot read (the directory exists, its safetensors is garbage):
    the requests in the engine are not resumed on half-loaded weights. They end as engine_dead, the
    router runs them again on the restarted engine (the last good weights), and the update fails loudly."""
    import shutil

    from toolkit.client import WeightsUpdateFailed

    st, ckpt = stack
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "model.safetensors").write_bytes(b"\0" * 64)

    async def body(c: RouterClient) -> None:
        start = await generated(st)
        msgs = [P.Generate(f"bad-{k}", job="t", session_id=f"b{k}", step=0, prompt_token_ids=PROMPTS[k],
                           sampling=P.Sampling(max_tokens=BUDGET, temperature=0.0, ignore_eos=True)) for k in range(2)]
        running = [asyncio.create_task(c.generate(m)) for m in msgs]
        while await generated(st) < start + 40:
            await asyncio.sleep(0.02)
        assert not any(t.done() for t in running)
        with pytest.raises(WeightsUpdateFailed, match="bad"):
            await c.update_weights(str(bad), 7)
        for res, route in await asyncio.gather(*running):
            assert res.status == "ok" and len(res.output_token_ids) == BUDGET, res
            assert 7 not in res.weight_versions and route is not None and route.dispatches == 2

    asyncio.run(with_client(st.run_dir, body, timeout_s=600))
