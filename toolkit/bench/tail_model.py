"""``python -m toolkit.bench tail_model``: how close placement could bring the tail bench's steps to
their lower bound, on a model of its fleet with no process in it.

``python -m toolkit.bench tail`` runs real processes on a small machine, so its figures mix what a
policy decides with what the processes cost (sockets, heartbeats, a shared CPU). This bench replays
the same kind of step on the same fleet as a discrete-event model (``tail_events.py``), to tell a
limit of scheduling from one of the implementation, and to put a figure on designs the router cannot
run today:

- each replica steps as ``toolkit/engine/sim.py`` times it (:func:`step_seconds`: weights and every
  running context read once a step, the step's prefill added to it), at the bench's fleet
  (``conf/groups/default.yaml``) and ``time_scale``; its prefix cache holds, in whole blocks, what
  finished or left there (the system prompt once a first request has finished);
- a request that moves recomputes its whole context where it lands, as the router's migration does
  (unless the design says its KV travels with it);
- new turns are placed by the router's own :class:`~toolkit.router.policy.ConsistentHash` (bounded
  loads, rings weighted by each replica's full-batch decode rate, as the router learns it); what
  cannot be placed waits, oldest first, ahead of a session's next turn;
- ``age`` is the router's own :class:`~toolkit.router.tail.age.AgePolicy` over its own
  :class:`~toolkit.router.tail.base.StepRecord`, asked every ``TICK_S`` with exact token counts;
- the bound is the step report's (:func:`~toolkit.rollout.bound.step_bound`) over the modelled requests.

Designs (``DESIGNS``): ``off`` (also with room for 64 requests on the tail replica, so that a bigger
room is not credited to a policy alone); ``age``, also with a lower bar for a long turn (the 0.8
quantile, or a fixed 250 tokens); ``age`` with more room on the tail replica (32, 64 requests);
``age`` whose moves carry their KV over a 400 Gb/s link instead of recomputing it (``kv``: what vLLM's
KV connectors such as NIXL do on GPUs; not on the CPU build); ``rank``, a scheduler that keeps on
the tail replica the requests whose sessions have the most work left, as far as it can tell; and an
``oracle`` no router can run, which knows every session's length when the step begins and starts as
many of the longest there as it holds; ``age_hint`` designs run the router's ``age`` with every turn carrying a length hint
off by a lognormal factor of a sigma (as ``toolkit.rollout.hints.SimOracle`` sends it), judged against
a whole step's long turn (the law's ``tail.long_quantile``, as the router takes it from the last step).

Two more uses of what a router sees, each on top of ``age``: ``age_swap``, with the tail replica full, swaps
a long runner for its resident of least expected work left (``rank``'s rule, among long runners only);
``age_behind0.5`` starts a session's next turn on the tail replica once half the step's sessions have
finished more turns than it (a session behind is the likeliest to end the step). ``age_kv_swap`` is
``age_swap`` whose moves carry their KV, so a swap no longer pays two recomputes.

``oracle_reveal24`` puts a figure on what telling the long sessions apart *late* is worth: the tail
replica takes the first turns that come while it has room, as ``age`` does, and the oracle knows the
longest sessions (as many as the tail replica holds, 24) only once at most 24 of the step's first turns still run (when a router that
watches ages could hold every one of them on the tail replica). Then their turns move there with
their KV, each trading places with a resident of another session if it is full; their later turns
start there.

``rank`` puts a figure on knowledge. Every ``TICK_S`` it ranks the running requests by their session's
expected work left: the current turn's tokens still to come plus the mean turn length for each turn
the session has left. It fills the tail replica's room from the top and, once the room is full, swaps
its lowest-ranked request back to the bulk for a higher one (by ``SWAP_MARGIN`` tokens: a swap pays
two recomputes). Without foresight a turn's tokens still to come are what the law of turn lengths
expects of a turn that has run this long (all a router that watches ages knows); with
``foresight=sigma`` a predictor names each turn's length as it starts, off by a lognormal factor of
that sigma (0: exact; the turn lengths' own sigma is 1.0, so 0.5 explains three quarters of their
log-variance), and once a turn outruns its prediction the law takes over.

The workload draws the tail bench's distributions (128 sessions of 3 turns, prompts of 64-384 tokens
behind a 32-token system prompt, 24-token observations, lognormal turns cut at 2,048), not its exact
tokens; steps are seeded, and every design runs the same steps. ``prefix_hit`` counts every leg of a
request (a moved request's recompute included; KV that travels counts neither way), so it is not the
step report's figure.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from toolkit.bench.tail import ARMS, SESSIONS
from toolkit.bench.tail_events import LINK_BYTES_PER_S, Design, Step, workload
from toolkit.config import Config, compose_config
from toolkit.core.rundir import RunDir

__all__ = ["DESIGNS", "TWINS", "Design", "Step", "bench_config", "model_step", "run", "run_workload", "twin",
           "workload"]

DESIGNS = (
    Design("off", "off"), Design("off_room64", "off", tail_room=64), Design("age", "age"),
    Design("age_q0.8", "age", tail={"long_quantile": 0.8}),
    Design("age_tokens250", "age", tail={"long_tokens": 250}),
    Design("age_room32", "age", tail_room=32), Design("age_room64", "age", tail_room=64),
    Design("age_kv", "age", kv=True), Design("age_kv_room64", "age", tail_room=64, kv=True),
    Design("age_swap", "age", swap=True), Design("age_kv_swap", "age", kv=True, swap=True),
    Design("age_behind0.5", "age", behind=0.5),
    Design("rank", "rank"), *(Design(f"rank_foresight{f:g}", "rank", foresight=f) for f in (0.75, 0.5, 0.25, 0.0)),
    *(Design(f"age_hint{f:g}", "age", hint=f) for f in (0.5, 0.25)),
    Design("oracle_reveal24", "oracle", kv=True, reveal=24), Design("oracle", "oracle"),
)

TWINS: dict[str, Design] = {
    "off": Design("off", "off"), "age": Design("age", "age"), "age+kv": Design("age_kv", "age", kv=True),
    "age+trade+kv": Design("age_kv_swap", "age", kv=True, swap=True),
}
"""The tail bench's arms the model can run as the router does (the others have no twin here)."""


def bench_config(max_tokens: int = 2048) -> Config:
    """The tail bench's config (its ``age`` arm; the designs change only placement)."""
    return compose_config([f"sessions_per_step={SESSIONS}", "engine.time_scale=0.25",
                           f"workload.max_tokens={max_tokens}", *ARMS["age"]])


def model_step(cfg: Config, design: Design, seed: int) -> dict[str, Any]:
    """One modelled step of ``design`` (seconds at ``cfg.engine.time_scale``)."""
    prompts, lengths = workload(cfg, seed)
    return Step(cfg, design, prompts, lengths).run()


def run_workload(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A step's prompts and turn lengths as a run made them, from its Parquet file: a session's turns are
    the runs of its loss mask (what the engines generated, between observations of at least a token)."""
    rows = pq.read_table(path, columns=["prompt_length", "loss_mask"]).to_pylist()
    turns = [[len(list(run)) for bit, run in itertools.groupby(r["loss_mask"]) if bit] for r in rows]
    lengths = np.zeros((len(rows), max(map(len, turns), default=0)), dtype=np.int64)
    for i, t in enumerate(turns):
        lengths[i, : len(t)] = t
    return np.array([r["prompt_length"] for r in rows], dtype=np.int64), lengths


def twin(cfg: Config, run: RunDir, steps: Iterable[int], arms: Iterable[str]) -> dict[str, Any]:
    """The model of ``arms`` (those in :data:`TWINS`, ``off`` among them) on a run's own steps: the same
    sessions and turn lengths, placed with no process in the way. Beside a real arm's figures, its twin's
    tell what the implementation costs from what the design does."""
    work = [run_workload(run.step_parquet(k)) for k in steps]
    results = {arm: [Step(cfg, TWINS[arm], p, lengths).run() for p, lengths in work] for arm in arms if arm in TWINS}
    off = statistics.fmean(s["wall_s"] for s in results["off"])
    return {
        "steps": len(work),
        "speedup": {arm: round(off / statistics.fmean(s["wall_s"] for s in out), 3) for arm, out in results.items()
                    if arm != "off"},
        "bound_ratio": {arm: round(statistics.fmean(s["bound_ratio"] for s in out), 3) for arm, out in results.items()},
    }


def _summary(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def mean(name: str, key: str) -> float:
        return statistics.fmean(s[key] for s in results[name])

    off = mean("off", "wall_s")
    return {name: {"step_time_s": round(mean(name, "wall_s"), 3), "speedup": round(off / mean(name, "wall_s"), 3),
                   "bound_ratio": round(mean(name, "bound_ratio"), 3), "moves_per_step": round(mean(name, "moves"), 1),
                   "prefix_hit": round(mean(name, "prefix_hit"), 4)}
            for name in results}


def run(quick: bool = False) -> dict[str, Any]:
    steps = 4 if quick else 40
    out: dict[str, Any] = {"steps": steps, "sessions_per_step": SESSIONS, "link_bytes_per_s": LINK_BYTES_PER_S}
    for max_tokens, key in ((2048, "designs"), (1024, "moderate_tail")):
        cfg = bench_config(max_tokens)
        out[key] = _summary({d.name: [model_step(cfg, d, seed) for seed in range(steps)] for d in DESIGNS})
    return out
