"""Setup checks of the ``vllm`` engine beyond its fields' declared bounds (``VllmEngineConfig``); no vLLM
needed."""

from __future__ import annotations

from toolkit.config import VLLM_OWN_ARGS, VllmEngineConfig
from toolkit.core.errors import FieldError

OWN_ARG = ("not an engine.args key: use engine.model, engine.max_model_len, engine.tensor_parallel_size, "
           "engine.pipeline_parallel_size or engine.kv_cache_gib (disable_log_stats is the backend's: it keeps its "
           "own stat logger; nnodes, node_rank, master_addr and master_port come from the placement: "
           "cluster.gpus_per_node)")


def check(e: VllmEngineConfig, prefix: str, fields: set[str]) -> list[FieldError]:
    """``e`` is ``engine`` or a group's version of it (``prefix``); only ``fields`` are its own to report."""
    if "args" not in fields:
        return []
    return [FieldError(f"{prefix}.args.{key}", e.args[key], OWN_ARG) for key in e.args if key in VLLM_OWN_ARGS]
