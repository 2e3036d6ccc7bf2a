"""The discrete-event model behind ``python -m toolkit.bench tail_model``: one step of the tail bench's
workload on its fleet, replicas stepping as the sim times them, the router's own consistent hashing and
tail policy placing turns, and a :class:`Design` saying what differs (policy, room, moves that carry
their KV, a predictor's error). :meth:`Step.run` returns the step's wall time, bound ratio, moves and
prefix hits; ``tail_model.py`` runs the designs over seeded steps and compares them.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Any

import numpy as np
from hydra.utils import instantiate

from toolkit.config import Config, SimEngineConfig, group_engine
from toolkit.engine.sim import output_len, step_seconds
from toolkit.rollout.bound import step_bound
from toolkit.router.policy import ConsistentHash, Replica
from toolkit.router.tail.base import MoveLimits, StepRecord
from toolkit.router.tail.routing import TICK_S, make_tail_policy

LINK_BYTES_PER_S = 50e9
"""A 400 Gb/s NIC: what a move that carries its KV pays per byte (``kv`` designs)."""
SWAP_MARGIN = 200
"""``rank``: tokens of expected work by which a request must outrank the tail replica's lowest to swap."""
LAW_DRAWS = 200_000


class _Law:
    """The law of turn lengths as a scheduler could learn it: what a turn that has run ``a`` tokens is
    still expected to produce, ``E[L - a | L > a]``, and the mean turn length (from a fixed-seed draw)."""

    def __init__(self, cfg: Config) -> None:
        z = np.random.default_rng(0x1A3).standard_normal(LAW_DRAWS)
        self.sorted = np.sort(np.minimum(cfg.workload.max_tokens, output_len(cfg.engine, z)))
        self.suffix = np.concatenate([np.cumsum(self.sorted[::-1])[::-1], [0.0]])
        self.mean = float(self.sorted.mean())

    def left(self, a: int) -> float:
        i = int(np.searchsorted(self.sorted, a, side="right"))
        n = self.sorted.size - i
        return float(self.suffix[i] / n - a) if n else 0.0


_LAWS: dict[tuple[int, float, float], _Law] = {}


def _law(cfg: Config) -> _Law:
    """The workload's :class:`_Law`, drawn once for every step and design that model it."""
    key = (cfg.workload.max_tokens, cfg.engine.output_len_median, cfg.engine.output_len_sigma)
    if key not in _LAWS:
        _LAWS[key] = _Law(cfg)
    return _LAWS[key]


@dataclasses.dataclass(eq=False)
class _Turn:
    session: int
    turn: int
    prompt: int
    length: int
    sent: float
    produced: int = 0
    replica: _Replica | None = None
    kv_ready: float = 0.0  # a move carrying KV runs from then on
    dispatched: float | None = None  # when the router first placed it
    error: float | None = None  # ``rank`` with foresight: the predictor's standard normal error for it
    placement: int = 0  # placements so far: an engine step's tokens go only to turns placed before it

    def predicted(self, sigma: float) -> float:
        """A predictor's length for this turn: the true one off by a lognormal factor of ``sigma``, the
        same draw for a turn in every design."""
        if self.error is None:
            self.error = float(np.random.default_rng([self.session, self.turn, self.length, 0x9E5]).standard_normal())
        return self.length * float(np.exp(sigma * self.error))


@dataclasses.dataclass(eq=False)
class _Replica:
    group: str
    engine: SimEngineConfig
    cap: int
    running: list[_Turn] = dataclasses.field(default_factory=list)
    admit: list[tuple[_Turn, int]] = dataclasses.field(default_factory=list)
    cache: dict[int, int] = dataclasses.field(default_factory=dict)
    stepping: bool = False
    warm: bool = False  # a request has finished here, so the system prompt is cached
    view: Replica | None = None  # the router's view of it (what its consistent hashing sees)

    def load(self) -> int:
        return len(self.running) + len(self.admit)


@dataclasses.dataclass
class Design:
    name: str
    policy: str  # off | age | rank | oracle
    tail_room: int | None = None  # the tail replica's max in flight (None: the fleet's)
    kv: bool = False
    tail: dict[str, Any] = dataclasses.field(default_factory=dict)  # ``tail.*`` settings of the policy
    foresight: float | None = None  # ``rank``: sigma of a predictor's lognormal error (None: no predictor)
    hint: float | None = None  # ``age``: every turn carries a length hint off by a lognormal of this sigma
    swap: bool = False  # ``age``: with the tail replica full, a long runner swaps with its resident of least work left
    behind: float | None = None  # ``age``: a turn starts on the tail replica once this share of sessions is turns ahead
    reveal: int | None = None  # ``oracle``: it tells a first turn apart only once at most this many first turns run


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the tail bench's workload config makes of a step: sessions, turns, tokens between turns,
    prompt lengths and the shared system prompt's."""

    sessions: int
    turns: int
    observation: int
    prompt_range: tuple[int, int]
    system: int

    @classmethod
    def of(cls, cfg: Config) -> Shape:
        env, prompts = cfg.workload.env or {}, instantiate(cfg.workload.prompts)
        return cls(cfg.sessions_per_step, int(env["max_turns"]), int(env["observation_tokens"]),
                   (prompts.min_len, prompts.max_len), len(prompts.system))


def workload(cfg: Config, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt tokens per session and output tokens per turn, drawn as the tail bench's are (the sim's
    law, cut at ``workload.max_tokens``)."""
    shape = Shape.of(cfg)
    rng = np.random.default_rng([seed, 0x7A11])
    prompts = rng.integers(shape.prompt_range[0], shape.prompt_range[1] + 1, size=shape.sessions)
    z = rng.standard_normal((shape.sessions, shape.turns))
    lengths = np.minimum(cfg.workload.max_tokens, output_len(cfg.engine, z))
    return prompts, lengths.astype(np.int64)


class Step:
    """One step of one design: replicas, the router's choices, and the requests' rows."""

    def __init__(self, cfg: Config, design: Design, prompts: np.ndarray, lengths: np.ndarray) -> None:
        self.cfg, self.design, self.lengths = cfg, design, lengths
        self.sessions = lengths.shape[0]
        # A session with fewer turns than the step's most (a replayed run's) has its later ones at 0.
        self.turns_of = (lengths > 0).sum(axis=1)
        self.total_turns = int(self.turns_of.sum())
        self.shape = Shape.of(cfg)
        self.scale = cfg.engine.time_scale
        self.tail_group = cfg.tail.group
        self.replicas: list[_Replica] = []
        for g, gc in cfg.groups.items():
            cap = design.tail_room if g == self.tail_group and design.tail_room else gc.max_inflight
            self.replicas += [_Replica(g, group_engine(cfg, g), cap) for _ in range(gc.replicas)]
        self.tail = next(r for r in self.replicas if r.group == self.tail_group)
        self.bulk = [r for r in self.replicas if r is not self.tail]
        self.events: list[tuple[float, int, str, Any]] = []
        self.order = itertools.count()
        self.now = 0.0
        self.waiting: list[_Turn] = []
        self.rows: list[tuple[int, int, int, float, float]] = []  # session, prompt, output, sent, done
        self.finished: list[_Turn] = []
        self.moves = self.hits = self.queries = 0
        self.record = StepRecord(0)
        self.policy = (make_tail_policy(dataclasses.replace(cfg.tail, policy="age", **design.tail))
                       if design.policy == "age" else None)
        self.emitted = self.waits = 0
        self.freed = False
        self.ring = self._ring()
        self.favoured: set[int] = set()
        self.law = _law(cfg) if design.policy == "rank" or design.hint is not None or design.swap else None
        if design.hint is not None:  # hints are judged by the long turn of a whole step before: the law's
            assert self.law is not None and self.policy is not None
            q = self.policy.tc.long_quantile
            self.record.last_long = float(self.law.sorted[int(q * self.law.sorted.size)])
            self.record.hinted = True
        if design.policy == "oracle":
            longest = np.argsort(-lengths.sum(axis=1), kind="stable")[: self.tail.cap]  # as many as it holds
            self.favoured = set(longest.tolist())
        for s in range(self.sessions):
            if self.turns_of[s]:
                self._dispatch(_Turn(s, 0, int(prompts[s]), int(lengths[s, 0]), 0.0))

    # ---- placement ---------------------------------------------------------------------------
    def _ring(self) -> ConsistentHash:
        """The router's own bounded-load consistent hashing over the replicas a new turn may start on
        (``off``: every replica; else the bulk group), each weighted by its full-batch decode rate as
        the router learns it from heartbeats (its peak tokens/s)."""
        for i, r in enumerate(self.replicas):
            r.view = Replica(f"{r.group}-{i}", b"", r.group, r.cap, r.engine.max_model_len, r.engine.vocab_size,
                             ready=True)
        pool = self.replicas if self.design.policy == "off" else self.bulk
        ring = ConsistentHash([r.view for r in pool if r.view is not None], self.cfg.router.load_factor)
        ring.set_speeds({r.view.replica_id: r.cap / step_seconds(r.engine, r.cap * 1000) for r in pool if r.view})
        self.pool = pool
        return ring

    def _room(self, r: _Replica) -> int:
        return r.cap - r.load()

    def _target(self, t: _Turn) -> _Replica | None:
        tail_first = (
            (self.policy is not None and self.policy.start_on_tail(self.record, str(t.session), "", self._hint(t)))
            or (self.design.policy == "rank" and str(t.session) in self.record.on_tail)
            or (t.session in self.favoured and (t.turn > 0 or self.design.reveal is None)) or self._behind(t)
            or (self.design.reveal is not None and t.turn == 0))  # before it can tell, the first that come
        if tail_first and self._room(self.tail) > 0:
            return self.tail
        free = [r.view for r in self.pool if r.view is not None and self._room(r) > 0]
        view = self.ring.choose(str(t.session), sum(r.load() for r in self.pool), free)
        return next(r for r in self.pool if r.view is view) if view is not None else None

    def _dispatch(self, t: _Turn) -> None:
        r = self._target(t)
        if r is None:
            self.waits += 1
            self.waiting.append(t)
        else:
            self._place(t, r)

    def _place(self, t: _Turn, r: _Replica, kv: bool = False) -> None:
        if r is self.tail and self.design.policy != "off":
            self.record.on_tail.add(str(t.session))
        context = t.prompt + t.produced
        if kv:  # its KV travels: nothing to prefill, it runs once the bytes have landed
            t.kv_ready = self.now + context * r.engine.kv_bytes_per_token / LINK_BYTES_PER_S * self.scale
            prefill = 1
        else:  # as the sim's prefix cache: whole blocks of what finished here, at least one token computed
            known = r.cache.get(t.session, self.shape.system if r.warm else 0)
            block = r.engine.block_size
            cached = min(context - 1, known) // block * block
            self.hits += cached
            self.queries += context
            prefill = context - cached
        t.replica = r
        t.placement += 1
        if t.dispatched is None:
            t.dispatched = self.now
        assert r.view is not None
        r.view.inflight[str(id(t))] = None  # type: ignore[assignment]  # only its size matters here
        r.admit.append((t, prefill))
        self._kick(r)

    def _leave(self, t: _Turn, r: _Replica) -> None:
        """``t`` ends on ``r`` or moves away: ``r`` caches its context (as the sim does on both)."""
        r.running.remove(t)
        self.freed = True
        r.cache[t.session] = t.prompt + t.produced
        r.warm = True
        assert r.view is not None
        del r.view.inflight[str(id(t))]

    def _kick(self, r: _Replica) -> None:
        if not r.stepping and (r.running or r.admit):
            r.stepping = True
            self._push(self.now, "step", r)

    def _push(self, at: float, kind: str, what: Any) -> None:
        heapq.heappush(self.events, (at, next(self.order), kind, what))

    # ---- moves -------------------------------------------------------------------------------
    def _to_move(self) -> list[_Turn]:
        room = self._room(self.tail)
        if room <= 0 or self.policy is None:
            return []
        limits = self.policy.move_limits(self.record)  # once a tick, as the router asks it
        if limits is None:
            return []
        found = [(p, t) for r in self.bulk for t in r.running
                 if (p := limits.priority(t.produced, self._hint(t))) is not None]
        found.sort(key=lambda f: -f[0])
        return [t for _, t in found[:room]]

    def _behind(self, t: _Turn) -> bool:
        """``behind``: ``t``'s session is behind the step (that share of its sessions finished more turns)."""
        if self.design.behind is None or t.turn == 0:
            return False
        ahead = sum(1 for done in self.record.by_session.values() if len(done) > t.turn)
        return ahead >= self.design.behind * self.sessions

    def _hint(self, t: _Turn) -> int:
        """``t``'s length hint, as ``SimOracle`` would send it (0: the design sends none)."""
        return round(t.predicted(self.design.hint)) if self.design.hint is not None else 0

    def _work_left(self, t: _Turn) -> float:
        """``rank``: the expected tokens ``t``'s session has still to produce."""
        assert self.law is not None
        sigma = self.design.foresight
        predicted = t.predicted(sigma) if sigma is not None else 0.0
        now = predicted - t.produced if predicted > t.produced else self.law.left(t.produced)
        return now + (self.turns_of[t.session] - 1 - t.turn) * self.law.mean

    def _move(self, t: _Turn, to: _Replica) -> None:
        assert t.replica is not None
        self._leave(t, t.replica)
        self.moves += 1
        self._place(t, to, kv=self.design.kv)

    def _rank(self, limits: MoveLimits | None = None) -> None:
        """``rank``: fill the tail replica's room with the running requests of most work left, then swap
        its lowest for a higher one while one outranks it by ``SWAP_MARGIN`` (``swap``: only requests
        past ``limits``, the long runners ``age`` would move)."""
        rank = {id(t): self._work_left(t) for r in self.replicas for t in r.running}
        bulk = sorted((t for r in self.bulk for t in r.running
                       if limits is None or limits.priority(t.produced) is not None), key=lambda t: -rank[id(t)])
        residents = sorted(self.tail.running, key=lambda t: rank[id(t)])
        for t in bulk:
            if self._room(self.tail) <= 0:
                if not residents or rank[id(t)] <= rank[id(residents[0])] + SWAP_MARGIN:
                    break
                out = residents.pop(0)
                self.record.on_tail.discard(str(out.session))
                source = t.replica
                self._move(t, self.tail)
                free = [r.view for r in self.pool if r.view is not None and self._room(r) > 0]
                view = self.ring.choose(str(out.session), sum(r.load() for r in self.pool), free)
                self._move(out, next((r for r in self.pool if r.view is view), source))  # type: ignore[arg-type]
            else:
                self._move(t, self.tail)

    def _reveal(self, at_most: int) -> None:
        """``oracle`` with ``reveal``: once at most ``at_most`` first turns run, the longest sessions' turns
        move to the tail replica, each trading places with a resident of another session if it is full."""
        running = [t for r in self.replicas for t in (*r.running, *(t for t, _ in r.admit))]
        if sum(t.turn == 0 for t in running) > at_most:
            return
        for t in [t for r in self.bulk for t in r.running if t.session in self.favoured]:
            if self._room(self.tail) <= 0:
                out = next((x for x in self.tail.running if x.session not in self.favoured), None)
                if out is None:
                    return
                assert t.replica is not None
                self._move(out, t.replica)
            self._move(t, self.tail)

    def _tick(self) -> None:
        if self.design.reveal is not None:
            self._reveal(self.design.reveal)
        if self.design.policy == "rank":
            self._rank()
        for t in self._to_move():
            self._move(t, self.tail)
        if self.design.swap and self.policy is not None and (limits := self.policy.move_limits(self.record)):
            self._rank(limits)
        self._push(self.now + TICK_S, "tick", None)

    # ---- engine steps ------------------------------------------------------------------------
    def _step(self, r: _Replica) -> None:
        ready = [(t, p) for t, p in r.admit if t.kv_ready <= self.now]
        r.admit = [(t, p) for t, p in r.admit if t.kv_ready > self.now]
        r.running += [t for t, _ in ready]
        if not r.running:
            r.stepping = False
            if r.admit:  # only KV still on its way: look again when the first lands
                r.stepping = True
                self._push(min(t.kv_ready for t, _ in r.admit), "step", r)
            return
        context = sum(t.prompt + t.produced for t in r.running)
        dt = step_seconds(r.engine, context, sum(p for _, p in ready)) * self.scale
        self._push(self.now + dt, "emit", (r, [(t, t.placement) for t in r.running]))

    def _emit(self, r: _Replica, batch: list[tuple[_Turn, int]]) -> None:
        done = []
        for t, placement in batch:
            if t.placement != placement:
                continue  # moved during the step (away, or away and back): the sim aborted it before this token
            t.produced += 1
            self.emitted += 1
            if t.produced >= t.length:
                done.append(t)
        following = []
        for t in done:
            self._leave(t, r)
            self.rows.append((t.session, t.prompt, t.produced, t.sent, self.now))
            self.finished.append(t)
            self.record.finished(str(t.session), "", t.produced)
            if t.turn + 1 < self.turns_of[t.session]:
                following.append(_Turn(t.session, t.turn + 1, t.prompt + t.produced + self.shape.observation,
                                       int(self.lengths[t.session, t.turn + 1]), self.now))
        # The router's queue serves what already waits before a session's next turn, which a rank
        # sends only once the Result has reached it; only a slot freed since (a turn done or moved
        # away) can take one.
        if self.freed and self.waiting:
            for t in list(self.waiting):
                target = self._target(t)
                if target is not None:
                    self.waiting.remove(t)
                    self._place(t, target)
        self.freed = False
        for t in following:
            self._dispatch(t)
        r.stepping = False
        self._kick(r)

    def run(self) -> dict[str, Any]:
        self._push(TICK_S, "tick", None)
        while len(self.rows) < self.total_turns:
            self.now, _, kind, what = heapq.heappop(self.events)
            if kind == "tick":
                if not any(r.running or r.admit for r in self.replicas):
                    raise RuntimeError(f"the model stalled at {self.now:.3f} s: {len(self.waiting)} turn(s) "
                                       f"waiting and nothing running")
                self._tick()
            elif kind == "step":
                self._step(what)
            else:
                self._emit(*what)
        rows = np.array(self.rows, dtype=np.float64)
        wall = float(rows[:, 4].max())
        req = {"session": rows[:, 0].astype(np.int64), "prompt_tokens": rows[:, 1].astype(np.int64),
               "output_tokens": rows[:, 2].astype(np.int64), "done_at": rows[:, 4],
               "latency_s": rows[:, 4] - rows[:, 3]}
        bound = step_bound(self.cfg, req, wall)
        assert bound is not None
        return {"wall_s": wall, "bound_ratio": bound["bound_ratio"], "moves": self.moves,
                "prefix_hit": self.hits / self.queries, "waits": self.waits}
