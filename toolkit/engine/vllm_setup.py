"""How a replica's vLLM is set up: its ``AsyncEngineArgs`` (the same on every node rank of a replica
wider than a node), the CPU build's thread binding and allocator, and the stat logger that feeds
heartbeats."""

from __future__ import annotations

import ctypes.util
import logging
import os
from collections.abc import Callable
from typing import Any

from toolkit.config import CpuAllocator, VllmEngineConfig
from toolkit.core.errors import ToolkitError
from toolkit.core.protocol import ReplicaStats
from toolkit.engine.nodes import NodeRole

logger = logging.getLogger(__name__)

TCMALLOC = ("tcmalloc_minimal", "tcmalloc")
"""TCMalloc's libraries, as ``ctypes.util.find_library`` names them (the minimal one first, as vLLM's CPU
platform picks its bundled copy)."""


class AllocatorMissing(ToolkitError):
    """``engine.cpu_allocator=tcmalloc`` on a node without TCMalloc, or with another allocator preloaded."""


def record(counters: ReplicaStats, scheduler_stats: Any, iteration_stats: Any) -> None:
    """vLLM's stats of one engine step into ``counters`` (the heartbeat's); running totals survive restarts."""
    if scheduler_stats is not None:
        counters.running = scheduler_stats.num_running_reqs
        counters.waiting = scheduler_stats.num_waiting_reqs
        counters.kv_usage = scheduler_stats.kv_cache_usage
        # Per-step deltas, also across a prefix-cache reset (its ``reset`` flag): keep totals.
        pcs = scheduler_stats.prefix_cache_stats
        counters.prefix_queries += pcs.queries
        counters.prefix_hits += pcs.hits
    if iteration_stats is not None:
        counters.generated_tokens += iteration_stats.num_generation_tokens


def stat_logger_factory(counters: ReplicaStats) -> Any:
    """A vLLM stat logger class (its own factory: ``(vllm_config, engine_index)``) feeding ``counters``;
    vLLM calls it on the replica's event loop after every engine step with output."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class HeartbeatStats(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            record(counters, scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return HeartbeatStats


def cpu_thread_binding(tp: int, cpus: list[int]) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` CPU workers on one NUMA node ("0|1", "0,1|2,3"): the CPU
    build refuses to bind more than one worker per NUMA node on its own."""
    if tp <= 1 or len(cpus) < tp:
        return None
    per = len(cpus) // tp
    return "|".join(",".join(str(c) for c in cpus[i * per:(i + 1) * per]) for i in range(tp))


def engine_args(c: VllmEngineConfig, model_path: str, cpu: bool, role: NodeRole | None) -> dict[str, Any]:
    """``AsyncEngineArgs`` of a replica, the same on each of its node ranks (``role``: a replica wider than
    a node, whose node ranks meet at the master address with vLLM's multiprocessing executor)."""
    args = {"enable_log_requests": False, **c.args}
    args.update(model=model_path, max_model_len=c.max_model_len, tensor_parallel_size=c.tensor_parallel_size,
                pipeline_parallel_size=c.pipeline_parallel_size,
                # Our stat logger only: vLLM's default ones print every 10 s and keep Prometheus series.
                disable_log_stats=True)
    if c.kv_cache_gib is not None:
        args["kv_cache_memory_bytes"] = int(c.kv_cache_gib * (1 << 30))
    if role is not None:
        args.update(distributed_executor_backend="mp", nnodes=role.nnodes, node_rank=role.rank,
                    master_addr=role.master_addr, master_port=role.master_port)
    if cpu:
        # vLLM 0.32's CPU build kills the engine when a request with a seed has its prefill split
        # over steps (it rewinds the seeded generator, which CPU generators cannot do): whole
        # prefills only, unless engine.args says otherwise.
        args.setdefault("enable_chunked_prefill", False)
    return args


def cpu_environment(c: VllmEngineConfig, role: NodeRole | None) -> None:
    """On the CPU build: bind each local worker's threads to its own cores (inherited by the engine
    core's workers); node ranks that share a host split its cores and talk over loopback."""
    cpus = sorted(os.sched_getaffinity(0))
    workers = c.tensor_parallel_size * c.pipeline_parallel_size
    if role is not None:
        cpus = role.cpus(cpus)
        workers = max(1, workers // role.nnodes)
        if role.one_host:
            os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ["LD_PRELOAD"] = allocator_preload(CpuAllocator(c.cpu_allocator), os.environ.get("LD_PRELOAD", ""))
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    bind = cpu_thread_binding(workers, cpus) if workers > 1 else (",".join(map(str, cpus)) if role else None)
    if bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind


def allocator_preload(choice: CpuAllocator, preload: str,
                      find: Callable[[str], str | None] = ctypes.util.find_library) -> str:
    """``LD_PRELOAD`` for the engine processes under ``engine.cpu_allocator`` (``preload``: the current one).
    The CPU build spawns its engine core and workers afresh, so a library named here is theirs; the
    replica process itself keeps the allocator it started with."""
    if choice == CpuAllocator.system or "tcmalloc" in preload:
        return preload
    if "malloc" in preload:  # the user's own allocator (jemalloc, mimalloc...): theirs to choose
        if choice == CpuAllocator.tcmalloc:
            raise AllocatorMissing(f"engine.cpu_allocator=tcmalloc, but LD_PRELOAD already has another allocator "
                                   f"({preload}): take it out, or set engine.cpu_allocator to auto or system")
        return preload
    lib = next((found for name in TCMALLOC if (found := find(name))), None)
    if lib is None:
        if choice == CpuAllocator.tcmalloc:
            raise AllocatorMissing("engine.cpu_allocator=tcmalloc, but this node has no TCMalloc (install "
                                   "libtcmalloc-minimal4), or set engine.cpu_allocator to auto or system")
        logger.warning("no TCMalloc on this node: the CPU engine runs on the system's malloc, which decodes and "
                       "reloads weights slower (install libtcmalloc-minimal4; engine.cpu_allocator=system "
                       "silences this)")
        return preload
    logger.info("engine processes on %s (engine.cpu_allocator=%s)", lib, choice)
    return f"{lib}:{preload}" if preload else lib
