"""``sim``: a simulator of a continuous-batching LLM engine, for CPU runs, tests and policy sweeps.

It is a named simulator, not a model: tokens and logprobs are pseudo-random, seeded by the prompt, so
a request always gets the same ones (``plans.py``). A decode step reads all weights plus every running
sequence's KV cache and prefill costs uncached tokens (``step_model.py``); an LRU prefix cache over token
blocks decides what is cached (``prefix_cache.py``). It also honours structured outputs, keeps weight
versions and has fault hooks for tests. Defaults and every knob: docs/engines.md#the-sim-engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import deque

import msgspec

from toolkit.config import SimEngineConfig
from toolkit.core.errors import ToolkitError
from toolkit.core.protocol import Generate, ReplicaStats, Result, StreamWeights
from toolkit.engine.base import Engine, EngineInfo
from toolkit.engine.kv_events import KvEventLog
from toolkit.engine.plans import plan_output, sampling_error
from toolkit.engine.prefix_cache import PrefixCache
from toolkit.engine.step_model import step_seconds
from toolkit.model.tokenizer import Tokenizer, load_tokenizer
from toolkit.weights.wire import Manifest, WrongBase

logger = logging.getLogger(__name__)


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
        # (a prompt of max_model_len leaves no room for one token: vLLM refuses it too)
        if not prompt or len(prompt) >= self.cfg.max_model_len or min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
            return Result(request_id=req.request_id, status="client_error",
                          error=f"prompt of {len(prompt)} tokens outside limits (shorter than max_model_len "
                                f"{self.cfg.max_model_len}, ids below vocab {self.cfg.vocab_size})")
        if error := sampling_error(req.sampling):
            return Result(request_id=req.request_id, status="client_error", error=error)
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
