"""Run under mpiexec: every rank packs different samples; rank 0 checks what it gathered.

``mpi_gather_script.py N`` gathers the columns (Gather + Gatherv) and checks the table;
``mpi_gather_script.py N shards DIR`` writes one shard per rank plus rank 0's manifest into
``DIR/steps`` and reads the step back through ``toolkit.samples``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from toolkit import samples as api
from toolkit.core.protocol import Result
from toolkit.core.rundir import RunDir
from toolkit.model.tokenizer import ByteTokenizer
from toolkit.rollout.shards import gather_shard_info, write_manifest, write_shard
from toolkit.session.columns import STAT_COLUMNS, gather_columns, pack, to_table
from toolkit.session.sample import Sample

GROUPS = ["tail", "throughput"]


def sample(i: int) -> Sample:
    s = Sample.start(i, f"s{i}", list(range(1, 2 + i % 7)))
    for t in range(i % 3 + 1):
        s.add_turn(list(s.tokens), Result(f"{i}.{t}", output_token_ids=[i + t] * (t + 1), logprobs=[-0.25] * (t + 1),
                                          replica_id=f"r{(i + t) % 4}", group=GROUPS[t % 2]))
        s.extend_observation([9] * t)
    if i % 2:
        s.decode_response(ByteTokenizer())  # odd samples carry text (with non-ASCII escapes), even ones not
    if i % 5 == 0:
        s.mark("failed", f"session {i}: é")
    return s


def check(rows: list[dict], n: int) -> None:
    want = [sample(i) for i in range(n)]
    assert [r["index"] for r in rows] == list(range(n))
    for r, s in zip(rows, want, strict=True):
        assert r["tokens"] == s.tokens and r["loss_mask"] == s.loss_mask
        assert r["rollout_logprobs"] == s.rollout_logprobs
        assert r["response"] == s.response and r["response_decoded"] == s.response_decoded
        assert r["metadata"] == s.metadata and r["error"] == s.error and r["status"] == s.status
        assert r["replicas"] == sorted(s.replicas) and sorted(r["groups"]) == sorted(s.groups)


def main() -> int:
    comm = MPI.COMM_WORLD
    n = int(sys.argv[1])
    mine = [sample(i) for i in range(comm.rank, n, comm.size)]
    cols = pack(mine, GROUPS)
    if len(sys.argv) > 2 and sys.argv[2] == "shards":
        rd = RunDir(Path(sys.argv[3]))
        rows, nbytes = write_shard(rd, 0, comm.rank, to_table(cols, GROUPS, [s.session_id for s in mine]))
        stats = gather_columns(comm, {k: cols[k] for k in STAT_COLUMNS})
        info = gather_shard_info(comm, rows, nbytes)
        if comm.rank == 0:
            assert stats is not None and info is not None
            assert sorted(stats["index"].tolist()) == list(range(n))
            write_manifest(rd, 0, info)
            rd.step_report(0).write_text(json.dumps({"step": 0}))
            manifest = json.loads((rd.steps / "step_00000" / "manifest.json").read_text())
            assert [s["rows"] for s in manifest["shards"]] == [len(range(r, n, comm.size)) for r in range(comm.size)]
            check(api.read_step(rd.root, 0).to_pylist(), n)
            print(f"OK shards size={comm.size} rows={manifest['rows']}", flush=True)
        return 0
    gathered = gather_columns(comm, cols)
    if comm.rank == 0:
        assert gathered is not None
        assert np.array_equal(np.sort(gathered["index"]), np.arange(n))
        check(to_table(gathered, GROUPS).to_pylist(), n)
        print(f"OK size={comm.size} rows={n}", flush=True)
    else:
        assert gathered is None
    return 0


if __name__ == "__main__":
    sys.exit(main())
