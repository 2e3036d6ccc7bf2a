"""A run dir holding step 0 as the ranks write it, in either output layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from toolkit.core.protocol import Result
from toolkit.core.rundir import RunDir
from toolkit.model.tokenizer import ByteTokenizer
from toolkit.rollout.shards import write_manifest, write_shard
from toolkit.session.columns import pack, to_table, write_parquet
from toolkit.session.sample import Sample

GROUPS = ["tail", "throughput"]
N = 11


def sample(i: int, decoded: bool = False) -> Sample:
    s = Sample.start(i, f"job/0/{i}", [40 + i, 41, 42])
    for t in range(1 + i % 3):
        s.add_turn(list(s.tokens), Result(f"{i}.{t}", output_token_ids=[50 + t] * (t + 2), logprobs=[-0.25] * (t + 2),
                                          replica_id=f"throughput-{t % 2}@h:1", group=GROUPS[t % 2], weight_version=t))
        s.extend_observation([60] * t)
    s.reward = i / 10
    s.started_step, s.carried, s.staleness = 0, i % 2, i % 3  # (read back: every field survives the file)
    if i == 4:
        s.mark("failed", "turn 1 of job/0/4: its prompt does not extend the accumulated tokens")
    if decoded:
        s.decode_response(ByteTokenizer())
    return s


class OneRankComm:
    """A stand-in for a size-1 communicator (the MPI versions run in test_gather_mpi)."""

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1

    def Gather(self, send: np.ndarray, recv: np.ndarray | None, root: int = 0) -> None:  # noqa: N802
        assert recv is not None
        recv.reshape(-1)[:] = send.reshape(-1)


def write_run(root: Path, layout: str, decoded: bool = False) -> RunDir:
    """A run dir holding step 0 the way the ranks write it (shards: as if from 3 ranks)."""
    rd = RunDir(root)
    rd.make()
    every = [sample(i, decoded) for i in range(N)]
    if layout == "gather":
        write_parquet(to_table(pack(every, GROUPS), GROUPS, [s.session_id for s in every], sort=False),
                      rd.step_parquet(0))
    else:
        info = []
        for rank in range(3):
            mine = every[rank::3]
            info.append(write_shard(rd, 0, rank, to_table(pack(mine, GROUPS), GROUPS, [s.session_id for s in mine])))
        write_manifest(rd, 0, np.array(info, dtype=np.int64))
    rd.step_report(0).write_text(json.dumps({"step": 0}))
    return rd
