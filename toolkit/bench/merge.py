"""``python -m toolkit.bench merge``: rank 0's cost when it merges every session vs when ranks merge their own.

4 MPI ranks, 6,400 three-turn sessions. Arm ``central`` ships pickled per-turn records to rank 0,
which merges them all; arm ``distributed`` merges on each rank and gathers packed columns with
``Gatherv``. Both write the same Parquet file. It reports rank 0's CPU time and peak RSS per arm.
Workload, arms and fields: docs/benchmarks.md#merge.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from toolkit.cluster.local import find_mpiexec
from toolkit.core.protocol import Result
from toolkit.session.columns import ColumnBuilder, gather_columns, to_table, write_parquet
from toolkit.session.sample import Sample

RANKS = 4
SESSIONS_PER_RANK = 1600
QUICK_SESSIONS_PER_RANK = 32
TURNS = 3
PROMPT_LEN = (256, 768)
GEN_LEN = (256, 1024)
OBS_LEN = (64, 192)
VOCAB = 32000
GROUPS = ["tail", "throughput"]
SEED = 5

Record = dict[str, Any]


def session_records(index: int, job: str = "bench", step: int = 0) -> list[Record]:
    """One session's per-turn records, as the rank holds them after each turn (Python lists)."""
    rng = np.random.default_rng([SEED, index])
    prompt_len = int(rng.integers(PROMPT_LEN[0], PROMPT_LEN[1] + 1))
    gen = rng.integers(GEN_LEN[0], GEN_LEN[1] + 1, size=TURNS)
    obs = rng.integers(OBS_LEN[0], OBS_LEN[1] + 1, size=TURNS - 1).tolist() + [0]
    total = prompt_len + int(gen.sum()) + sum(obs)
    pool = rng.integers(1, VOCAB, size=total).tolist()
    logprobs = (-rng.exponential(0.7, size=int(gen.sum()))).tolist()
    sid = f"{job}/{step}/{index}"
    context = pool[:prompt_len]
    at, lp_at = prompt_len, 0
    records = []
    for t in range(TURNS):
        out = pool[at:at + gen[t]]
        at += int(gen[t])
        observation = pool[at:at + obs[t]]
        at += obs[t]
        records.append({
            "session_id": sid, "index": index, "turn": t, "prompt_token_ids": list(context),
            "output_token_ids": out, "logprobs": logprobs[lp_at:lp_at + gen[t]], "finish_reason": "stop",
            "observation": observation, "reward": 1.0 / TURNS, "replica_id": f"throughput-{index % 2}@bench",
            "group": GROUPS[(index + t) % 2], "cached_tokens": len(context) // 2, "weight_version": 0,
        })
        lp_at += int(gen[t])
        context = context + out + observation
    return records


def merge_records(records: list[Record]) -> Sample:
    """The merge both arms run: the same ``Sample`` code the rollout ranks use."""
    first = records[0]
    s = Sample.start(first["index"], first["session_id"], first["prompt_token_ids"])
    for r in records:
        res = Result(f"{r['session_id']}/{r['turn']}", "ok", r["output_token_ids"], r["logprobs"],
                     r["finish_reason"], r["replica_id"], r["group"], r["cached_tokens"], r["weight_version"])
        s.add_turn(r["prompt_token_ids"], res)
        s.reward += r["reward"]
        if r["observation"]:
            s.extend_observation(r["observation"])
    return s


def quiet_barrier(comm: Any, poll_s: float = 0.002) -> None:
    """A barrier that sleeps instead of spinning (blocking MPI waits busy-poll a core)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


def _gather_bytes(comm: Any, payload: bytes) -> list[memoryview] | None:
    """Every rank's bytes on rank 0: the transfer ``comm.gather`` does after pickling."""
    n = np.array([len(payload)], dtype=np.int64)
    counts = np.empty(comm.Get_size(), dtype=np.int64) if comm.Get_rank() == 0 else None
    comm.Gather(n, counts, root=0)
    if comm.Get_rank() != 0:
        comm.Gatherv(np.frombuffer(payload, dtype=np.uint8), None, root=0)
        return None
    assert counts is not None
    recv = np.empty(int(counts.sum()), dtype=np.uint8)
    comm.Gatherv(np.frombuffer(payload, dtype=np.uint8), (recv, counts), root=0)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return [memoryview(recv[offsets[i]:offsets[i + 1]]) for i in range(len(counts))]


def _write(cols: dict[str, np.ndarray], path: Path) -> tuple[int, int]:
    table = to_table(cols, GROUPS, [f"bench/0/{i}" for i in cols["index"].tolist()], sort=False)
    return write_parquet(table, path), table.nbytes


def rank_main(arm: str, sessions_per_rank: int, out: Path) -> None:
    # Importing mpi4py.MPI initialises MPI: only in the ranks mpiexec starts, never in the bench's driver.
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = range(rank, sessions_per_rank * size, size)
    gen_cpu = 0.0
    record_tokens = 0
    builder = ColumnBuilder(GROUPS)
    result: dict[str, Any] = {}
    wall0 = time.perf_counter()
    if arm == "central":
        records = [session_records(i) for i in mine]  # in hand before the clock starts
        record_tokens = sum(_record_tokens(recs) for recs in records)
        cpu0 = time.process_time()
        payload = pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL) if rank else b""
        if rank:
            del records
        quiet_barrier(comm)
        parts = _gather_bytes(comm, payload)
        del payload
        if rank == 0:
            assert parts is not None
            m0 = time.process_time()
            for src in range(size):
                batch = records if src == 0 else pickle.loads(parts[src])
                records = []
                for recs in batch:
                    builder.add(merge_records(recs))
                del batch
            result["merge_cpu_s"] = time.process_time() - m0
    else:
        cpu0 = time.process_time()
        for i in mine:
            g0 = time.process_time()
            recs = session_records(i)  # a turn's records arrive ...
            record_tokens += _record_tokens(recs)
            gen_cpu += time.process_time() - g0
            builder.add(merge_records(recs))  # ... and are merged on this rank at once
        result["merge_cpu_s"] = time.process_time() - cpu0 - gen_cpu
    cols = builder.columns()
    del builder
    merge_cpu = np.array([result.get("merge_cpu_s", 0.0), float(cols["tokens"].size), float(record_tokens)])
    if arm == "distributed":
        quiet_barrier(comm)
        gathered = gather_columns(comm, cols)
    else:
        gathered = cols if rank == 0 else None
    del cols  # rank 0's own rows are in the gathered arrays now
    per_rank = np.empty((size, 3), dtype=np.float64) if rank == 0 else None
    if rank == 0:
        assert gathered is not None
        path = out / "step.parquet"
        nbytes, arrow_bytes = _write(gathered, path)
        cpu = time.process_time() - cpu0 - gen_cpu
        result.update(rank0_cpu_s=cpu, rank0_peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      output_bytes=nbytes, output_arrow_bytes=arrow_bytes, rows=int(gathered["index"].size),
                      tokens_total=int(gathered["tokens"].size), wall_s=time.perf_counter() - wall0)
    quiet_barrier(comm)
    comm.Gather(merge_cpu, per_rank, root=0)
    if rank == 0:
        assert per_rank is not None
        result["merge_cpu_s_per_rank"] = per_rank[:, 0].tolist()
        result["merged_tokens_per_rank"] = per_rank[:, 1].astype(int).tolist()
        result["record_tokens_total"] = int(per_rank[:, 2].sum())
        (out / "result.json").write_text(json.dumps(result))


def _digest(path: Path) -> str:
    """A content hash of a step file, streamed one row group at a time."""
    h = hashlib.blake2b(digest_size=16)
    f = pq.ParquetFile(path)
    for i in range(f.num_row_groups):
        t = f.read_row_group(i, columns=["index", "tokens", "loss_mask", "rollout_logprobs", "reward", "status"])
        for col in t.columns:
            for chunk in col.chunks:
                for buf in chunk.buffers():
                    if buf is not None:
                        h.update(memoryview(buf))
    return h.hexdigest()


def _record_tokens(records: list[Record]) -> int:
    """Tokens in one session's per-turn records (whole-context prompts + outputs + observations)."""
    return sum(len(r["prompt_token_ids"]) + len(r["output_token_ids"]) + len(r["observation"]) for r in records)


def run_arm(arm: str, sessions_per_rank: int, work: Path, timeout_s: float = 1800) -> dict[str, Any]:
    out = work / arm
    out.mkdir(parents=True, exist_ok=True)
    cmd = [find_mpiexec(None), "-n", str(RANKS), sys.executable, "-m", "toolkit.bench.merge", "--arm", arm,
           "--sessions-per-rank", str(sessions_per_rank), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} arm failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    res = json.loads((out / "result.json").read_text())
    res["digest"] = _digest(out / "step.parquet")
    return res


def run(quick: bool = False) -> dict[str, Any]:
    per_rank = QUICK_SESSIONS_PER_RANK if quick else SESSIONS_PER_RANK
    with tempfile.TemporaryDirectory(prefix="merge-bench-") as tmp:
        central = run_arm("central", per_rank, Path(tmp))
        distributed = run_arm("distributed", per_rank, Path(tmp))
    sessions = per_rank * RANKS
    mb = 1 << 20
    output_mb = distributed["output_bytes"] / mb
    merge_cpu = sum(distributed["merge_cpu_s_per_rank"])
    return {
        "rank0_cpu_s_central": round(central["rank0_cpu_s"], 3),
        "rank0_cpu_s_distributed": round(distributed["rank0_cpu_s"], 3),
        "rank0_cpu_ratio": round(distributed["rank0_cpu_s"] / central["rank0_cpu_s"], 3),
        "rank0_peak_rss_mb_central": round(central["rank0_peak_rss_mb"], 1),
        "rank0_peak_rss_mb_distributed": round(distributed["rank0_peak_rss_mb"], 1),
        "output_mb": round(output_mb, 1),
        "merge_tokens_per_s": round(distributed["tokens_total"] / merge_cpu, 1) if merge_cpu > 0 else None,
        "rss_target_mb": round(2.5 * output_mb + 300, 1),
        "output_arrow_mb": round(distributed["output_arrow_bytes"] / mb, 1),
        "outputs_identical": central["digest"] == distributed["digest"],
        "ranks": RANKS,
        "sessions": sessions,
        "turns": TURNS,
        "tokens_total": distributed["tokens_total"],
        "record_tokens_total": distributed["record_tokens_total"],
        "rank0_merge_cpu_s_central": round(central["merge_cpu_s"], 3),
        "rank0_merge_cpu_s_distributed": round(distributed["merge_cpu_s"], 3),
        "wall_s_central": round(central["wall_s"], 3),
        "wall_s_distributed": round(distributed["wall_s"], 3),
        "quick": quick,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One rank of the merge benchmark (started by run()).")
    parser.add_argument("--arm", choices=["central", "distributed"], required=True)
    parser.add_argument("--sessions-per-rank", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rank_main(args.arm, args.sessions_per_rank, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
