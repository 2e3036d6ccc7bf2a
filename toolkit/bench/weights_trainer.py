"""``bench weights``' trainer, in its own process (``python -m toolkit.bench.weights_trainer``): the model in
fp32 master weights with AdamW, and each run's three arms against the run's two replicas:

- ``checkpoint``: publish the bf16 weights (``toolkit.weights.publish``), every replica loads them;
- ``stream_dense``: ``Streamer.send`` of the bf16 weights, every tensor dense;
- ``stream_delta``: a few real AdamW steps (``--lr``, batches of random tokens, causal LM loss), cast to
  bf16, ``Streamer.send`` as a delta against the dense arm's version.

Then the link's bound: a raw gloo broadcast of the same bytes from this process to two receiver
processes on the same host (``--receiver``). One JSON object per line on stdout: each update, then
the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from toolkit.client import RouterClient
from toolkit.core.rundir import RunDir
from toolkit.weights import Streamer, publish
from toolkit.weights.transport import Link


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def bf16_state(model: Any) -> list[tuple[str, Any]]:
    import torch  # the vllm extra's

    return [(k, v.detach().to(torch.bfloat16)) for k, v in model.state_dict().items()]


def load(run: RunDir, path: Path, version: int) -> None:
    async def body() -> None:
        c = RouterClient(run)
        await c.connect(60)
        try:
            await c.update_weights(str(path), version, timeout_s=900)
        finally:
            await c.close()

    asyncio.run(body())


def link_bound(nbytes: int, rounds: int, host: str = "127.0.0.1") -> list[float]:
    """Seconds of a raw gloo broadcast of ``nbytes`` from here to two receiver processes, ``rounds``
    times, every process's buffer written once before and kept (as the chain's staging buffers are).
    Each round sends another value, which each receiver checks outside the timing."""
    import torch  # the vllm extra's

    buf = torch.zeros(nbytes, dtype=torch.uint8)
    store, port = Link.rendezvous(host, 3, 300)
    procs = [subprocess.Popen([sys.executable, "-m", "toolkit.bench.weights_trainer", "--receiver", str(rank),
                               "--port", str(port), "--bytes", str(nbytes), "--rounds", str(rounds)])
             for rank in (1, 2)]
    try:
        link = Link(host, port, 0, 3, 300, store=store)
        times = []
        for r in range(rounds):
            buf.fill_(_round_value(r))
            link.barrier()
            times.append(link.broadcast_raw(buf))
        link.close()
    finally:
        codes = [p.wait(120) for p in procs]
    if any(codes):
        raise RuntimeError(f"a receiver of the link bound failed (exit codes {codes})")
    return times


def _round_value(r: int) -> int:
    return r % 255 + 1


def receiver(rank: int, port: int, nbytes: int, rounds: int) -> None:
    import torch  # the vllm extra's

    link = Link("127.0.0.1", port, rank, 3, 300)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    for r in range(rounds):
        link.barrier()
        link.broadcast_raw(buf)
        if not bool((buf == _round_value(r)).all()):
            raise SystemExit(f"rank {rank}: round {r} of the link bound did not receive the bytes sent")
    link.close()


def train(model: Any, opt: Any, batches: int, seq: int, vocab: int, gen: Any) -> float:
    """``batches`` AdamW steps on random tokens (next-token loss): returns the last loss."""
    import torch  # the vllm extra's

    loss = torch.tensor(0.0)
    for _ in range(batches):
        ids = torch.randint(3, vocab, (2, seq), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss)


def trainer(a: argparse.Namespace) -> None:
    import torch  # the vllm extra's
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    run = RunDir(Path(a.run))
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, foreach=False)
    config = json.loads((Path(a.model) / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    version = 0
    with Streamer(run.root, bucket_mb=a.bucket_mb, timeout_s=300) as streamer:
        for r in range(a.runs):
            version += 1
            state = bf16_state(model)
            t0 = time.monotonic()
            path = publish(Path(a.weights), version, dict(state), config=config)
            published = time.monotonic() - t0
            load(run, path, version)
            emit(arm="checkpoint", run=r, version=version, update_s=time.monotonic() - t0, publish_s=published)

            version += 1
            t0 = time.monotonic()
            streamer.send(version, state, delta=False)
            emit(arm="stream_dense", run=r, version=version, update_s=time.monotonic() - t0, **_sizes(streamer))

            loss = train(model, opt, a.batches, a.seq, config["vocab_size"], gen)
            version += 1
            state = bf16_state(model)
            t0 = time.monotonic()
            streamer.send(version, state, delta=True)
            emit(arm="stream_delta", run=r, version=version, update_s=time.monotonic() - t0, loss=loss,
                 **_sizes(streamer))
        nbytes = streamer.last["dense_bytes"]
    del opt, model
    emit(link_bound_s=link_bound(nbytes, a.bound_rounds), bytes=nbytes)


def _sizes(streamer: Streamer) -> dict[str, Any]:
    return {k: streamer.last[k] for k in ("bytes", "dense_bytes", "delta", "replicas")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--receiver", type=int, default=0, help="a receiver of the link bound (its rank)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--bytes", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--run", default="")
    p.add_argument("--model", default="")
    p.add_argument("--weights", default="")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--bound-rounds", type=int, default=4)
    a = p.parse_args()
    if a.receiver:
        receiver(a.receiver, a.port, a.bytes, a.rounds)
    else:
        trainer(a)


if __name__ == "__main__":
    main()
