"""Setup checks of the ``vllm`` engine beyond its fields' declared bounds (``VllmEngineConfig``); no vLLM
needed."""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.config import VLLM_OWN_ARGS, VllmEngineConfig
from toolkit.core.errors import FieldError

OWN_ARG = ("not an engine.args key: use engine.model, engine.max_model_len, engine.tensor_parallel_size, "
           "engine.pipeline_parallel_size or engine.kv_cache_gib (disable_log_stats is the backend's: it keeps its "
           "own stat logger; nnodes, node_rank, master_addr and master_port come from the placement: "
           "cluster.gpus_per_node)")


def check(e: VllmEngineConfig, prefix: str, fields: set[str]) -> list[FieldError]:
    """``e`` is ``engine`` or a group's version of it (``prefix``); only ``fields`` are its own to report.
    Paths are checked from launch's node, which sees the shared file system they must be on: a typo
    found here costs nothing, found by every replica at boot it costs an allocation."""
    errors: list[FieldError] = []
    if "args" in fields:
        errors += [FieldError(f"{prefix}.args.{key}", e.args[key], OWN_ARG) for key in e.args if key in VLLM_OWN_ARGS]
    if "model" in fields and e.model.startswith(("/", "./", "../", "~")) and not Path(e.model).expanduser().is_dir():
        errors.append(FieldError(f"{prefix}.model", e.model, "a model directory on the shared file system (no "
                                 "such directory here), a hub name, or tiny"))
    if "cache_dir" in fields and e.model == "tiny" and (why := dir_problem(e.cache_dir)):
        errors.append(FieldError(f"{prefix}.cache_dir", e.cache_dir, f"a directory this user can write ({why})"))
    return errors


def dir_problem(path: str) -> str | None:
    """Why a directory at ``path`` could not be used or made by this user (None if it can)."""
    target = Path(path).expanduser()
    there = target
    while not there.exists() and there.parent != there:
        there = there.parent  # the nearest part that exists: the rest would be made under it
    if not there.is_dir():
        return f"{there} is not a directory"
    if not os.access(there, os.W_OK | os.X_OK):
        return f"{there} is not writable"
    return None
