"""Run under mpiexec: every rank packs different samples, rank 0 checks the gathered table."""

from __future__ import annotations

import sys

from mpi4py import MPI

from toolkit.protocol import Result
from toolkit.rollout.columns import gather_columns, pack, to_table
from toolkit.rollout.sample import Sample


def sample(i: int) -> Sample:
    s = Sample.start(i, f"s{i}", list(range(1, 2 + i % 7)))
    for t in range(i % 3 + 1):
        s.add_turn(list(s.tokens), Result(f"{i}.{t}", output_token_ids=[i + t] * (t + 1),
                                          logprobs=[-0.25] * (t + 1), group="tail"))
        s.extend_observation([9] * t)
    return s


def main() -> int:
    comm = MPI.COMM_WORLD
    n = int(sys.argv[1])
    mine = [sample(i) for i in range(comm.rank, n, comm.size)]
    cols = gather_columns(comm, pack(mine, ["tail"]))
    if comm.rank == 0:
        assert cols is not None
        rows = to_table(cols, ["tail"]).to_pylist()
        want = [sample(i) for i in range(n)]
        assert [r["index"] for r in rows] == list(range(n))
        for r, s in zip(rows, want, strict=True):
            assert r["tokens"] == s.tokens and r["loss_mask"] == s.loss_mask
            assert r["rollout_logprobs"] == s.rollout_logprobs
        print(f"OK size={comm.size} rows={len(rows)}", flush=True)
    else:
        assert cols is None
    return 0


if __name__ == "__main__":
    sys.exit(main())
