"""A step's lower bound: how soon the step could have ended on this fleet, whatever the scheduling.

``bound_s`` is the larger of two bounds, each from the engines' own time model and the step's
requests as they ran (prompt, cached and generated tokens of every turn):

- **critical path**: a session's turns run one after another, so the step lasts at least as long as
  its longest session would take alone on the fastest group: each turn's uncached prompt prefilled,
  then its tokens decoded one step each with nothing else in the batch (the context growing by one
  per token). A gateway call with ``n > 1`` counts once (its samples run side by side).
- **throughput**: every generated token has to be decoded somewhere; at best each replica runs
  full batches (``max_num_seqs``), sharing the weight reads, while each token still reads its own
  context's KV and its share of the prefill. All tokens over the fleet's summed peak rate.

``bound_ratio = wall_s / bound_s`` says how far scheduling (and everything outside generation:
environments, tools, the step's bookkeeping) left the step from that floor. Only engines with a
time model give a bound (the ``sim``); for others it is null.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from toolkit.config import Config, SimEngineConfig, group_engine
from toolkit.engine.sim import step_seconds, tp_speedup
from toolkit.rollout.columns import Columns


def _alone_s(c: SimEngineConfig, prompt: np.ndarray, cached: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Seconds (before ``time_scale``) of each request alone on a replica of config ``c``: its
    uncached prompt prefilled in its first step, then one decode step per token at context
    ``prompt + k``. The sum over k of the KV term has a closed form."""
    s = tp_speedup(c)
    per_step = step_seconds(c, 0)
    kv = c.kv_bytes_per_token / (c.hbm_bandwidth * s)
    context_sum = out * prompt + out * (out - 1) / 2
    return out * per_step + kv * context_sum + (prompt - cached) / (c.prefill_tokens_per_s * s)


def _calls(req: Columns) -> tuple[np.ndarray, np.ndarray]:
    """Index of each request's call (the requests of one session sent at the same moment: a gateway
    call with ``n > 1``), and each call's session."""
    sent = req["done_at"] - req["latency_s"]
    keys = np.stack([req["session"], np.round(sent, 6)])
    _, first, call = np.unique(keys, axis=1, return_index=True, return_inverse=True)
    return call.reshape(-1), req["session"][first]


def step_bound(cfg: Config, req: Columns, wall_s: float) -> dict[str, Any] | None:
    engines = {g: group_engine(cfg, g) for g in cfg.groups}
    if not all(isinstance(e, SimEngineConfig) for e in engines.values()):
        return None
    out = req["output_tokens"].astype(np.float64)
    if not out.size or out.sum() == 0:
        return None
    prompt = req["prompt_tokens"].astype(np.float64)
    cached = np.minimum(req["cached_tokens"], req["prompt_tokens"]).astype(np.float64)
    scale = engines[next(iter(engines))].time_scale
    call, call_session = _calls(req)
    n_sessions = int(call_session.max()) + 1

    best_session = np.full(n_sessions, np.inf)
    fleet_rate = 0.0
    tokens = out.sum()
    context_per_token = (out * prompt + out * (out - 1) / 2).sum() / tokens
    prefill_per_token = (prompt - cached).sum() / tokens
    for g, c in engines.items():
        if cfg.groups[g].replicas <= 0:
            continue  # scaled to zero: runs nothing
        # Critical path: each session alone on this group; a call lasts as long as its longest request.
        per_call = np.zeros(int(call.max()) + 1)
        np.maximum.at(per_call, call, _alone_s(c, prompt, cached, out))
        per_session = np.bincount(call_session, weights=per_call, minlength=n_sessions)
        best_session = np.minimum(best_session, per_session)
        # Throughput: full batches share the weight reads; each token reads its own KV and prefill.
        s = tp_speedup(c)
        token_s = (step_seconds(c, 0) / c.max_num_seqs + context_per_token * c.kv_bytes_per_token
                   / (c.hbm_bandwidth * s) + prefill_per_token / (c.prefill_tokens_per_s * s))
        fleet_rate += cfg.groups[g].replicas / token_s
    if fleet_rate == 0:
        return None
    critical = float(best_session.max()) * scale
    throughput = float(tokens / fleet_rate) * scale
    bound = max(critical, throughput)
    return {
        "bound_s": bound,
        "bound_ratio": wall_s / bound if bound > 0 else None,
        "bound": {"critical_path_s": critical, "throughput_s": throughput,
                  "critical_session": int(np.argmax(best_session)),
                  "limited_by": "critical_path" if critical >= throughput else "throughput"},
    }
