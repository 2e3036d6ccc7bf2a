"""``sim``: a simulator of a continuous-batching LLM engine, for CPU runs, tests and policy sweeps.

It is a named simulator, not a model: tokens and logprobs are pseudo-random, seeded by the prompt, so
a request always gets the same ones. A decode step reads all weights plus every running sequence's KV
cache; prefill costs uncached tokens; an LRU prefix cache over token blocks decides what is cached;
output lengths are lognormal. It also honours structured outputs, keeps weight versions and has fault
hooks for tests. The time model, its defaults and every knob: docs/engines.md#the-sim-engine.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import os
import signal
import threading
import time
from collections import OrderedDict, deque
from itertools import takewhile
from typing import Any

import msgspec
import numpy as np

from toolkit.config import SimEngineConfig
from toolkit.core.blocks import block_hashes
from toolkit.core.errors import ToolkitError
from toolkit.core.protocol import Generate, ReplicaStats, Result, StreamWeights, Structured
from toolkit.core.tokens import id_list
from toolkit.engine.base import Engine, EngineInfo
from toolkit.engine.kv_events import KvEventLog
from toolkit.engine.structured import instance_text
from toolkit.model.tokenizer import Tokenizer, load_tokenizer
from toolkit.weights.wire import Manifest, WrongBase

logger = logging.getLogger(__name__)


def tp_speedup(c: SimEngineConfig) -> float:
    """How much faster than one device a replica reads its weights and KV (``tensor_parallel_size``)."""
    return 1 + (c.tensor_parallel_size - 1) * c.tp_efficiency


def step_seconds(c: SimEngineConfig, context_tokens: float, prefill_tokens: float = 0) -> float:
    """Modelled seconds of one engine step (before ``time_scale``): the time model above. Also the
    step report's lower bound (``toolkit/rollout/bound.py``) reads it."""
    speedup = tp_speedup(c)
    read = c.weight_bytes + context_tokens * c.kv_bytes_per_token
    return c.step_overhead_s + read / (c.hbm_bandwidth * speedup) + prefill_tokens / (c.prefill_tokens_per_s * speedup)


class PrefixCache:
    """LRU over prompt blocks; a block counts as cached only if every block before it is."""

    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        self.block_size = block_size
        self.capacity = max(1, capacity_tokens // block_size)
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.log: KvEventLog | None = None
        """Where the blocks it stores and drops are recorded (the replica's KV events), if anywhere."""

    def hashes(self, tokens: list[int], known: list[int] | None = None) -> list[int]:
        """The chained hash of each whole block of ``tokens`` (``toolkit.core.blocks``); ``known``: those
        of a prefix of its blocks, already computed."""
        return block_hashes(tokens, self.block_size, known)

    def match(self, tokens: list[int], hashes: list[int] | None = None) -> int:
        """Tokens at the start of ``tokens`` already cached (at least one token is always computed);
        ``hashes``: its blocks' (:meth:`hashes`), if known."""
        usable = (len(tokens) - 1) // self.block_size
        blocks = self.blocks
        hits = list(takewhile(blocks.__contains__,
                              hashes[:usable] if hashes is not None else self.hashes(tokens[:-1])))
        deque(map(blocks.move_to_end, hits), maxlen=0)  # each hit the most recent, in order (a loop in C)
        return len(hits) * self.block_size

    def insert(self, tokens: list[int]) -> None:
        """Each whole block of ``tokens`` becomes the most recent, in order (:meth:`store`)."""
        self.store(self.hashes(tokens))

    def store(self, hashes: list[int]) -> None:
        """The blocks named by ``hashes`` (a chain from :meth:`hashes`) become the most recent, in order;
        the least recent beyond the capacity go."""
        blocks, log = self.blocks, self.log
        new = []
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None  # a new key goes to the end: the most recent
                new.append(h)
        if log is not None:
            log.stored(new)
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            if log is not None:
                log.removed((h,))

    def clear(self) -> None:
        self.blocks.clear()
        if self.log is not None:
            self.log.cleared()


class _Seq:
    __slots__ = ("req", "future", "tokens", "logprobs", "finish", "produced", "cached", "versions")

    def __init__(self, req: Generate, future: asyncio.Future[Result], tokens: list[int],
                 logprobs: list[float], finish: str) -> None:
        self.req = req
        self.future = future
        self.tokens = tokens
        self.logprobs = logprobs
        self.finish = finish
        self.produced = 0
        self.cached = 0
        self.versions: list[int] = []  # weight versions of its tokens so far, in order


class _Draws(threading.local):
    """This thread's one PCG64 generator, put in the state a request's material names (:func:`_rng`):
    setting a state costs 2 us where a new seeded generator costs 18 (numpy's SeedSequence)."""

    def __init__(self) -> None:
        self.bits = np.random.PCG64()
        self.gen = np.random.Generator(self.bits)
        self.state: dict[str, Any] = self.bits.state


_draws = _Draws()


def _rng(key: int, *material: bytes) -> np.random.Generator:
    """This thread's generator, seeded by ``key`` (an int) and ``material``: the same draws for the same
    seed in every process. Valid until the next call on this thread."""
    d = hashlib.blake2b(b"|".join((key.to_bytes(8, "little", signed=True), *material)), digest_size=32).digest()
    st = _draws.state
    st["state"]["state"] = int.from_bytes(d[:16], "little")
    st["state"]["inc"] = int.from_bytes(d[16:], "little") | 1  # a PCG stream's increment is odd
    _draws.bits.state = st
    return _draws.gen


LOGPROB_LEVELS = 4096


@functools.lru_cache(maxsize=1)
def _logprob_table() -> np.ndarray:
    q = (np.arange(LOGPROB_LEVELS) + 0.5) / LOGPROB_LEVELS
    return (0.7 * np.log1p(-q)).astype(np.float32).astype(object)


def draw_logprobs(rng: np.random.Generator, n: int) -> list[float]:
    """``n`` token logprobs: minus an exponential with mean 0.7, drawn as one of its
    :data:`LOGPROB_LEVELS` quantiles (float32 values) and returned as shared float objects: a twin
    holds millions of them, and a new float per token (``ndarray.tolist``) took a quarter of its memory."""
    u = rng.random(n)
    u *= LOGPROB_LEVELS
    return _logprob_table()[u.astype(np.intp)].tolist()


def output_len(cfg: SimEngineConfig, z: Any) -> Any:
    """The output length(s), before any cut, for standard normal draw(s) ``z`` (a float or an array):
    lognormal with median ``output_len_median`` and sigma ``output_len_sigma``, at least one token."""
    if isinstance(z, float):
        return max(1, math.ceil(cfg.output_len_median * math.exp(cfg.output_len_sigma * z)))
    return np.maximum(1, np.ceil(cfg.output_len_median * np.exp(cfg.output_len_sigma * np.asarray(z))))


def plan_output(cfg: SimEngineConfig, req: Generate,
                tokenizer: Tokenizer | None = None) -> tuple[list[int], list[float], str]:
    """The tokens, logprobs and finish reason this request will get: a pure function of the request.

    A request that moved (``resumed_tokens``) gets the rest of what it was planned to say where it
    started: the same total length and tokens, so moving it changes where it runs, not what it is.
    A structured request needs ``tokenizer`` (``engine.tokenizer``); ToolkitError for one it cannot serve.
    """
    k = req.resumed_tokens
    if k > 0:
        origin = msgspec.structs.replace(
            req, prompt_token_ids=req.prompt_token_ids[:-k], resumed_tokens=0,
            sampling=msgspec.structs.replace(req.sampling, max_tokens=req.sampling.max_tokens + k))
        tokens, logprobs, finish = plan_output(cfg, origin, tokenizer)
        return tokens[k:], logprobs[k:], finish
    prompt = req.prompt_token_ids
    seed = str(req.sampling.seed).encode()
    share, pshare = cfg.output_len_session_share, cfg.output_len_prompt_share
    correlated = (share > 0 or pshare > 0) and req.session_id and req.sampling.structured is None
    if correlated:  # drawn first: the request's own generator below is the same one, seeded again
        shared = float(_rng(0, req.session_id.encode(), seed).standard_normal())
        of_prompt = float(_rng(0, b"prompt", (req.prompt_key or req.session_id).encode(), seed).standard_normal())
    # The prompt by Python's hash of its tuple: the same in every process (no hash seed enters ints and
    # tuples of them; core/blocks.py relies on it too), and a quarter of the cost of hashing its bytes.
    material = [seed]
    if req.sampling.seed is None and req.sampling.temperature > 0 and req.prompt_key:
        material.append(req.session_id.encode())  # siblings sample apart (the same prompt, other sessions)
    rng = _rng(hash(tuple(prompt)), *material)
    budget = max(0, min(req.sampling.max_tokens, cfg.max_model_len - len(prompt)))
    if req.sampling.structured is not None:
        return _plan_structured(cfg, req.sampling.structured, tokenizer, rng, budget)
    z = float(rng.standard_normal())
    if correlated:
        z = (math.sqrt(pshare) * of_prompt + math.sqrt(share) * shared
             + math.sqrt(max(0.0, 1 - share - pshare)) * z)
    natural = int(output_len(cfg, z))
    n = min(natural, budget)
    finish = "stop" if natural <= budget else "length"
    tokens = id_list(rng.integers(1, cfg.vocab_size, size=n), cfg.vocab_size)
    return tokens, draw_logprobs(rng, n), finish


PLAN_FIELDS = ("max_model_len", "vocab_size", "output_len_median", "output_len_sigma", "output_len_session_share",
               "output_len_prompt_share")
"""The engine settings :func:`plan_output` reads: engines that agree on them plan every request alike."""


def _plan_structured(cfg: SimEngineConfig, structured: Structured, tokenizer: Tokenizer | None,
                     rng: np.random.Generator, budget: int) -> tuple[list[int], list[float], str]:
    """The encoded instance, cut at ``budget``; its logprobs are drawn for the whole of it, so a cut
    (or a continuation elsewhere) keeps the same prefix."""
    if tokenizer is None:
        raise ToolkitError("a structured request (sampling.structured) needs a tokenizer on a sim engine: "
                           "set engine.tokenizer (as workload.tokenizer)")
    tokens = list(tokenizer.encode(instance_text(structured, rng)))
    if tokens and (min(tokens) < 0 or max(tokens) >= cfg.vocab_size):
        raise ToolkitError(f"engine.tokenizer encodes the structured output with token ids outside "
                           f"engine.vocab_size {cfg.vocab_size} (ids {min(tokens)}..{max(tokens)})")
    logprobs = draw_logprobs(rng, len(tokens))
    finish = "stop" if len(tokens) <= budget else "length"
    return tokens[:budget], logprobs[:budget], finish


def _checkpoint_exists(path: str) -> None:
    # On the loop, unlike vLLM's check: a thread hop would let steps pass before an in-place switch.
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory {path}")


class SimEngine(Engine):
    def __init__(self, cfg: SimEngineConfig) -> None:
        self.cfg = cfg
        self.cache = PrefixCache(cfg.block_size, cfg.kv_cache_tokens)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.by_id: dict[str, _Seq] = {}
        self.prefix_hits = 0
        self.prefix_queries = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.generated_tokens = 0
        # Where its time went (``ReplicaStats``): what the model charged, prefilled tokens, and the wall
        # time it had work (since ``_active_since`` for the current stretch).
        self.model_s = 0.0
        self.prefill_tokens = 0
        self.active_s = 0.0
        self._active_since: float | None = None
        self.hung = False
        # An in-place weight update waiting for the next step boundary, and the running contexts to
        # prefill again after one (their KV came from the old weights).
        self._pending_weights: tuple[int, asyncio.Future[None]] | None = None
        self._staged: int | None = None
        """The streamed version staged (its link time spent), not yet applied."""
        self._recompute_tokens = 0
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_error = ""

    def step_time(self, context_tokens: int, prefill_tokens: int = 0) -> float:
        """Modelled seconds of one step (before ``time_scale``)."""
        return step_seconds(self.cfg, context_tokens, prefill_tokens)

    def tokenizer(self) -> Tokenizer | None:
        """``engine.tokenizer``, loaded on first use (a structured request); a failure to load is kept."""
        if self._tokenizer is None and self.cfg.tokenizer is not None and not self._tokenizer_error:
            try:
                self._tokenizer = load_tokenizer(self.cfg.tokenizer)
            except Exception as exc:  # a bad path, an unimportable _target_: every structured request says so
                self._tokenizer_error = (f"engine.tokenizer = {self.cfg.tokenizer!r} did not load: "
                                         f"{type(exc).__name__}: {exc}")
        if self._tokenizer_error:
            raise ToolkitError(self._tokenizer_error)
        return self._tokenizer

    async def start(self) -> EngineInfo:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, self._crash, "SIGUSR1")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")
        return EngineInfo(self.cfg.model, self.cfg.max_model_len, self.cfg.vocab_size, self.cfg.block_size,
                          self.cfg.kv_cache_tokens)

    def kv_events(self) -> KvEventLog:
        if self.cache.log is None:
            self.cache.log = KvEventLog()
            self.cache.log.lose_seq = self.cfg.fault_kv_gap_batch
        return self.cache.log

    def kv_held(self) -> list[int]:
        return list(self.cache.blocks)

    async def generate(self, req: Generate) -> Result:
        prompt = req.prompt_token_ids
        if not prompt or len(prompt) > self.cfg.max_model_len or min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
            return Result(request_id=req.request_id, status="client_error",
                          error=f"prompt of {len(prompt)} tokens outside limits (max_model_len "
                                f"{self.cfg.max_model_len}, vocab {self.cfg.vocab_size})")
        try:
            tok = self.tokenizer() if req.sampling.structured is not None else None
            tokens, logprobs, finish = plan_output(self.cfg, req, tok)
        except ToolkitError as exc:
            return Result(request_id=req.request_id, status="client_error", error=str(exc))
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        seq = _Seq(req, future, tokens, logprobs, finish)
        self.by_id[req.request_id] = seq
        if req.kv_tokens > 0:  # its KV crosses the link first, without holding up the running batch
            link_s = req.kv_tokens * self.cfg.kv_bytes_per_token / self.cfg.kv_link_bytes_per_s
            asyncio.get_running_loop().call_later(link_s * self.cfg.time_scale, self._landed, seq)
        else:
            self._admit(seq)
        try:
            return await future
        finally:
            self.by_id.pop(req.request_id, None)

    def _admit(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        self._wake.set()

    def _landed(self, seq: _Seq) -> None:
        """A moved request's KV is here: its context joins the prefix cache, and it the queue."""
        if not seq.future.done():  # aborted while its KV was on the way: nothing lands
            seq.cached = self.cache.match(seq.req.prompt_token_ids)  # what this replica held already
            self.cache.insert(seq.req.prompt_token_ids[: seq.req.kv_tokens])
            self._admit(seq)

    async def abort(self, request_id: str) -> None:
        seq = self.by_id.get(request_id)
        if seq is None or seq.future.done():
            return
        ran = seq in self.running
        if ran:
            self.running.remove(seq)
        self._finish(seq, "cancelled", "abort", computed=ran)

    def stats(self) -> ReplicaStats:
        ctx = sum(len(s.req.prompt_token_ids) + s.produced for s in self.running)
        return ReplicaStats(
            running=len(self.running),
            waiting=sum(1 for s in self.waiting if not s.future.done()),
            kv_usage=min(1.0, ctx / self.cfg.kv_cache_tokens),
            prefix_hits=self.prefix_hits,
            prefix_queries=self.prefix_queries,
            weight_version=self.weight_version,
            generated_tokens=self.generated_tokens,
            engine_steps=self.steps,
            prefill_tokens=self.prefill_tokens,
            model_s=self.model_s,
            active_s=self.active_s + (time.monotonic() - self._active_since if self._active_since is not None else 0.0),
        )

    async def load_weights(self, path: str, version: int) -> None:
        """The simulator has no weights: a reload only bumps the version and empties the prefix cache
        (cached KV of the old weights is useless), as a real engine's reload does. A checkpoint
        directory that is not there fails, as it does in vLLM."""
        _checkpoint_exists(path)
        self._reset_weights(version)

    def _reset_weights(self, version: int) -> None:
        self.cache.clear()
        self.weight_version = version

    async def update_weights_in_place(self, path: str, version: int) -> None:
        """The switch happens at the next step boundary, as vLLM's pause between steps: the step under
        way finishes on the old version, every later token is the new version's (``Result.weight_versions``
        lists both for a request that straddles it). The prefix cache is emptied and the running
        sequences' contexts are prefilled again in the next step (the old weights' KV is discarded, as
        the vllm backend does). Requests in flight go on; none is aborted."""
        _checkpoint_exists(path)
        await self._switch_at_step(version)

    async def _switch_at_step(self, version: int) -> None:
        if self._task is None or self._task.done():
            self._reset_weights(version)
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending_weights = (version, done)
        self._wake.set()
        await done

    # ---- streamed updates: the link's time modelled from the update's bytes ---------------------------
    stream_transport = "model"

    async def stage_stream(self, msg: StreamWeights) -> None:
        """The update's bytes over ``weights_link_bytes_per_s`` (scaled by ``time_scale``), the engine
        serving meanwhile; a delta against another version than the one it holds is refused at once."""
        manifest = msgspec.msgpack.decode(msg.manifest, type=Manifest)
        if manifest.base >= 0 and manifest.base != self.weight_version:
            raise WrongBase(f"update to version {manifest.version} is a delta against version {manifest.base}, "
                            f"but this replica holds version {self.weight_version}: it needs a dense update")
        await asyncio.sleep(manifest.total / self.cfg.weights_link_bytes_per_s * self.cfg.time_scale)
        self._staged = manifest.version

    async def apply_stream(self, version: int) -> None:
        staged, self._staged = self._staged, None
        if staged != version:
            raise RuntimeError(f"version {version} is not staged (staged: {staged})")
        await self._switch_at_step(version)

    async def discard_stream(self) -> None:
        self._staged = None

    def _switch_weights(self) -> None:
        """At a step boundary: apply a pending in-place update."""
        if self._pending_weights is None:
            return
        version, done = self._pending_weights
        self._pending_weights = None
        self.cache.clear()
        self.weight_version = version
        self._recompute_tokens = sum(len(s.req.prompt_token_ids) + s.produced for s in self.running)
        if not done.done():
            done.set_result(None)

    def _crash(self, why: str) -> None:
        logger.error("sim fault hook: crashing now (%s)", why)
        os._exit(70)

    def _faults(self, prompt: list[int]) -> None:
        c = self.cfg
        if c.fault_crash_token is not None and c.fault_crash_token in prompt:
            self._crash(f"scheduled a prompt holding token {c.fault_crash_token}")
        if c.fault_hang_token is not None and c.fault_hang_token in prompt and not self.hung:
            logger.error("sim fault hook: hanging (scheduled token %d)", c.fault_hang_token)
            self.hung = True

    async def close(self) -> None:
        if self._pending_weights is not None and not self._pending_weights[1].done():
            self._pending_weights[1].set_exception(ToolkitError("engine closed during a weight update"))
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for seq in list(self.running) + list(self.waiting):
            if not seq.future.done():
                seq.future.set_result(Result(request_id=seq.req.request_id, status="engine_dead",
                                             error="engine closed"))

    def _finish(self, seq: _Seq, status: str, finish: str, computed: bool = True) -> None:
        """``computed``: it ran here, so its context is in the prefix cache (not one that never left
        the queue, or whose KV never landed)."""
        n = seq.produced
        if computed:
            self.cache.insert(seq.req.prompt_token_ids + seq.tokens[:n])
        if not seq.future.done():
            seq.future.set_result(Result(
                request_id=seq.req.request_id, status=status, output_token_ids=seq.tokens[:n],
                logprobs=seq.logprobs[:n] if seq.req.sampling.logprobs else [], finish_reason=finish,
                cached_tokens=seq.cached, weight_version=self.weight_version,
                weight_versions=list(seq.versions) or [self.weight_version],
            ))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        scale = self.cfg.time_scale
        next_t = loop.time()
        while True:
            self._switch_weights()  # a step boundary
            if not self.running and not self.waiting:
                if self._active_since is not None:
                    self.active_s += time.monotonic() - self._active_since
                    self._active_since = None
                self._wake.clear()
                await self._wake.wait()
                next_t = loop.time()
                continue  # woken by a request or by a weight update: look again
            if self._active_since is None:
                self._active_since = time.monotonic()
            prefill, self._recompute_tokens = self._recompute_tokens, 0
            while self.waiting and len(self.running) < self.cfg.max_num_seqs:
                seq = self.waiting.popleft()
                if seq.future.done():
                    continue
                prompt = seq.req.prompt_token_ids
                self._faults(prompt)
                found = self.cache.match(prompt)
                prefill += len(prompt) - found
                # KV that travelled with a moved request is neither a prefix-cache hit nor a miss;
                # what the replica held of its context before it came is a hit.
                came = max(0, found - seq.cached) if seq.req.kv_tokens > 0 else 0
                seq.cached = found - came
                self.prefix_queries += len(prompt) - came
                self.prefix_hits += seq.cached
                self.running.append(seq)
            context = sum(len(s.req.prompt_token_ids) + s.produced for s in self.running)
            charged = self.step_time(context, prefill) * scale
            next_t += charged
            delay = next_t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                # Behind schedule (a busy CPU): yield, and forgive debt beyond 50 ms so the model
                # does not burst to catch up.
                await asyncio.sleep(0)
                next_t = max(next_t, loop.time() - 0.05)
            if self.hung:
                continue
            self.steps += 1
            self.model_s += charged
            self.prefill_tokens += prefill
            still = []
            for seq in self.running:
                if seq.future.done():
                    continue
                if seq.produced < len(seq.tokens):
                    seq.produced += 1
                    self.generated_tokens += 1
                    if not seq.versions or seq.versions[-1] != self.weight_version:
                        seq.versions.append(self.weight_version)
                if seq.produced >= len(seq.tokens):
                    self._finish(seq, "ok", seq.finish)
                else:
                    still.append(seq)
            self.running = still
