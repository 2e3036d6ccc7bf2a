"""A node rank > 0 of a vLLM replica wider than a node: vLLM's headless workers, in this process.

What ``vllm serve --headless --node-rank N`` does (``vllm/entrypoints/cli/serve.py``, ``run_headless``):
the same engine arguments as node rank 0 (``nnodes``, ``node_rank``, ``master_addr``, ``master_port``,
the multiprocessing executor) make a ``VllmConfig``, and a ``MultiprocExecutor`` starts this node's
workers, which join node rank 0's engine through the master address and then take their orders from
its scheduler.

vLLM's headless workers never notice that node rank 0 is gone: they wait for the scheduler's next
message (or, while they start, for ``torch.distributed``'s rendezvous) with no useful timeout. The
node rank's watch of node rank 0's beacon (``toolkit/engine/beacon.py``, started by
``toolkit/engine/nodes.py`` before this) kills them; the executor's monitor returns, or its start
raises, and the replica ends as a whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from toolkit.config import VllmEngineConfig
from toolkit.core.lifecycle import exit_on_sigterm
from toolkit.engine.node_role import NodeRole
from toolkit.engine.vllm_setup import cpu_environment, engine_args
from toolkit.model.tiny import ensure_tiny

logger = logging.getLogger(__name__)


def serve_workers(cfg: VllmEngineConfig, role: NodeRole, record_pids: Callable[[list[int]], None]) -> None:
    """Run this node's workers until one of them ends (node rank 0 gone, or a worker died)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    model = cfg.model
    if model == "tiny":
        model = str(ensure_tiny(cfg.cache_dir))
    cpu = current_platform.is_cpu()
    if cpu:
        cpu_environment(cfg, role)
    vllm_config = AsyncEngineArgs(**engine_args(cfg, model, cpu, role)).create_engine_config(
        usage_context=UsageContext.ENGINE_CONTEXT, headless=True)
    t0 = time.monotonic()
    # Returns once this node's workers loaded their share of the model and joined node rank 0's.
    executor = MultiprocExecutor(vllm_config, monitor_workers=False)
    record_pids([w.proc.pid for w in executor.workers])
    logger.info("node rank %d: %d worker(s) up in %.1fs (pids %s)", role.rank, len(executor.workers),
                time.monotonic() - t0, [w.proc.pid for w in executor.workers])
    # SIGTERM (teardown, scancel) ends this process through SystemExit (``enter_component``); the
    # executor's shutdown stops the workers.
    exit_on_sigterm()  # again: vLLM's imports may have replaced the handler
    try:
        executor.start_worker_monitor(inline=True)  # blocks until a local worker ends
        logger.info("node rank %d: a worker ended (%s)", role.rank,
                    [(w.rank, w.proc.exitcode) for w in executor.workers])
    finally:
        # Workers blocked on the scheduler's queue ignore SIGTERM: vLLM's shutdown would wait its grace
        # period for them first. They hold nothing worth a clean exit (node rank 0 owns the requests).
        for w in executor.workers:
            if w.proc.is_alive():
                w.proc.kill()
        executor.shutdown()
