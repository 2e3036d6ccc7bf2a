"""Samples as flat columns: packing on each rank, Gatherv to rank 0, and the Parquet table.

A rank packs its samples into a handful of contiguous numpy arrays (token values, per-sample
lengths, scalar columns). ``gather_columns`` moves each array with one ``Gather`` of counts and one
``Gatherv`` of data: no sample is ever pickled. Rank 0 turns them into an Arrow table with list
columns built zero-copy from offsets, sorted by session index.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from toolkit.rollout.sample import SAMPLE_STATUSES, Sample

Columns = dict[str, np.ndarray]

# Variable-length columns: values array + a per-sample length array named "<name>__len".
LIST_COLUMNS = {"tokens": np.int32, "loss_mask": np.int8, "rollout_logprobs": np.float32,
                "weight_versions": np.int64}
SCALAR_COLUMNS = {"index": np.int64, "reward": np.float64, "status": np.int8, "prompt_length": np.int32,
                  "response_length": np.int32, "generated_tokens": np.int32, "num_turns": np.int32,
                  "num_replicas": np.int32, "cached_tokens": np.int64, "groups_mask": np.int64}


def pack(samples: list[Sample], group_names: list[str]) -> Columns:
    """The rank-local columns of ``samples``; ``group_names`` fixes the bit of each group."""
    bit = {g: 1 << i for i, g in enumerate(group_names)}
    cols: Columns = {}
    for name, dtype in LIST_COLUMNS.items():
        parts = [getattr(s, name) for s in samples]
        cols[f"{name}__len"] = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        flat = [x for p in parts for x in p]
        cols[name] = np.asarray(flat, dtype=dtype) if flat else np.zeros(0, dtype=dtype)
    scalars: dict[str, list[Any]] = {
        "index": [s.index for s in samples],
        "reward": [s.reward for s in samples],
        "status": [SAMPLE_STATUSES.index(s.status) for s in samples],
        "prompt_length": [s.prompt_length for s in samples],
        "response_length": [s.response_length for s in samples],
        "generated_tokens": [s.generated_tokens for s in samples],
        "num_turns": [s.num_turns for s in samples],
        "num_replicas": [len(s.replicas) for s in samples],
        "cached_tokens": [s.cached_tokens for s in samples],
        "groups_mask": [sum(bit.get(g, 0) for g in s.groups) for s in samples],
    }
    for name, dtype in SCALAR_COLUMNS.items():
        cols[name] = np.asarray(scalars[name], dtype=dtype)
    return cols


def gather_columns(comm: Any, cols: Columns, root: int = 0) -> Columns | None:
    """Concatenate every rank's arrays on ``root`` (rank order); None on the other ranks.

    All ranks must pass the same column names and dtypes.
    """
    out: Columns = {}
    rank, size = comm.Get_rank(), comm.Get_size()
    for name in sorted(cols):
        arr = np.ascontiguousarray(cols[name])
        n = np.array([arr.size], dtype=np.int64)
        counts = np.empty(size, dtype=np.int64) if rank == root else None
        comm.Gather(n, counts, root=root)
        if rank == root:
            assert counts is not None
            recv = np.empty(int(counts.sum()), dtype=arr.dtype)
            comm.Gatherv(arr, (recv, counts), root=root)
            out[name] = recv
        else:
            comm.Gatherv(arr, None, root=root)
    return out if rank == root else None


def _list_array(values: np.ndarray, lengths: np.ndarray) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def to_table(cols: Columns, group_names: list[str], session_ids: list[str] | None = None) -> pa.Table:
    """The step's Parquet table: one row per session, sorted by session index."""
    n = len(cols["index"])
    data: dict[str, pa.Array] = {"index": pa.array(cols["index"])}
    for name in LIST_COLUMNS:
        data[name] = _list_array(cols[name], cols[f"{name}__len"])
    for name in SCALAR_COLUMNS:
        if name in ("index", "status", "groups_mask"):
            continue
        data[name] = pa.array(cols[name])
    data["status"] = pa.DictionaryArray.from_arrays(
        pa.array(cols["status"].astype(np.int32)), pa.array(list(SAMPLE_STATUSES))
    ).cast(pa.string())
    masks = cols["groups_mask"]
    data["groups"] = pa.array([[g for i, g in enumerate(group_names) if m >> i & 1] for m in masks.tolist()],
                              type=pa.list_(pa.string()))
    data["response"] = pa.array([""] * n, type=pa.string())
    data["response_decoded"] = pa.array(np.zeros(n, dtype=bool))
    if session_ids is not None:
        data["session_id"] = pa.array(session_ids, type=pa.string())
    table = pa.table(data)
    return table.take(pa.array(np.argsort(cols["index"], kind="stable")))


def write_parquet(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
