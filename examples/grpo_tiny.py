"""A plain torch GRPO loop that closes the RL loop on the built-in tiny model, on CPU.

``launch`` runs the rollouts with real vLLM engines (``engine=vllm model=tiny``); this script is the
trainer. For every step it

1. waits for the step's samples (``toolkit.samples.wait_step``),
2. recomputes the sampled tokens' logprobs with its own model at the weights that generated them and
   reports the training-inference mismatch (mean |Δ logprob| and the k3 estimate of KL; with
   ``--partial``, apart for samples of older weights: ``*_stale``),
3. takes one GRPO step: advantages normalized within each group of ``--group`` samples of one prompt,
   the decoupled PPO objective (the clipped ratio against the trainer's own weights before the step,
   times the importance weight of those weights over the engine's, capped at ``--is-cap``),
4. publishes the new weights for the next step (``toolkit.weights.publish``), which the engines load
   before it begins (``rollout.max_staleness=0``: strictly on-policy); with ``--stream`` it streams
   them into the engines instead (``toolkit.weights.Streamer``, ``rollout.weights_transport=stream``).

``--partial``: steps close on a count (``rollout.close=count``, ``over_sample=0.25``,
``max_staleness=1``): the rollout runs a step ahead, a step's slowest sessions carry into the next
under the newer weights, and the trainer trains on whole groups that landed, their logprobs the
engine's: the importance weight corrects for the older weights, and the clip, taken against the
trainer's own weights, still lets stale rows move the policy (a ratio against the engine's weights
two updates back would sit outside the clip and carry no gradient).

The task has a verifiable reward a random model scores low on: the share of generated tokens that
fall in a target set of 64 of the 512 ids. It writes ``reward.csv`` and ``reward.png``::

    python examples/grpo_tiny.py --out runs/grpo --steps 12
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TARGET = frozenset(range(256, 320))
"""The ids the reward counts: an eighth of the tiny model's vocabulary."""


def reward(prompt: Any, generated: list[int], finish_reason: str) -> float:
    """The share of generated tokens in TARGET (SingleTurnEnv's reward function)."""
    return sum(t in TARGET for t in generated) / max(1, len(generated))


def write_prompts(path: Path, n: int, seed: int = 0) -> None:
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"token_ids": [rng.randrange(4, 256) for _ in range(rng.randrange(6, 14))]}) + "\n")


def launch_args(args: argparse.Namespace, run: Path, weights: Path, prompts: Path) -> list[str]:
    sessions = args.prompts_per_step * args.group
    return [
        sys.executable, "-m", "toolkit.launch", "engine=vllm", "model=tiny", "groups=single", "ranks=1",
        "workload=jsonl", "workload.name=target-tokens", "workload.tokenizer=null",
        "workload.env._target_=toolkit.rollout.envs.SingleTurnEnv", "~workload.env.max_turns",
        "~workload.env.observation_tokens", "~workload.env.vocab_size",
        "+workload.env.reward_fn=examples.grpo_tiny.reward", f"workload.max_tokens={args.max_tokens}",
        f"workload.prompts.path={prompts}", f"workload.prompts.samples_per_prompt={args.group}",
        "workload.prompts.tokenizer=null", f"sessions_per_step={sessions}", f"steps={args.steps}",
        f"engine.cache_dir={args.cache}",
        *(["rollout.weights_transport=stream"] if args.stream else [f"rollout.weights_dir={weights}"]),
        *(PARTIAL if args.partial else ["rollout.max_staleness=0"]),
        f"rollout.weights_timeout_s={args.timeout}", f"hydra.run.dir={run}", f"seed={args.seed}",
    ]


PARTIAL = ["rollout.close=count", "rollout.over_sample=0.25", "rollout.max_staleness=1"]
"""``--partial``'s settings (docs/partial.md)."""


def trainable(rows: list[dict[str, Any]], group: int) -> list[dict[str, Any]]:
    """The step's rows in whole groups that count: a group (one prompt's ``group`` sessions, landed
    together) is left out if any row of it was dropped as stale or filtered."""
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["started_step"], r["index"] // group), []).append(r)
    return [r for members in groups.values() if not any(m["status"] in ("stale", "filtered") for m in members)
            for r in members]


def token_logprobs(model: Any, rows: list[dict[str, Any]]) -> tuple[Any, Any]:
    """The trainer's logprob of every token given the ones before it, and the mask of response tokens."""
    import torch

    width = max(len(r["tokens"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        ids[i, : len(r["tokens"])] = torch.tensor(r["tokens"])
        mask[i, : len(r["tokens"])] = torch.tensor(r["loss_mask"], dtype=torch.float32)
    logits = model(input_ids=ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp, mask[:, 1:]


def mismatch(d: Any, mask: Any, suffix: str = "") -> dict[str, float | None]:
    """Mean |Δ logprob| and the k3 estimate of KL over the tokens of ``mask`` (None without any)."""
    import torch

    n = mask.sum()
    if n == 0:
        return {f"mean_abs_dlogprob{suffix}": None, f"k3_kl{suffix}": None}
    d = d * mask
    return {f"mean_abs_dlogprob{suffix}": float(d.abs().sum() / n),
            f"k3_kl{suffix}": float(((torch.exp(d) - 1 - d) * mask).sum() / n)}


def grpo_step(model: Any, opt: Any, rows: list[dict[str, Any]], group: int, clip: float,
              version: int, is_cap: float = 2.0) -> dict[str, float | None]:
    """One GRPO update on ``rows``; ``version``: the weights the trainer holds (the mismatch is reported
    apart for rows generated wholly on them and for older ones, ``_stale``)."""
    import torch

    rewards = torch.tensor([r["reward"] for r in rows]).view(-1, group)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    width = max(len(r["tokens"]) for r in rows)
    old = torch.zeros(len(rows), width - 1)
    for i, r in enumerate(rows):
        old[i, : len(r["tokens"]) - 1] = torch.tensor(r["rollout_logprobs"][1:], dtype=torch.float32)
    lp, mask = token_logprobs(model, rows)
    with torch.no_grad():
        # On the trainer's own weights: the same weights in two implementations (bf16 engine, fp32
        # trainer). On older ones (carried with --partial) it also holds how far the policy moved since.
        own = torch.tensor([[float(r["weight_versions"] == [version])] for r in rows])
        d = lp - old
        stats = {**mismatch(d, mask * own), **mismatch(d, mask * (1 - own), "_stale")}
    # Decoupled PPO (the proximal policy is the trainer's weights before this step): the same gradient
    # as a ratio against the engine's logprobs on rows of the trainer's own weights.
    prox = lp.detach()
    weight = torch.exp(prox - old).clamp(max=is_cap)
    ratio = torch.exp(lp - prox)
    obj = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv) * weight
    loss = -((obj * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.item(), **stats}


def plot(path: Path, history: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["reward_mean"] for h in history], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (share of target tokens)")
    ax.set_title("GRPO on the tiny model (vLLM on CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="a new directory: run/, weights/, reward.csv, reward.png")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--is-cap", type=float, default=2.0, help="cap of the importance weight over the engine's logprobs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a step (or weights)")
    p.add_argument("--cache", type=Path, default=Path("~/.cache/rollout-toolkit").expanduser())
    p.add_argument("--partial", action="store_true", help="steps close on a count (docs/partial.md)")
    p.add_argument("--stream", action="store_true",
                   help="stream the weights into the engines (rollout.weights_transport=stream), no checkpoints")
    args = p.parse_args(argv)

    import pyarrow.parquet  # noqa: F401 - wait_step reads Parquet
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.model.tiny import ensure_tiny
    from toolkit.samples import wait_step
    from toolkit.weights import Streamer, publish

    torch.manual_seed(args.seed)
    out = args.out.resolve()
    out.mkdir(parents=True)
    run, weights, prompts = out / "run", out / "weights", out / "prompts.jsonl"
    write_prompts(prompts, 64, args.seed)
    tiny = ensure_tiny(args.cache)
    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    config = json.loads((tiny / "config.json").read_text())
    root = Path(__file__).resolve().parent.parent  # the ranks import examples.grpo_tiny.reward
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    log = open(out / "launch.log", "w")  # noqa: SIM115 - the rollout process writes it until it ends
    rollout = subprocess.Popen(launch_args(args, run, weights, prompts), stdout=log, stderr=subprocess.STDOUT,
                               cwd=root, env=env)
    history: list[dict[str, Any]] = []
    streamer = None
    try:
        streamer = Streamer(run, connect_timeout_s=args.timeout) if args.stream else None
        for step in range(args.steps):
            rows = trainable(wait_step(run, step, args.timeout).to_pylist(), args.group)
            stats = grpo_step(model, opt, rows, args.group, args.clip, version=step, is_cap=args.is_cap)
            versions = sorted({v for r in rows for v in r["weight_versions"]})
            rec = {"step": step, "reward_mean": sum(r["reward"] for r in rows) / len(rows),
                   "weight_versions": versions, "carried": sum(r["carried"] > 0 for r in rows),
                   "staleness_max": max(r["staleness"] for r in rows), **stats}
            history.append(rec)
            print(json.dumps(rec), flush=True)
            # The weights for the next step: the engines hold them before it begins.
            bf16 = ((k, v.detach().to(torch.bfloat16)) for k, v in model.state_dict().items())
            if streamer is not None:
                if step + 1 < args.steps:  # the rollout runs no step after the last: nobody to send to
                    streamer.send(step + 1, bf16)
                    print(json.dumps({"streamed": streamer.last}), flush=True)
            else:
                publish(weights, step + 1, dict(bf16), config=config)
        code = rollout.wait(timeout=args.timeout)
        if code != 0:
            raise SystemExit(f"launch exited with {code}; see {out / 'launch.log'}")
    finally:
        if streamer is not None:
            streamer.close()
        if rollout.poll() is None:
            rollout.terminate()
            rollout.wait(timeout=120)
        log.close()
    with open(out / "reward.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(history[0]))
        w.writeheader()
        w.writerows({**h, "weight_versions": " ".join(map(str, h["weight_versions"]))} for h in history)
    plot(out / "reward.png", history)
    first, last = history[: 3], history[-3:]
    print(f"mean reward: first 3 steps {sum(h['reward_mean'] for h in first) / len(first):.3f}, "
          f"last 3 steps {sum(h['reward_mean'] for h in last) / len(last):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
