"""vLLM's own KV events (the CPU build, the tiny model) in the replica's log as toolkit block hashes:
what the engine says it stores is exactly the blocks the router's hash of the same tokens names, a
prefix the events say is cached is what vLLM's own prefix cache then finds, a reset clears it, and a
batch the subscriber missed comes back from vLLM's replay endpoint."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

if os.environ.get("TOOLKIT_REQUIRE_VLLM"):
    import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm")

from tests.helpers.requests import gen  # noqa: E402
from toolkit.config import compose_config  # noqa: E402
from toolkit.core.blocks import block_hashes  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


async def _settled(engine, log, want: set[int], timeout_s: float = 30.0) -> set[int]:  # type: ignore[no-untyped-def]
    """The blocks the events say are held, once they include ``want`` (events trail the outputs)."""
    for _ in range(int(timeout_s / 0.05)):
        held = set(engine.kv_held())
        if want <= held:
            return held
        await asyncio.sleep(0.05)
    return set(engine.kv_held())


@pytest.mark.timeout(600)
def test_vllm_kv_events_name_the_blocks_the_router_hashes(models: dict[str, Path]) -> None:
    from toolkit.engine.vllm import VllmEngine

    cfg = compose_config(["model=tiny", f"engine.cache_dir={models['cache']}", "groups=single"])

    async def main() -> None:
        engine = VllmEngine(cfg.engine)
        log = engine.kv_events()
        info = await engine.start()
        bs = info.kv_block_size
        try:
            assert bs > 0 and info.kv_capacity_tokens >= bs
            prompt = [(11 * i) % 400 + 3 for i in range(5 * bs + 3)]
            res = await engine.generate(gen("a", prompt, 2 * bs, temperature=0.0, ignore_eos=True))
            assert res.status == "ok"
            # vLLM caches whole blocks of what it computed: the prompt and all output tokens but the last.
            context = prompt + res.output_token_ids[:-1]
            want = set(block_hashes(context, bs))
            held = await _settled(engine, log, want)
            assert want <= held, (len(want - held), len(held))
            batch = log.take()
            assert batch is not None and want <= set(batch.stored) and not batch.cleared

            # A second prompt sharing the first 3 blocks: vLLM finds what the hashes said it holds.
            other = prompt[: 3 * bs] + [(7 * i) % 300 + 5 for i in range(2 * bs)]
            shared = sum(1 for h in block_hashes(other, bs) if h in held) * bs
            assert shared == 3 * bs
            res2 = await engine.generate(gen("b", other, 4, temperature=0.0, ignore_eos=True))
            assert res2.status == "ok" and res2.cached_tokens == shared

            # A lost batch comes back from vLLM's replay endpoint, in order.
            kv = engine.kv
            assert kv is not None
            kv.held.clear()
            kv._next = 0  # as if nothing had arrived: everything is replayed from batch 0
            third = [(5 * i) % 200 + 9 for i in range(3 * bs + 1)]
            res3 = await engine.generate(gen("c", third, 4, temperature=0.0, ignore_eos=True))
            assert res3.status == "ok"
            want3 = want | set(block_hashes(third + res3.output_token_ids[:-1], bs))
            held = await _settled(engine, log, want3)
            assert want3 <= held

            # A reset of the prefix cache: every block goes, and the log says so (vLLM publishes a step's
            # events with its output: the next request's step carries the clear).
            log.take()
            assert await engine.llm.reset_prefix_cache()
            res4 = await engine.generate(gen("d", third, 4, temperature=0.0, ignore_eos=True))
            assert res4.status == "ok" and res4.cached_tokens == 0
            want4 = set(block_hashes(third + res4.output_token_ids[:-1], bs))
            held = await _settled(engine, log, want4)
            assert held == want4
            cleared = log.take()
            assert cleared is not None and cleared.cleared and want4 <= set(cleared.stored)
        finally:
            where = Path(engine.kv.endpoint.removeprefix("ipc://")).parent if engine.kv is not None else None
            await engine.close()
        assert where is not None and not where.exists()  # the events' ipc directory went with the engine

    asyncio.run(main())


def test_a_sliding_window_groups_removal_leaves_the_full_attention_block_held() -> None:
    """vLLM hybrid models: every KV-cache group stores a block under the same hash, and a sliding-window
    group evicts the front blocks early; group 0 (full attention) still holds them."""
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    from toolkit.engine.kv_events import KvEventLog
    from toolkit.engine.vllm_kv import VllmKvEvents

    log = KvEventLog()
    kv = VllmKvEvents(log, "/nowhere")
    kv._decoder = msgspec.msgpack.Decoder(KVEventBatch)
    tokens = list(range(100, 108))

    def stored(group: int) -> BlockStored:
        return BlockStored(block_hashes=[b"h1", b"h2"], parent_block_hash=None, token_ids=tokens, block_size=4,
                           lora_id=None, medium="GPU", lora_name=None, group_idx=group)

    batch = KVEventBatch(ts=0.0, events=[stored(0), stored(1), BlockRemoved(block_hashes=[b"h1"], medium="GPU", group_idx=1)])
    kv._apply(0, msgspec.msgpack.Encoder().encode(batch))
    taken = log.take()
    assert taken is not None and taken.stored == block_hashes(tokens, 4) and taken.removed == []
