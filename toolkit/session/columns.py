"""Samples as flat columns: packing on each rank, Gatherv to rank 0, and the Parquet table.

A rank packs its samples into a handful of contiguous numpy arrays (token values, per-sample
lengths, scalar columns; strings as UTF-8 bytes). ``gather_columns`` moves each array with one
``Gather`` of counts and one ``Gatherv`` of data: no sample is ever pickled. Rank 0 turns them into
an Arrow table with list and string columns built zero-copy from offsets, and writes it sorted by
session index one row group at a time, so the sorted copy never exists whole.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from toolkit.session.sample import SAMPLE_STATUSES, Sample

Columns = dict[str, np.ndarray]

# Variable-length columns: values array + a per-sample length array named "<name>__len".
LIST_COLUMNS = {"tokens": np.int32, "loss_mask": np.int8, "rollout_logprobs": np.float32,
                "weight_versions": np.int64}
# Lists of lists (one list per turn): values + per-inner-list lengths "<name>__len" + lists per sample
# "<name>__turns"; all three are plain arrays for Gatherv.
NESTED_COLUMNS = {"turn_weight_versions": np.int64}
# Strings travel the same way, as UTF-8 bytes (uint8 values + lengths); replica ids joined by "\n".
TEXT_COLUMNS = ("response", "error", "replicas", "messages")
SCALAR_COLUMNS = {"index": np.int64, "reward": np.float64, "status": np.int8, "prompt_length": np.int32,
                  "response_length": np.int32, "generated_tokens": np.int32, "num_turns": np.int32,
                  "num_replicas": np.int32, "cached_tokens": np.int64, "groups_mask": np.int64,
                  "response_decoded": np.int8, "branch": np.int32, "started_step": np.int64,
                  "carried": np.int32, "staleness": np.int32}
# What the step report needs: with rollout.output=shards only these travel to rank 0.
STAT_COLUMNS = tuple(SCALAR_COLUMNS)
# Tokens per Parquet row group (about 9 MB of tokens, mask and logprobs before compression): small
# enough that rank 0 holds little beyond the gathered arrays while it writes, large enough that the
# per-group dictionaries cost under 1% of the file (measured with toolkit/bench/merge.py).
ROW_GROUP_TOKENS = 1 << 20
# Logprobs are high-entropy floats: dictionary encoding only wastes a dictionary before falling back
# to plain; byte-stream-split + zstd is smaller and faster. Every other column keeps its dictionary.
PLAIN_FLOAT_COLUMNS = ("rollout_logprobs",)
COMPRESSION = "zstd"


def _text(sample: Sample, name: str) -> str:
    return "\n".join(sorted(sample.replicas)) if name == "replicas" else getattr(sample, name)


def pack(samples: Iterable[Sample], group_names: list[str]) -> Columns:
    """The rank-local columns of ``samples``; ``group_names`` fixes the bit of each group."""
    builder = ColumnBuilder(group_names)
    for s in samples:
        builder.add(s)
    return builder.columns()


class StatBuilder:
    """Packs the samples' scalar columns alone (:data:`STAT_COLUMNS`: what a step report reads), one sample
    at a time: the fleet twin's ranks, which write no rows."""

    def __init__(self, group_names: list[str]) -> None:
        self.bit = {g: 1 << i for i, g in enumerate(group_names)}
        self._scalars: dict[str, list[Any]] = {name: [] for name in SCALAR_COLUMNS}

    def __len__(self) -> int:
        return len(self._scalars["index"])

    def add(self, s: Sample) -> None:
        self.append(self.row(s))

    def row(self, s: Sample) -> dict[str, Any]:
        """``s``'s scalar columns (:meth:`append` adds them)."""
        return {
            "index": s.index, "reward": s.reward, "status": SAMPLE_STATUSES.index(s.status),
            "prompt_length": s.prompt_length, "response_length": s.response_length,
            "generated_tokens": s.generated_tokens, "num_turns": s.num_turns, "num_replicas": len(s.replicas),
            "cached_tokens": s.cached_tokens, "groups_mask": sum(self.bit.get(g, 0) for g in s.groups),
            "response_decoded": int(s.response_decoded), "branch": s.branch,
            "started_step": s.started_step, "carried": s.carried, "staleness": s.staleness,
        }

    def append(self, row: dict[str, Any]) -> None:
        for name, value in row.items():
            self._scalars[name].append(value)

    def columns(self) -> Columns:
        """The scalar columns of every sample added so far; the builder starts empty again."""
        cols: Columns = {}
        for name, dtype in SCALAR_COLUMNS.items():
            cols[name] = np.asarray(self._scalars[name], dtype=dtype)
            self._scalars[name].clear()
        return cols


class ColumnBuilder:
    """Packs samples one at a time, so a rank can drop each finished sample's Python lists at once."""

    def __init__(self, group_names: list[str]) -> None:
        self._stats = StatBuilder(group_names)
        self._parts: dict[str, list[np.ndarray]] = {name: [] for name in (*LIST_COLUMNS, *TEXT_COLUMNS, *NESTED_COLUMNS)}
        self._lengths: dict[str, list[int]] = {name: [] for name in self._parts}
        self._outer: dict[str, list[int]] = {name: [] for name in NESTED_COLUMNS}

    def __len__(self) -> int:
        return len(self._stats)

    def add(self, s: Sample) -> None:
        """Every column of ``s``, or none (all are read before any is kept: the columns stay aligned)."""
        parts: list[tuple[str, np.ndarray, list[int]]] = []
        for name, dtype in LIST_COLUMNS.items():
            part = getattr(s, name)
            parts.append((name, np.fromiter(part, dtype=dtype, count=len(part)), [len(part)]))
        for name in TEXT_COLUMNS:
            # Text that is not UTF-8 (an error naming a file decoded with surrogateescape) is escaped:
            # Parquet's strings are UTF-8, and one sample's text must not fail its rank's step.
            raw = _text(s, name).encode("utf-8", "backslashreplace")
            parts.append((name, np.frombuffer(raw, dtype=np.uint8), [len(raw)]))
        outer = []
        for name, dtype in NESTED_COLUMNS.items():
            inner = getattr(s, name)
            parts.append((name, np.fromiter(itertools.chain.from_iterable(inner), dtype=dtype), list(map(len, inner))))
            outer.append((name, len(inner)))
        row = self._stats.row(s)
        for name, array, lengths in parts:
            self._parts[name].append(array)
            self._lengths[name].extend(lengths)
        for name, n in outer:
            self._outer[name].append(n)
        self._stats.append(row)

    def columns(self) -> Columns:
        """The columns of every sample added so far; the builder starts empty again, so the per-sample
        parts and their concatenation are never held together for long."""
        cols: Columns = {}
        for name, parts in self._parts.items():
            dtype = LIST_COLUMNS.get(name) or NESTED_COLUMNS.get(name) or np.uint8
            cols[name] = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
            parts.clear()
            cols[f"{name}__len"] = np.asarray(self._lengths[name], dtype=np.int64)
            self._lengths[name].clear()
        for name, outer in self._outer.items():
            cols[f"{name}__turns"] = np.asarray(outer, dtype=np.int64)
            outer.clear()
        cols.update(self._stats.columns())
        return cols


Packer = ColumnBuilder | StatBuilder
"""What a step's closer packs its landed samples with: every column (a rank), or the stats alone (the twin)."""


def final_rows(cols: Columns) -> np.ndarray:
    """Which rows are a session's outcome: its last row. A session's rows (its branches, the final
    line last) are consecutive wherever columns are packed or gathered, so that is every row whose
    next row belongs to another session."""
    idx = cols["index"]
    last = np.ones(idx.size, dtype=bool)
    if idx.size > 1:
        last[:-1] = idx[1:] != idx[:-1]
        started = cols.get("started_step")
        if started is not None:  # a step closed on a count holds sessions of several starting steps
            last[:-1] |= started[1:] != started[:-1]
    return last


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


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _list_array(values: np.ndarray, lengths: np.ndarray) -> pa.Array:
    return pa.LargeListArray.from_arrays(pa.array(_offsets(lengths)), pa.array(values))


def _string_array(values: np.ndarray, lengths: np.ndarray) -> pa.Array:
    return pa.LargeStringArray.from_buffers(len(lengths), pa.py_buffer(_offsets(lengths)),
                                            pa.py_buffer(np.ascontiguousarray(values)))


def to_table(cols: Columns, group_names: list[str], session_ids: list[str] | None = None,
             sort: bool = True) -> pa.Table:
    """The step's table: one row per session, sorted by session index unless ``sort=False``
    (:func:`write_parquet` sorts while it writes, without a second copy of the table)."""
    n = len(cols["index"])
    data: dict[str, pa.Array] = {"index": pa.array(cols["index"])}
    if session_ids is not None:
        data["session_id"] = pa.array(session_ids, type=pa.string())
    for name in LIST_COLUMNS:
        data[name] = _list_array(cols[name], cols[f"{name}__len"])
    for name in NESTED_COLUMNS:
        data[name] = pa.LargeListArray.from_arrays(pa.array(_offsets(cols[f"{name}__turns"])),
                                                   _list_array(cols[name], cols[f"{name}__len"]))
    for name in SCALAR_COLUMNS:
        if name in ("index", "status", "groups_mask", "response_decoded"):
            continue
        data[name] = pa.array(cols[name])
    data["status"] = pa.DictionaryArray.from_arrays(
        pa.array(cols["status"].astype(np.int32)), pa.array(list(SAMPLE_STATUSES))
    ).cast(pa.string())
    masks = cols["groups_mask"]
    data["groups"] = pa.array([[g for i, g in enumerate(group_names) if m >> i & 1] for m in masks.tolist()],
                              type=pa.list_(pa.string()))
    joined = _string_array(cols["replicas"], cols["replicas__len"]).to_pylist()
    data["replicas"] = pa.array([r.split("\n") if r else [] for r in joined], type=pa.list_(pa.string()))
    data["response"] = _string_array(cols["response"], cols["response__len"])
    decoded = pa.array(cols["response_decoded"].astype(bool) if n else np.zeros(0, dtype=bool))
    data["response_decoded"] = decoded
    data["metadata"] = pa.StructArray.from_arrays([decoded], names=["response_decoded"])
    data["error"] = _string_array(cols["error"], cols["error__len"])
    data["messages"] = _string_array(cols["messages"], cols["messages__len"])
    table = pa.table(data)
    return _sorted(table) if sort else table


def _order(table: pa.Table) -> np.ndarray | None:
    """The permutation that sorts ``table`` by (started step, index); None if it is sorted already."""
    idx = table.column("index").to_numpy()
    started = (table.column("started_step").to_numpy() if "started_step" in table.column_names
               else np.zeros_like(idx))
    if idx.size < 2:
        return None
    order = np.lexsort((idx, started))  # stable: a session's rows (its branches) keep their order
    return None if bool(np.all(order == np.arange(idx.size))) else order


def _sorted(table: pa.Table) -> pa.Table:
    order = _order(table)
    return table if order is None else table.take(pa.array(order))


def rows_per_group(table: pa.Table) -> int:
    """Rows per Parquet row group so each holds about ROW_GROUP_TOKENS tokens."""
    n = table.num_rows
    if n == 0 or "tokens" not in table.column_names:
        return max(n, 1)
    tokens = table.column("tokens")
    total = sum(len(c.values) for c in tokens.chunks)
    return max(1, min(n, int(n * ROW_GROUP_TOKENS / max(total, 1))))


def _leaf_paths(field: pa.Field) -> list[str]:
    if pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
        return [f"{field.name}.list.{p}" for p in _leaf_paths(field.type.value_field)]
    if pa.types.is_struct(field.type):
        return [f"{field.name}.{p}" for i in range(field.type.num_fields) for p in _leaf_paths(field.type.field(i))]
    return [field.name]


def _writer_options(schema: pa.Schema) -> dict[str, Any]:
    plain = [p for f in schema if f.name in PLAIN_FLOAT_COLUMNS for p in _leaf_paths(f)]
    dictionary = [p for f in schema if f.name not in PLAIN_FLOAT_COLUMNS for p in _leaf_paths(f)]
    return {"compression": COMPRESSION, "use_dictionary": dictionary, "use_byte_stream_split": plain}


def write_parquet(table: pa.Table, path: Path) -> int:
    """Write ``table`` sorted by index to ``path`` atomically, one row group at a time; return its size."""
    tmp = path.with_name(f".{path.name}.tmp")
    order = _order(table)
    step = rows_per_group(table)
    with pq.ParquetWriter(tmp, table.schema, **_writer_options(table.schema)) as writer:
        if table.num_rows == 0:
            writer.write_table(table)
        for start in range(0, table.num_rows, step):
            part = (table.slice(start, step) if order is None
                    else table.take(pa.array(order[start:start + step])))
            writer.write_table(part, row_group_size=step)
    # On disk before the rename: the step's report (fsynced) is what says the step is done, and must
    # never outlive a crash that the rows did not.
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path.stat().st_size
