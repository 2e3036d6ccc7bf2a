"""A step's lower bound: how soon the step could have ended on this fleet, whatever the scheduling.

``bound_s`` is the larger of two bounds, each from the engines' own time model and the step's
requests (prompt and generated tokens of every turn that generated any):

- **critical path**: a session's turns run one after another, so the step lasts at least as long as
  its longest session would take alone on the fastest group: each turn's new tokens prefilled, then
  its tokens decoded one step each with nothing else in the batch (the context growing by one per
  token). A gateway call with ``n > 1`` counts once (its samples run side by side).
- **throughput**: every generated token has to be decoded somewhere; at best each replica runs
  full batches (``max_num_seqs``), sharing the weight reads, while each token still reads its own
  context's KV. Every request at its cheapest group's cost, over the fleet's replica count: no
  allocation of requests to replicas does better.

Prefill is counted schedule-free: only the tokens a turn adds to its session's previous context
(observations, tool results), which no prefix cache can hold; a session's first turn and all cached
context cost nothing. So a schedule with better cache hits does not get a lower bound.

For agent sessions (``workload.agent``) the critical path also holds each session's own time between
its calls (its tools, its harness: from one answer to its next call), which no scheduling shortens.

``bound_ratio = wall_s / bound_s`` says how far scheduling (and everything outside generation:
environments, tools, the step's bookkeeping) left the step from that floor.

Where the bound's speeds come from (``bound.source``): for the ``sim``, its own time model (``model``,
``toolkit/engine/step_model.py:step_seconds``); for other engines, what the router measured from heartbeats
(``measured``): a request alone decodes at the highest per-request rate seen on any replica, the fleet
at the sum of its replicas' highest rates. Measured rates include the prefills they ran, and a replica
seen only busy understates what one request gets alone there, so a measured bound is an estimate, not
a proof. Without either it is null.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from toolkit.config import Config, SimEngineConfig, group_engine
from toolkit.core.protocol import GroupStatus
from toolkit.engine.step_model import step_seconds
from toolkit.session.columns import Columns


class SimCosts:
    """The sim's time model per group, taken apart from :func:`step_seconds` (so the bound follows
    any change to it), in seconds after ``time_scale``."""

    def __init__(self, c: SimEngineConfig, max_inflight: int | None = None) -> None:
        base = step_seconds(c, 0)
        self.step = base * c.time_scale                                    # one step: weights + overhead
        self.kv = (step_seconds(c, 1) - base) * c.time_scale               # per token of context read
        self.prefill = (step_seconds(c, 0, 1) - base) * c.time_scale       # per prefilled token
        self.batch = c.max_num_seqs
        self.inflight = min(c.max_num_seqs, max_inflight or c.max_num_seqs)
        """The batch the router fills it to: its group's ``max_inflight``."""

    def alone(self, prompt: np.ndarray, new: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Each request alone on one replica: its ``new`` tokens prefilled in its first step, then one
        decode step per token at context ``prompt + k`` (the sum over k in closed form)."""
        return out * self.step + self.kv * (out * prompt + out * (out - 1) / 2) + self.prefill * new

    def batched(self, prompt: np.ndarray, new: np.ndarray, out: np.ndarray, batch: int | None = None) -> np.ndarray:
        """Each request's share of full batches: the step's fixed cost split ``batch`` (default
        ``max_num_seqs``) ways."""
        return (out * self.step / (batch or self.batch) + self.kv * (out * prompt + out * (out - 1) / 2)
                + self.prefill * new)


def _sessions(req: Columns) -> tuple[np.ndarray, np.ndarray]:
    """Each request's session as a dense id, and each id's index in the step it began in. A session is
    ``(started_step, session)``: a step closed on a count runs sessions carried from earlier steps too,
    whose indexes repeat its own."""
    keys = np.stack([req["started_step"], req["session"]]) if "started_step" in req else req["session"][None]
    unique, ids = np.unique(keys, axis=1, return_inverse=True)
    return ids.reshape(-1), unique[-1]


def _calls(req: Columns, session: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of each request's call (the requests of one session sent at the same moment: a gateway
    call with ``n > 1``), and each call's session (``session``: each request's, by :func:`_sessions`)."""
    sent = req["done_at"] - req["latency_s"]
    keys = np.stack([session, np.round(sent, 6)])
    _, first, call = np.unique(keys, axis=1, return_index=True, return_inverse=True)
    return call.reshape(-1), session[first]


def has_time_model(cfg: Config) -> bool:
    """Every group runs the sim: the bound needs no measured speeds."""
    return all(isinstance(group_engine(cfg, g), SimEngineConfig) for g in cfg.groups)


def step_bound(cfg: Config, req: Columns, wall_s: float,
               measured: dict[str, GroupStatus] | None = None) -> dict[str, Any] | None:
    """The step's bound from its requests: from the sim's time model if every group runs the sim (with
    as many replicas per group as ``measured`` says serve at the step's end: ``toolkit.launch.scale`` may
    have changed the configured counts), else from ``measured``'s learned speeds, else None."""
    ran = req["output_tokens"] > 0  # requests that never ran (client errors, timeouts in the queue) cost nothing
    if not ran.any():
        return None
    req = {k: v[ran] for k, v in req.items() if k != "session_done_at"}
    if has_time_model(cfg):
        counts = {g: measured[g].ready if measured and g in measured else cfg.groups[g].replicas for g in cfg.groups}
        return _modelled({g: group_engine(cfg, g) for g in cfg.groups}, counts, req, wall_s,
                         {g: cfg.groups[g].max_inflight for g in cfg.groups}, bool(cfg.workload.agent))
    if measured:
        return _measured(req, req["output_tokens"].astype(np.float64), measured, wall_s, bool(cfg.workload.agent))
    return None


def _result(critical: float, throughput: float, session: int, wall_s: float, source: str) -> dict[str, Any]:
    bound = max(critical, throughput)
    return {
        "bound_s": bound,
        "bound_ratio": wall_s / bound if bound > 0 else None,
        "bound": {"critical_path_s": critical, "throughput_s": throughput, "critical_session": session,
                  "limited_by": "critical_path" if critical >= throughput else "throughput", "source": source},
    }


def _between_calls(req: Columns, call: np.ndarray, call_session: np.ndarray, n_sessions: int) -> np.ndarray:
    """Per session, the time between its calls: from each answer to its next call (an agent's tools
    and harness), on its critical path whatever the scheduling."""
    sent = req["done_at"] - req["latency_s"]
    n_calls = int(call.max()) + 1
    start = np.full(n_calls, np.inf)
    np.minimum.at(start, call, sent)
    end = np.zeros(n_calls)
    np.maximum.at(end, call, req["done_at"])
    order = np.lexsort((start, call_session))
    session = call_session[order]
    gap = np.maximum(0.0, start[order][1:] - end[order][:-1])
    same = session[1:] == session[:-1]
    return np.bincount(session[1:][same], weights=gap[same], minlength=n_sessions)


def _measured(req: Columns, out: np.ndarray, groups: dict[str, GroupStatus], wall_s: float,
              agent: bool = False) -> dict[str, Any] | None:
    alone = max((g.peak_request_tokens_per_s for g in groups.values()), default=0.0)
    fleet = sum(g.peak_tokens_per_s for g in groups.values())
    if alone <= 0 or fleet <= 0:
        return None  # nothing measured yet (no heartbeat interval with work)
    session, index = _sessions(req)
    call, call_session = _calls(req, session)
    per_call = np.zeros(int(call.max()) + 1)
    np.maximum.at(per_call, call, out / alone)
    per_session = np.bincount(call_session, weights=per_call)
    if agent:
        per_session += _between_calls(req, call, call_session, per_session.size)
    return _result(float(per_session.max()), float(out.sum() / fleet), int(index[np.argmax(per_session)]), wall_s,
                   "measured")


def _new_tokens(req: Columns, call: np.ndarray, session: np.ndarray) -> np.ndarray:
    """Per request, the tokens its prompt adds to its session's previous call (the longest context
    that call ended with); 0 for a session's first call. No prefix cache can hold them."""
    prompt, out = req["prompt_tokens"], req["output_tokens"]
    new = np.zeros(prompt.size, dtype=np.float64)
    ended: dict[int, int] = {}  # session -> context its latest call ended with
    order = np.lexsort((req["done_at"] - req["latency_s"], session))
    last_call = -1
    pending: dict[int, int] = {}
    for i in order.tolist():
        sid = int(session[i])
        if call[i] != last_call:  # a new call: the previous one's contexts are now known
            ended.update(pending)
            pending = {}
            last_call = int(call[i])
        if sid in ended:
            new[i] = max(0, int(prompt[i]) - ended[sid])
        pending[sid] = max(pending.get(sid, 0), int(prompt[i]) + int(out[i]))
    return new


def _modelled(engines: dict[str, Any], counts: dict[str, int], req: Columns, wall_s: float,
              inflight: dict[str, int] | None = None, agent: bool = False) -> dict[str, Any] | None:
    groups = {g: SimCosts(c, (inflight or {}).get(g)) for g, c in engines.items() if counts[g] > 0}  # scaled to 0: none
    replicas = sum(counts[g] for g in groups)
    if not groups:
        return None
    out = req["output_tokens"].astype(np.float64)
    prompt = req["prompt_tokens"].astype(np.float64)
    session, index = _sessions(req)
    call, call_session = _calls(req, session)
    new = _new_tokens(req, call, session)
    n_sessions = int(call_session.max()) + 1
    best_session = np.full(n_sessions, np.inf)
    cheapest = np.full(out.size, np.inf)
    at_inflight: dict[str, np.ndarray] = {}
    for costs in groups.values():
        # Critical path: each session alone on this group; a call lasts as long as its longest request.
        per_call = np.zeros(int(call.max()) + 1)
        np.maximum.at(per_call, call, costs.alone(prompt, new, out))
        best_session = np.minimum(best_session, np.bincount(call_session, weights=per_call, minlength=n_sessions))
        cheapest = np.minimum(cheapest, costs.batched(prompt, new, out))
    for g, costs in groups.items():
        at_inflight[g] = costs.batched(prompt, new, out, costs.inflight)
    if agent:
        best_session += _between_calls(req, call, call_session, n_sessions)
    result = _result(float(best_session.max()), float(cheapest.sum() / replicas),
                     int(index[np.argmax(best_session)]), wall_s, "model")
    # The same with each replica's batch at its group's max_inflight, the most the router puts in it.
    result["bound"]["throughput_at_max_inflight_s"] = _fluid(at_inflight, {g: counts[g] for g in groups})
    # And its replica-seconds with every request on the group it ran on (request group codes follow the
    # sorted group names), against which the fluid split's shows what placement cost.
    if "group" in req:
        result["bound"]["at_max_inflight_as_placed_replica_s"] = float(sum(
            at_inflight[g][req["group"] == i].sum() for i, g in enumerate(sorted(engines)) if g in at_inflight))
    return result


def _fluid(costs: dict[str, np.ndarray], replicas: dict[str, int]) -> float:
    """The fleet's least time for every request, each group's replicas working side by side and each
    request split between groups as best suits (a fluid schedule): with two groups, the requests
    relatively cheapest on the first go there, the split where both groups finish together. With one
    group, or more than two, the requests at their cheapest over all replicas (a looser bound)."""
    if len(costs) != 2:
        return float(np.minimum.reduce(list(costs.values())).sum() / sum(replicas.values()))
    (a, ca), (b, cb) = costs.items()
    order = np.argsort(ca / np.maximum(cb, 1e-12))
    on_a = np.concatenate([[0.0], np.cumsum(ca[order])]) / replicas[a]        # the first k on group a
    on_b = np.concatenate([np.cumsum(cb[order][::-1])[::-1], [0.0]]) / replicas[b]  # the rest on group b
    return float(np.maximum(on_a, on_b).min())
