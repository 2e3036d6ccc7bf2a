"""A real router and one vLLM replica (the package's routed), a client: round trip with logprobs
and n, abort, client errors, LoRA present / missing / appearing late, weight reload with versions."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.helpers.aio import with_client  # noqa: E402
from tests.helpers.vllm import gen  # noqa: E402
from toolkit.client import RouterClient, WeightsUpdateFailed  # noqa: E402
from toolkit.launch.stack import LocalStack  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


# ---- router + one replica, a client ---------------------------------------------------------------
class TestThroughRouter:
    def test_round_trip_with_logprobs_seeds_samples_and_prefix_cache(self, routed: LocalStack) -> None:
        async def body(c: RouterClient) -> None:
            res, route = await c.generate(gen("rt1", seed=7, ignore_eos=True))
            assert res.status == "ok" and res.finish_reason == "length" and not res.error
            assert len(res.output_token_ids) == len(res.logprobs) == 16
            assert all(0 <= t < 512 for t in res.output_token_ids)
            assert all(lp <= 0.0 for lp in res.logprobs) and any(lp < 0.0 for lp in res.logprobs)
            assert res.group == "throughput" and res.replica_id.startswith("throughput-0@")
            assert res.weight_version == 0 and route is not None and route.dispatches == 1
            again, _ = await c.generate(gen("rt2", seed=7, ignore_eos=True))
            assert again.output_token_ids == res.output_token_ids  # same seed, same tokens
            assert again.cached_tokens >= 64  # two 32-token blocks of the prompt
            many, _ = await c.generate(gen("rt3", n=3, seed=1, ignore_eos=True))
            assert many.status == "ok" and len(many.samples) == 2
            assert all(len(s.output_token_ids) == len(s.logprobs) == 16 for s in many.samples)
            assert len({tuple(many.output_token_ids), *(tuple(s.output_token_ids) for s in many.samples)}) > 1
            plain, _ = await c.generate(gen("rt4", logprobs=False))
            assert plain.status == "ok" and plain.output_token_ids and plain.logprobs == []

        asyncio.run(with_client(routed.run_dir, body, 120))

    def test_abort_reaches_the_engine(self, routed: LocalStack) -> None:
        async def body(c: RouterClient) -> None:
            task = asyncio.create_task(c.generate(gen("ab1", prompt=[9, 8, 7], max_tokens=1000, ignore_eos=True)))
            await asyncio.sleep(0.5)
            await c.abort("ab1")
            res, _ = await task
            assert res.status == "cancelled" and res.finish_reason == "abort"
            assert len(res.output_token_ids) < 1000 and len(res.logprobs) == len(res.output_token_ids)
            ok, _ = await c.generate(gen("ab2"))
            assert ok.status == "ok"

        asyncio.run(with_client(routed.run_dir, body, 120))

    def test_client_errors_fail_at_once_and_are_not_retried(self, routed: LocalStack) -> None:
        async def body(c: RouterClient) -> None:
            # A prompt of exactly max_model_len leaves no room for output: the router refuses it, as vLLM does.
            full, route = await c.generate(gen("ce1", prompt=[5] * 1024))
            assert full.status == "client_error" and "no room for an output token in max_model_len 1024" in full.error
            assert route is not None and route.dispatches == 0
            top_p, route = await c.generate(gen("ce2", top_p=0.0))
            assert top_p.status == "client_error" and "top_p" in top_p.error and route.dispatches == 1
            greedy_n, _ = await c.generate(gen("ce3", n=3, temperature=0.0))
            assert greedy_n.status == "client_error"
            oov, route = await c.generate(gen("ce4", prompt=[1, 512]))  # the vocabulary the engine reported
            assert oov.status == "client_error" and route.dispatches == 0
            ok, _ = await c.generate(gen("ce5"))
            assert ok.status == "ok"

        asyncio.run(with_client(routed.run_dir, body, 120))

    def test_lora_present_missing_and_appearing_late(self, routed: LocalStack, models: dict,
                                                     tmp_path: Path) -> None:
        async def body(c: RouterClient) -> None:
            base, _ = await c.generate(gen("lo0", temperature=0.0))
            lora, _ = await c.generate(gen("lo1", temperature=0.0, lora=str(models["lora"])))
            assert base.status == lora.status == "ok"
            assert lora.output_token_ids != base.output_token_ids
            missing, _ = await c.generate(gen("lo2", lora=str(tmp_path / "nope"), deadline=time.time() + 4))
            assert missing.status == "adapter_missing" and "adapter_config.json" in missing.error
            alive, _ = await c.generate(gen("lo3", temperature=0.0))
            assert alive.output_token_ids == base.output_token_ids  # the engine survived it
            late_dir = tmp_path / "late"
            late = asyncio.create_task(c.generate(gen("lo4", temperature=0.0, lora=str(late_dir),
                                                      deadline=time.time() + 120)))
            await asyncio.sleep(2.0)
            assert not late.done()
            shutil.copytree(models["lora"], tmp_path / "staging")
            os.rename(tmp_path / "staging", late_dir)
            res, _ = await late
            assert res.status == "ok" and res.output_token_ids == lora.output_token_ids

        asyncio.run(with_client(routed.run_dir, body, 120))

    def test_weight_reload_versions_results_and_resets_the_prefix_cache(self, routed: LocalStack,
                                                                         models: dict) -> None:
        async def body(c: RouterClient) -> None:
            before, _ = await c.generate(gen("w0", temperature=0.0))
            ack = await c.update_weights(str(models["ckpt"]), 3)
            assert ack.replicas == 1 and ack.version == 3
            after, _ = await c.generate(gen("w1", temperature=0.0))
            assert after.status == "ok" and after.weight_version == 3
            assert after.output_token_ids != before.output_token_ids
            assert after.cached_tokens == 0  # the old weights' KV is gone
            with pytest.raises(WeightsUpdateFailed, match="no checkpoint directory"):
                await c.update_weights(str(models["ckpt"]) + "-missing", 4)
            still, _ = await c.generate(gen("w2", temperature=0.0))
            assert still.weight_version == 3 and still.output_token_ids == after.output_token_ids

        asyncio.run(with_client(routed.run_dir, body, 120))
