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
environments, tools, the step's bookkeeping) left the step from that floor.

Where the bound's speeds come from (``bound.source``): for the ``sim``, its own time model (``model``);
for other engines, what the router measured from heartbeats (``measured``): a request alone decodes at
the highest per-request rate seen on any replica, the fleet at the sum of its replicas' highest rates.
Measured rates include the prefills they ran, and a replica seen only busy understates what one request
gets alone there, so a measured bound is an estimate, not a proof. Without either it is null.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from toolkit.config import Config, SimEngineConfig, group_engine
from toolkit.engine.sim import step_seconds, tp_speedup
from toolkit.protocol import GroupStatus
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


def step_bound(cfg: Config, req: Columns, wall_s: float,
               measured: dict[str, GroupStatus] | None = None) -> dict[str, Any] | None:
    """The step's bound from its requests: from the sim's time model if every group runs the sim,
    else from ``measured`` (the router's per-group status at the step's end), else None."""
    out = req["output_tokens"].astype(np.float64)
    if not out.size or out.sum() == 0:
        return None
    engines = {g: group_engine(cfg, g) for g in cfg.groups}
    if all(isinstance(e, SimEngineConfig) for e in engines.values()):
        return _modelled(cfg, engines, req, out, wall_s)
    if measured:
        return _measured(req, out, measured, wall_s)
    return None


def _result(critical: float, throughput: float, session: int, wall_s: float, source: str) -> dict[str, Any]:
    bound = max(critical, throughput)
    return {
        "bound_s": bound,
        "bound_ratio": wall_s / bound if bound > 0 else None,
        "bound": {"critical_path_s": critical, "throughput_s": throughput, "critical_session": session,
                  "limited_by": "critical_path" if critical >= throughput else "throughput", "source": source},
    }


def _measured(req: Columns, out: np.ndarray, groups: dict[str, GroupStatus], wall_s: float) -> dict[str, Any] | None:
    alone = max((g.peak_request_tokens_per_s for g in groups.values()), default=0.0)
    fleet = sum(g.peak_tokens_per_s for g in groups.values())
    if alone <= 0 or fleet <= 0:
        return None  # nothing measured yet (no heartbeat interval with work)
    call, call_session = _calls(req)
    per_call = np.zeros(int(call.max()) + 1)
    np.maximum.at(per_call, call, out / alone)
    per_session = np.bincount(call_session, weights=per_call)
    return _result(float(per_session.max()), float(out.sum() / fleet), int(np.argmax(per_session)), wall_s,
                   "measured")


def _modelled(cfg: Config, engines: dict[str, Any], req: Columns, out: np.ndarray,
              wall_s: float) -> dict[str, Any] | None:
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
    return _result(float(best_session.max()) * scale, float(tokens / fleet_rate) * scale,
                   int(np.argmax(best_session)), wall_s, "model")
