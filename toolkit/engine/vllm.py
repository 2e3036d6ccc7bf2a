"""``vllm``: vLLM's ``AsyncLLM`` in the replica process. Token ids in; token ids, logprobs and finish
reason out. vLLM is imported only when this backend starts (the sim never pays for it).

- Engine arguments: ``engine.args`` go to ``AsyncEngineArgs`` unchanged; ``model``, ``max_model_len``,
  ``tensor_parallel_size`` and ``kv_cache_gib`` have their own fields. ``model: tiny`` builds the
  built-in test model into ``engine.cache_dir`` first (``toolkit/model/tiny.py``).
- Sampling maps one to one (``n``, ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``ignore_eos``;
  ``logprobs`` asks for the sampled token's logprob); outputs come back once, final (no per-token streaming),
  and are never detokenized.
- Structured outputs: ``Sampling.structured`` becomes ``SamplingParams.structured_outputs``
  (``StructuredOutputsParams(json=schema)`` or ``(choice=[...])``) on vLLM's ``auto`` backend (xgrammar,
  falling back to guidance or outlines; all three work on the CPU build). vLLM validates the schema
  when the request is added, before the engine core sees it: a bad one is a ``client_error`` and the
  engine goes on; a grammar that still fails to compile in the engine finishes its request with
  ``error``, also a ``client_error``.
- Start ends with a warm-up generation with logprobs (the first one takes seconds), so the router's
  readiness probe, a real generation, finds a warm engine.
- Heartbeat numbers come from vLLM's own scheduler stats through a stat logger: running and waiting
  requests, KV usage, prefix-cache hits and queries (tokens, running totals), generated tokens.
- Errors: vLLM's client errors (prompt past ``max_model_len``, token outside the vocabulary, bad
  sampling parameters) are ``client_error``; ``EngineDeadError`` (or the engine core process gone)
  is ``engine_dead`` for every request in the engine, ``dead()`` turns true and the replica calls
  ``restart`` (at most ``max_restarts`` times, then ``EngineGone``).
- LoRA per request (``toolkit/engine/vllm_lora.py``): ``Generate.lora`` is an adapter directory,
  checked on the file system before ``add_lora``; a request whose adapter is not there waits, and
  fails as ``adapter_missing`` only just before its deadline.
- Weights: ``load_weights`` (an idle engine: ``update_mode=drain``) reloads in place from a checkpoint
  directory of the same architecture and resets the prefix cache; ``update_weights_in_place``
  (``update_mode=pause``) does the same with requests running: ``pause_generation(mode="keep")``
  freezes them between engine steps, ``reload_weights``, ``reset_prefix_cache(reset_running_requests=True)``
  (the running requests give up their KV and prefill their context again with the new weights),
  ``resume_generation``; nothing is aborted. vLLM labels every step's output with the engine core's
  weight version (``update_weight_version``, set while paused) and returns spans per completion
  (``CompletionOutput.weight_versions``): ``Result.weight_versions`` is exact. A restarted engine
  reloads the latest checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from toolkit.config import VllmEngineConfig
from toolkit.core.lifecycle import ProcessRef, stop_processes
from toolkit.core.protocol import (
    Completion,
    Generate,
    ReplicaStats,
    Result,
    Sampling,
    StreamWeights,
    Structured,
)
from toolkit.engine import vllm_transfer
from toolkit.engine.base import Engine, EngineGone, EngineInfo
from toolkit.engine.kv_events import KvEventLog
from toolkit.engine.node_role import NodeRole
from toolkit.engine.vllm_kv import VllmKvEvents
from toolkit.engine.vllm_lora import Adapters
from toolkit.engine.vllm_requests import LiveRequests
from toolkit.engine.vllm_setup import cpu_environment, engine_args, stat_logger_factory

logger = logging.getLogger(__name__)

WARMUP_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def _vllm() -> SimpleNamespace:
    """vLLM's names this backend uses, imported once (5-10 s: only in a replica that serves vLLM)."""
    from vllm import SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.exceptions import VLLMClientError
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.platforms import current_platform
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    return SimpleNamespace(SamplingParams=SamplingParams, AsyncEngineArgs=AsyncEngineArgs, AsyncLLM=AsyncLLM,
                           TokensPrompt=TokensPrompt, LoRARequest=LoRARequest, FINAL=RequestOutputKind.FINAL_ONLY,
                           VLLMClientError=VLLMClientError, EngineDeadError=EngineDeadError,
                           StructuredOutputsParams=StructuredOutputsParams, platform=current_platform,
                           KVEventsConfig=KVEventsConfig)


def structured_outputs(v: SimpleNamespace, st: Structured | None) -> Any:
    """vLLM's ``StructuredOutputsParams`` for ``st`` (None for None); ValueError for a malformed one."""
    if st is None:
        return None
    if bool(st.json_schema) == bool(st.choice):
        raise ValueError("sampling.structured: set exactly one of json_schema and choice")
    if st.choice:
        return v.StructuredOutputsParams(choice=list(st.choice))
    try:
        json.loads(st.json_schema)
    except ValueError as exc:
        raise ValueError(f"sampling.structured.json_schema is not JSON: {exc}") from None
    return v.StructuredOutputsParams(json=st.json_schema)


def span_versions(outputs: list[Any]) -> list[int]:
    """The weight versions of the completions' tokens, in order, from vLLM's spans (``[]`` if it gave
    none, e.g. no token was generated: the replica fills in the version it ran on)."""
    versions: list[int] = []
    for i, c in enumerate(outputs):
        for span in getattr(c, "weight_versions", None) or ():
            try:
                v = int(span.version)
            except (TypeError, ValueError):  # a label this backend did not set
                continue
            if span.end <= span.start:
                continue
            # The first completion in order; the others (n > 1, run side by side) add what it lacks.
            if (versions[-1:] != [v]) if i == 0 else (v not in versions):
                versions.append(v)
    return versions


def _client_error(request_id: str, exc: BaseException) -> Result:
    return Result(request_id=request_id, status="client_error", error=f"{type(exc).__name__}: {exc}")


class VllmEngine(Engine):
    shutdown_s = 20.0  # vLLM's executor waits 5 s for its workers, more than once across node ranks

    def __init__(self, cfg: VllmEngineConfig) -> None:
        self.cfg = cfg
        self.v: SimpleNamespace | None = None
        self.llm: Any = None
        self.model_path = cfg.model
        self.info: EngineInfo | None = None
        self.counters = ReplicaStats()
        """vLLM's counters, as the stat logger fills them (``weight_version`` is this engine's own)."""
        self.restarts = 0
        self._procs: list[ProcessRef] = []
        """The running engine's processes (core, workers), to stop by pid when it goes."""
        self.weights_path: str | None = None
        self.path_version = 0
        """The version of ``weights_path`` (0: the model's own): a restarted engine holds it, not a
        streamed version it had before."""
        self.broken = ""
        """Why the engine cannot go on although vLLM still runs (an in-place update that failed half
        way): it counts as dead, and the replica restarts it on the last good weights."""
        self.adapters = Adapters(cfg, None)
        self.active = LiveRequests()
        """Requests in ``generate`` now (an in-place update that fails aborts them)."""
        self.ipc_dir: str | None = None
        """The replica's directory for its engines' ipc sockets (vLLM's own, ``VLLM_RPC_BASE_PATH`` unless the
        user's environment names another, and the KV events'), made at first use and removed at close: an
        engine that dies or is killed leaves its sockets' files behind."""
        self.kv: VllmKvEvents | None = None
        """vLLM's KV events, mapped into the replica's log (``kv_events``)."""

    def kv_events(self) -> KvEventLog:
        if self.kv is None:
            self.kv = VllmKvEvents(KvEventLog(), self._ipc_dir())
        return self.kv.log

    def kv_held(self) -> list[int]:
        return list(self.kv.held.values()) if self.kv is not None else []

    # ---- lifecycle -------------------------------------------------------------------------
    def _ipc_dir(self) -> str:
        if self.ipc_dir is None:
            self.ipc_dir = tempfile.mkdtemp(prefix="vllm-")  # short: an ipc path has 107 bytes
        return self.ipc_dir

    async def start(self) -> EngineInfo:
        os.environ.setdefault("VLLM_RPC_BASE_PATH", self._ipc_dir())  # (else vLLM's go in the temporary dir)
        self.v = await asyncio.to_thread(_vllm)
        self.adapters.request_cls = self.v.LoRARequest
        if self.cfg.model == "tiny":
            from toolkit.model.tiny import ensure_tiny

            self.model_path = str(await asyncio.to_thread(ensure_tiny, self.cfg.cache_dir))
        return await self._boot()

    def engine_args(self) -> dict[str, Any]:
        return engine_args(self.cfg, self.model_path, self.v is not None and self.v.platform.is_cpu(),
                           NodeRole.from_env())

    async def _boot(self) -> EngineInfo:
        v = self.v
        assert v is not None
        t0 = time.monotonic()
        if v.platform.is_cpu():
            cpu_environment(self.cfg, NodeRole.from_env())
        extra = {"kv_events_config": self.kv.config(v.KVEventsConfig)} if self.kv is not None else {}
        args = v.AsyncEngineArgs(**self.engine_args(), **extra)
        # In a thread: the replica's loop keeps beating while a restarted engine comes up (~20 s). A thread
        # cannot be cancelled: the processes it starts are told as they appear, for teardown to find.
        watch = asyncio.create_task(self._tell_children())
        try:
            self.llm = await asyncio.to_thread(v.AsyncLLM.from_engine_args, args,
                                               stat_loggers=[stat_logger_factory(self.counters)])
        finally:
            watch.cancel()
        # Every step's output carries this label; Result.weight_versions comes from it.
        await self.llm.update_weight_version(str(self.weight_version))
        # The first generation with logprobs takes seconds; pay it before the readiness probe.
        sp = v.SamplingParams(max_tokens=2, logprobs=0, detokenize=False, output_kind=v.FINAL)
        async for _ in self.llm.generate(v.TokensPrompt(prompt_token_ids=WARMUP_PROMPT), sp, "__warmup__"):
            pass
        if self.weights_path is not None:
            await self._reload(self.weights_path)
        await self._hold()
        self._procs = [ProcessRef.of(pid, "engine") for pid in self.pids()]
        if v.platform.is_cpu() and self.cfg.cpu_engine_nice:
            self._lower_priority(self.cfg.cpu_engine_nice)
        mc, cc = self.llm.model_config, self.llm.vllm_config.cache_config
        self.info = EngineInfo(self.cfg.model, int(mc.max_model_len), int(mc.get_vocab_size()), int(cc.block_size),
                               int(cc.block_size) * int(cc.num_gpu_blocks or 0))
        if self.kv is not None:
            self.kv.start()
        logger.info("vLLM engine up in %.1fs: %s (max_model_len %d, vocab %d, pids %s)", time.monotonic() - t0,
                    self.model_path, self.info.max_model_len, self.info.vocab_size, self.pids())
        return self.info

    async def close(self) -> None:
        await self._shutdown()
        if self.kv is not None:
            self.kv.close()
            self.kv = None
        if self.ipc_dir is not None:  # the sockets' files of every engine it ran (a restart keeps them)
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            if os.environ.get("VLLM_RPC_BASE_PATH") == self.ipc_dir:
                del os.environ["VLLM_RPC_BASE_PATH"]
            self.ipc_dir = None

    async def _shutdown(self) -> None:
        llm, self.llm = self.llm, None
        self.active.close()
        if self.kv is not None:
            self.kv.stop()
        if llm is not None:
            # Blocking (waits for the engine core process); AsyncLLM.__del__ would call it again at
            # interpreter exit, when half of vLLM is gone: drop the last reference here instead.
            await asyncio.to_thread(llm.shutdown)
            del llm
        # A worker whose engine core was killed is nobody's child: it leaves when it notices, which an
        # engine at +10 niceness on a busy CPU may take minutes to do. Stopped here, by pid, and waited for.
        procs, self._procs = self._procs, []
        left = await asyncio.to_thread(stop_processes, procs)
        if left:
            logger.warning("engine processes %s outlived SIGKILL", [r.pid for r in left])
        self.adapters.cancel_all()

    def dead(self) -> bool:
        return self.llm is not None and (bool(self.llm.errored) or bool(self.broken))

    async def restart(self) -> EngineInfo:
        if NodeRole.from_env() is not None:
            # The other node ranks' workers ended with the engine (or were what died): only a new job
            # brings them all back.
            raise EngineGone("the engine of a replica wider than a node died: the replica ends as a whole")
        self.restarts += 1
        if self.restarts > self.cfg.max_restarts:
            raise EngineGone(f"the engine died {self.restarts} times (engine.max_restarts = {self.cfg.max_restarts})")
        logger.warning("restarting the vLLM engine (%d of at most %d restarts)", self.restarts, self.cfg.max_restarts)
        await self._shutdown()
        self.weight_version = self.path_version
        self.broken = ""
        self.adapters = Adapters(self.cfg, self.adapters.request_cls)  # the new engine has none
        self.counters.running = self.counters.waiting = 0
        self.counters.kv_usage = 0.0
        try:
            return await self._boot()
        except Exception as exc:
            raise EngineGone(f"the engine did not come back: {type(exc).__name__}: {exc}") from exc

    def _lower_priority(self, nice: int) -> None:
        """Add ``nice`` to every thread of the engine processes (threads they start later inherit it)."""
        for pid in self.pids():
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            for tid in tids:
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
                except OSError:
                    pass  # a thread that ended meanwhile
        logger.info("engine processes %s at niceness +%d (cpu_engine_nice)", self.pids(), nice)

    @classmethod
    def serve_node_rank(cls, cfg: Any, role: NodeRole, record_pids: Callable[[list[int]], None]) -> bool:
        from toolkit.engine.vllm_workers import serve_workers

        serve_workers(cfg, role, record_pids)
        return True

    async def _tell_children(self) -> None:
        """This process's children (the engine core, its workers, vLLM's helpers) to ``on_pids``, every
        half second while the engine boots."""
        import psutil  # a vLLM dependency

        me, told = psutil.Process(), set()
        while True:
            try:
                pids = {c.pid for c in me.children(recursive=True)}
            except psutil.Error:
                pids = set()
            if pids - told:
                told |= pids
                self.on_pids(sorted(pids))
            await asyncio.sleep(0.5)

    def pids(self) -> list[int]:
        try:
            procs = self.llm.engine_core.resources.engine_manager.processes
        except AttributeError:  # not started, or an engine whose core runs elsewhere
            return []
        import psutil  # a vLLM dependency

        out = []
        for p in procs:
            out.append(p.pid)
            try:
                out.extend(c.pid for c in psutil.Process(p.pid).children(recursive=True))
            except psutil.Error:
                pass
        return out

    # ---- requests --------------------------------------------------------------------------
    def sampling_params(self, s: Sampling) -> Any:
        v = self.v
        assert v is not None
        return v.SamplingParams(n=s.n, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                seed=s.seed, logprobs=0 if s.logprobs else None, ignore_eos=s.ignore_eos,
                                detokenize=False, structured_outputs=structured_outputs(v, s.structured),
                                output_kind=v.FINAL)

    async def generate(self, req: Generate) -> Result:
        v, llm, rid = self.v, self.llm, req.request_id
        if v is None or llm is None or llm.errored:
            return Result(request_id=rid, status="engine_dead", error="the engine is not running")
        try:
            params = self.sampling_params(req.sampling)
        except (v.VLLMClientError, ValueError, TypeError) as exc:
            return _client_error(rid, exc)
        lora = None
        if req.lora:
            if llm.vllm_config.lora_config is None:
                return Result(request_id=rid, status="client_error",
                              error="a LoRA request to an engine without LoRA: set engine.args.enable_lora=true")
            got = await self.adapters.get(llm, req)
            if isinstance(got, Result):
                return got
            lora = got
            if llm.errored:
                return Result(request_id=rid, status="engine_dead", error="the engine died")
        final = None
        attempt = self.active.begin(rid)
        try:
            async for out in llm.generate(v.TokensPrompt(prompt_token_ids=list(req.prompt_token_ids)), params, rid,
                                          lora_request=lora):
                final = out
            if self.broken:  # aborted by a failed in-place update: run again elsewhere, not "cancelled"
                return Result(request_id=rid, status="engine_dead", error=self.broken)
        except v.EngineDeadError as exc:
            return Result(request_id=rid, status="engine_dead", error=f"EngineDeadError: {exc}")
        except (v.VLLMClientError, ValueError, TypeError) as exc:
            if llm.errored:
                return Result(request_id=rid, status="engine_dead", error=f"{type(exc).__name__}: {exc}")
            return _client_error(rid, exc)
        except Exception as exc:  # EngineGenerateError and the like: this request failed in the engine
            logger.exception("request %s failed in vLLM", rid)
            return Result(request_id=rid, status="engine_dead", error=f"{type(exc).__name__}: {exc}")
        finally:
            self.active.end(rid, attempt)
        res = self.to_result(rid, final)
        if req.sampling.structured is not None and res.finish_reason == "error":
            # The only request-level error of a plain engine: its grammar did not compile (vLLM logs why).
            return Result(request_id=rid, status="client_error", finish_reason="error",
                          error="the structured-output constraint did not compile in the engine (see its log)")
        return res

    @staticmethod
    def to_result(rid: str, final: Any) -> Result:
        """A Result from vLLM's final RequestOutput (samples sorted by index; ``abort`` is ``cancelled``)."""
        if final is None or not final.outputs:
            return Result(request_id=rid, status="cancelled", finish_reason="abort", error="no output")

        def one(c: Any) -> tuple[list[int], list[float], str]:
            tokens = list(c.token_ids)
            lps = [pos[t].logprob for t, pos in zip(tokens, c.logprobs, strict=False)] if c.logprobs else []
            return tokens, lps, c.finish_reason or ""

        outs = sorted(final.outputs, key=lambda c: c.index)
        tokens, lps, finish = one(outs[0])
        return Result(request_id=rid, status="cancelled" if finish == "abort" else "ok", output_token_ids=tokens,
                      logprobs=lps, finish_reason=finish, cached_tokens=int(final.num_cached_tokens or 0),
                      samples=[Completion(*one(c)) for c in outs[1:]], weight_versions=span_versions(outs))

    async def abort(self, request_id: str) -> None:
        llm = self.llm
        if not self.adapters.cancel(request_id) and llm is not None and not llm.errored:
            await llm.abort(request_id)
            self.active.abort(request_id, llm.abort)  # (lost if vLLM had not registered it yet: asked again)

    def stats(self) -> ReplicaStats:
        c = self.counters
        up = self.llm is not None and not self.llm.errored
        return ReplicaStats(running=c.running if up else 0, waiting=c.waiting if up else 0,
                            kv_usage=c.kv_usage if up else 0.0, prefix_hits=c.prefix_hits,
                            prefix_queries=c.prefix_queries, weight_version=self.weight_version,
                            generated_tokens=c.generated_tokens)

    # ---- weights ---------------------------------------------------------------------------
    async def load_weights(self, path: str, version: int) -> None:
        if not await asyncio.to_thread(os.path.isdir, path):
            raise FileNotFoundError(f"no checkpoint directory {path}")
        try:
            await self._reload(path)
            await self.llm.update_weight_version(str(version))
        except BaseException as exc:
            # Half loaded, as in update_weights_in_place: the engine counts as dead and the replica
            # restarts it on the last good weights, rather than serving these under the old version.
            self.broken = f"update to {path} failed: {type(exc).__name__}: {exc}"
            raise
        self.weights_path, self.path_version = path, version
        self.weight_version = version
        await self._hold()

    async def update_weights_in_place(self, path: str, version: int) -> None:
        """Reload with requests running, none aborted (vLLM 0.32, read in its code):

        - ``pause_generation(mode="keep", clear_cache=False)``: the scheduler goes to ``PAUSED_ALL`` (it
          schedules nothing, running requests keep their state and KV blocks); it returns once the step
          in flight has been output. ``abort`` would end them, ``wait`` would drain them (our ``drain``).
          ``clear_cache=True`` would preempt them and reset the caches at this point, before the reload;
          we do that ourselves after it, where the reason is plain.
        - ``collective_rpc("reload_weights")``: the workers load the checkpoint into the model in place
          (and drop LoRA, encoder and multimodal caches).
        - ``reset_prefix_cache(reset_running_requests=True)``: a plain reset fails (returns False) while
          running requests hold blocks. With ``reset_running_requests`` the scheduler preempts them
          (back to the waiting queue, ``num_computed_tokens = 0``, blocks freed) and then clears every
          cached block hash. On resume each one prefills prompt + its tokens so far with the new weights
          and decodes on. So the tokens after the switch are the new weights' answer to the whole
          context, not an attention over KV the old weights computed; it costs one prefill per running
          request (cheap beside its decode). The sampled tokens so far are kept, nothing is resampled.
        - ``update_weight_version``: the engine core labels the outputs of every later step with it;
          each completion gets ``[version, start, end)`` spans (``Result.weight_versions``).
        - ``resume_generation()``: back to ``UNPAUSED``; the same requests stream on and finish.
        """
        llm = self.llm
        if not await asyncio.to_thread(os.path.isdir, path):
            raise FileNotFoundError(f"no checkpoint directory {path}")
        t0 = time.monotonic()
        await llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            if not await llm.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("vLLM could not reset its prefix cache after the reload")
            self.adapters.forget_loaded()  # reload_weights removed them
            await llm.update_weight_version(str(version))
        except BaseException as exc:
            # The weights may be half loaded: no request resumes on them under either version's name.
            # They end now as engine_dead (the router runs them again elsewhere), and the engine counts
            # as dead: the replica restarts it on the last good weights.
            self.broken = f"in-place update to {path} failed: {type(exc).__name__}: {exc}"
            if self.active:
                await llm.abort(list(self.active))  # their Results say engine_dead (see generate)
            raise
        self.weights_path, self.path_version = path, version
        self.weight_version = version
        await self._hold()
        await llm.resume_generation()
        logger.info("weights reloaded in place from %s in %.2fs", path, time.monotonic() - t0)

    async def _hold(self) -> None:
        """With the toolkit's weight-transfer backend: the workers' base for deltas is what is loaded now."""
        if vllm_transfer.enabled(self.engine_args()):
            await vllm_transfer.hold(self.llm, self.weights_path or self.model_path, self.weight_version)

    @property
    def stream_transport(self) -> str:  # type: ignore[override]
        return "gloo" if vllm_transfer.enabled(self.engine_args()) else ""

    @property
    def stream_ranks(self) -> int:  # type: ignore[override]
        return self.cfg.tensor_parallel_size * self.cfg.pipeline_parallel_size  # every worker holds weights

    async def stage_stream(self, msg: StreamWeights) -> None:
        """A streamed update (``toolkit/engine/vllm_transfer.py``) staged over the network by the
        workers while the engine serves; a failed stage changes nothing."""
        await vllm_transfer.stage(self.llm, msg)

    async def discard_stream(self) -> None:
        await vllm_transfer.discard(self.llm)

    async def apply_stream(self, version: int) -> None:
        """Put the staged update in with requests running, as :meth:`update_weights_in_place` does (pause
        ``keep``, reset the prefix cache, resume; nothing aborted). A failed apply is rolled back by the
        workers (the engine serves on, on the previous version), or, if that failed too, the engine
        counts as dead."""
        llm = self.llm
        t0 = time.monotonic()
        await llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await vllm_transfer.apply(llm, version)
            if not await llm.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("vLLM could not reset its prefix cache after the update")
        except BaseException as exc:
            st = await vllm_transfer.status(llm)
            if st.get("state") != "rolled_back":
                self.broken = f"streamed update to version {version} failed: {type(exc).__name__}: {exc}"
                if self.active:
                    await llm.abort(list(self.active))
                raise
            await llm.resume_generation()
            raise
        self.adapters.forget_loaded()
        self.weight_version = version
        await llm.resume_generation()
        logger.info("streamed weights version %d applied in a %.2fs pause", version, time.monotonic() - t0)

    async def _reload(self, path: str) -> None:
        t0 = time.monotonic()
        await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        self.adapters.forget_loaded()  # reload_weights removed them
        # Cached KV was computed by the old weights (no request is running: a plain reset succeeds).
        if not await self.llm.reset_prefix_cache():
            logger.warning("vLLM did not reset its prefix cache after the reload (blocks still in use)")
        logger.info("weights reloaded from %s in %.2fs", path, time.monotonic() - t0)
