"""``rollout.output=shards``: every rank writes its own Parquet shard; rank 0 writes only a manifest.

For steps too big for one node's memory or disk bandwidth: no sample crosses the network, rank 0
receives two integers per rank (rows, bytes) and the small per-session stats of the step report.

Layout under ``steps/``::

    step_XXXXX/shard_RRRRR.parquet   rank R's sessions, sorted by session index (same schema as gather)
    step_XXXXX/manifest.json         {"step", "layout": "shards", "rows", "bytes", "shards": [
                                       {"rank", "path" (relative to steps/), "rows", "bytes"}, ...]}
    step_XXXXX.json                  the step report, written last: the step is complete once it exists
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from toolkit.core.rundir import RunDir, atomic_write
from toolkit.session.columns import write_parquet

LAYOUT = "shards"


def write_shard(run_dir: RunDir, step: int, rank: int, table: pa.Table) -> tuple[int, int]:
    """Write this rank's rows; return (rows, bytes) for the manifest."""
    path = run_dir.step_shard(step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    return table.num_rows, write_parquet(table, path)


def gather_shard_info(comm: Any, rows: int, nbytes: int, root: int = 0) -> np.ndarray | None:
    """(size, 2) array of every rank's (rows, bytes) on ``root``: one buffer Gather, no pickling."""
    mine = np.array([rows, nbytes], dtype=np.int64)
    out = np.empty((comm.Get_size(), 2), dtype=np.int64) if comm.Get_rank() == root else None
    comm.Gather(mine, out, root=root)
    return out


def write_manifest(run_dir: RunDir, step: int, info: np.ndarray) -> dict[str, Any]:
    shards = [{"rank": r, "path": str(run_dir.step_shard(step, r).relative_to(run_dir.steps)), "rows": int(rows),
               "bytes": int(nbytes)} for r, (rows, nbytes) in enumerate(info.tolist())]
    manifest = {"step": step, "layout": LAYOUT, "rows": int(info[:, 0].sum()), "bytes": int(info[:, 1].sum()),
                "shards": shards}
    atomic_write(run_dir.step_manifest(step), json.dumps(manifest, indent=1))
    return manifest
