"""Streamed weight updates into a real vLLM engine (the CPU build) through the toolkit's weight-transfer
backend (``toolkit/engine/vllm_transfer.py``, registered in vLLM's factory by the toolkit's plugin): this
test is the trainer (``toolkit.weights`` wire and gloo link), the engine runs in this process.

The engine has two tensor-parallel workers, each keeping only its shard. A dense and then a delta update
land while requests run (none aborted, their tokens labelled with both
versions); greedy outputs after each equal those of the same weights loaded from a checkpoint; a delta
against another base is refused and a trainer that dies mid-update leave the engine serving the
previous version, and the next update lands."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers.requests import gen
from toolkit.config import compose_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[(7 * i + k) % 500 + 3 for i in range(40)] for k in range(4)]
TP = 2
"""Two workers: each keeps only its own shard of every update (a single worker's path, everything received
straight into one staging buffer, runs in ``test_vllm_stream_routed.py``)."""


def trainer_send(update: Any, world: int = 2, die_after_buckets: int = -1) -> tuple[int, threading.Thread, list]:
    """Host the update's rendezvous and send it from a thread; returns (port, thread, errors)."""
    from toolkit.weights.transport import Link

    store, port = Link.rendezvous("127.0.0.1", world, 60)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            link = Link("127.0.0.1", port, 0, world, 60, store=store)
            if die_after_buckets >= 0:  # a trainer that dies: some buckets, then its sockets close
                import torch

                payload = np.concatenate(update.pieces)
                for k, (s, e) in enumerate(update.manifest.buckets()[:die_after_buckets]):
                    link.pg.send([torch.from_numpy(payload[s:e])], 1, k).wait()
                link.pg = None  # the process group goes: its connections close
                return
            link.send(update.manifest, update.pieces)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return port, t, errors


@pytest.mark.timeout(600)
def test_streamed_dense_and_delta_updates_match_checkpoints_and_failures_keep_the_previous_version(
        models: dict[str, Path], tmp_path: Path) -> None:
    import msgspec

    from toolkit.core.protocol import StreamWeights
    from toolkit.engine.vllm import VllmEngine
    from toolkit.engine.vllm_receiver import read_checkpoint, to_torch
    from toolkit.engine.vllm_transfer import STREAM_ARGS
    from toolkit.weights import publish
    from toolkit.weights.wire import Encoder, Encoding

    cfg = compose_config(["model=tiny", f"engine.cache_dir={models['cache']}", "groups=single", f"engine.tensor_parallel_size={TP}",
                          f"++engine.args.weight_transfer_config={{backend: {STREAM_ARGS['weight_transfer_config']['backend']}}}",
                          f"++engine.args.worker_extension_cls={STREAM_ARGS['worker_extension_cls']}"])
    ckpt = read_checkpoint(str(models["ckpt"]))
    rng = np.random.default_rng(0)
    perturbed = {}
    for name, (b, dtype) in ckpt.items():
        b = b.copy()
        flat = b.reshape(-1)
        flat[rng.choice(flat.size, max(1, flat.size // 100), replace=False)] ^= 1  # 1%: the last mantissa bit
        perturbed[name] = (b, dtype)

    def as_torch(state: dict) -> dict:
        return {n: to_torch(b, d) for n, (b, d) in state.items()}

    async def greedy(engine: VllmEngine) -> list[list[int]]:
        outs = await asyncio.gather(*(engine.generate(gen(f"g{k}-{id(p)}-{rng.integers(1 << 30)}", p, 24,
                                                          temperature=0.0, ignore_eos=True))
                                      for k, p in enumerate(PROMPTS)))
        assert all(o.status == "ok" for o in outs), outs
        return [o.output_token_ids for o in outs]

    async def stream(engine: VllmEngine, update: Any, version: int, **kw: Any) -> None:
        port, t, errors = trainer_send(update, world=1 + TP, **kw)
        msg = StreamWeights(version, msgspec.msgpack.encode(update.manifest), "127.0.0.1", port,
                            update.manifest.base, 60.0, rank=1, world=1 + TP)
        try:
            await engine.stage_stream(msg)
            await engine.apply_stream(version)
        finally:
            await asyncio.to_thread(t.join, 60)
            assert not t.is_alive()

    async def main() -> None:
        engine = VllmEngine(cfg.engine)
        await engine.start()
        try:
            base = await greedy(engine)
            # Each worker holds its own shard of the checkpoint (the norms whole): about half of it.
            total = sum(b.nbytes for b, _ in ckpt.values())
            held = [st["held_bytes"] for st in await engine.llm.collective_rpc("toolkit_stream_status")]
            assert len(held) == TP and all(0.4 * total < h < 0.6 * total for h in held), (held, total)
            enc = Encoder(bucket_bytes=64 << 10)
            named = [(n, b, d) for n, (b, d) in ckpt.items()]
            dense = enc.encode(1, named, delta=True)
            assert dense.manifest.base == -1
            # Requests run through the update: none aborted, their later tokens from version 1.
            before = engine.counters.generated_tokens
            running = [asyncio.create_task(engine.generate(gen(f"run{k}", PROMPTS[k], 900, temperature=1.0, seed=k,
                                                               ignore_eos=True))) for k in range(2)]
            for _ in range(600):  # until they are decoding (the stats logger counts their tokens)
                if engine.counters.generated_tokens >= before + 20:
                    break
                await asyncio.sleep(0.1)
            await stream(engine, dense, 1)
            assert not all(t.done() for t in running)  # a machine that ran 900 tokens meanwhile: no test
            enc.commit()
            done = await asyncio.gather(*running)
            assert all(r.status == "ok" and len(r.output_token_ids) == 900 for r in done), done
            assert any(set(r.weight_versions) == {0, 1} for r in done), [r.weight_versions for r in done]
            s1 = await greedy(engine)
            assert engine.weight_version == 1 and s1 != base

            delta = enc.encode(2, [(n, b, d) for n, (b, d) in perturbed.items()], delta=True)
            assert delta.manifest.base == 1 and any(t.encoding == Encoding.DELTA for t in delta.manifest.tensors)
            assert delta.manifest.total < 0.1 * delta.manifest.dense_bytes
            await stream(engine, delta, 2)
            enc.commit()
            s2 = await greedy(engine)

            # The same weights from checkpoints: the same greedy tokens.
            c2_dir = publish(tmp_path / "w", 3, as_torch(perturbed), config=None, files=[models["ckpt"] / "config.json"])
            await engine.load_weights(str(c2_dir), 3)
            assert await greedy(engine) == s2
            await engine.load_weights(str(models["ckpt"]), 4)
            c1 = await greedy(engine)
            assert c1 == s1

            # A delta against version 2 when the engine holds 4: refused, the engine serves version 4.
            wrong = enc.encode(5, [(n, b, d) for n, (b, d) in ckpt.items()], delta=True)
            assert wrong.manifest.base == 2
            with pytest.raises(RuntimeError, match="WrongBase"):
                await stream(engine, wrong, 5)
            assert engine.weight_version == 4 and await greedy(engine) == c1

            # A trainer that dies after 2 buckets of a dense update: the engine serves version 4 on.
            again = Encoder(bucket_bytes=16 << 10).encode(6, [(n, b, d) for n, (b, d) in perturbed.items()], delta=False)
            assert len(again.manifest.buckets()) > 2
            with pytest.raises(RuntimeError, match="LinkBroken"):
                await stream(engine, again, 6, die_after_buckets=2)
            assert engine.weight_version == 4 and await greedy(engine) == c1 and not engine.dead()
            # ... and the trainer's next send lands.
            await stream(engine, again, 6)
            assert engine.weight_version == 6 and await greedy(engine) == s2
            held = [st["held_bytes"] for st in await engine.llm.collective_rpc("toolkit_stream_status")]
            assert all(0.4 * total < h < 0.6 * total for h in held), (held, total)  # after reloads too
        finally:
            await engine.close()

    asyncio.run(main())
