"""A rollout rank: runs its share of each step's sessions against the router, merges them where they
ran, and gathers compact columns to rank 0, which writes ``steps/step_XXXXX.parquet`` and the step
report (``rollout.output=shards``: every rank writes its own shard, rank 0 a manifest, see
``toolkit/rollout/shards.py``). Started as ``mpiexec -n R python -m toolkit.rollout.worker RUN_DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
from hydra.utils import instantiate

from toolkit.client import RouterClient, weights_for_step
from toolkit.config import Config, group_engine, load_run_config
from toolkit.lifecycle import ProcessRef, exit_on_sigterm, setup_logging, watch_owner, write_pidfile
from toolkit.protocol import Generate, Sampling
from toolkit.rollout.columns import STAT_COLUMNS, Columns, gather_columns, pack, to_table, write_parquet
from toolkit.rollout.envs import Environment
from toolkit.rollout.prompts import PromptSource
from toolkit.rollout.sample import NonPrefixTurn, Sample
from toolkit.rollout.shards import gather_shard_info, write_manifest, write_shard
from toolkit.rollout.stepreport import RequestLog, step_report, write_step_report
from toolkit.rollout.tokenizer import load_tokenizer
from toolkit.rundir import RunDir, read_json

logger = logging.getLogger(__name__)

MAX_TURNS_HARD = 256


class TailWatch:
    """Reads the job's tail sentinel (at most every ``interval_s``) to tag new requests."""

    def __init__(self, run_dir: RunDir, job: str, group: str, enabled: bool, interval_s: float = 0.05) -> None:
        self.path = run_dir.sentinel(job)
        self.group = group
        self.enabled = enabled
        self.interval_s = interval_s
        self._checked = 0.0
        self._info: dict[str, Any] | None = None

    def info(self) -> dict[str, Any] | None:
        now = time.monotonic()
        if self.enabled and now - self._checked >= self.interval_s:
            self._checked = now
            self._info = read_json(self.path)
        return self._info

    def group_for(self, step: int) -> str | None:
        info = self.info()
        return self.group if info is not None and info.get("step") == step else None


async def async_barrier(comm: Any, poll_s: float = 0.005) -> None:
    """A barrier that waits on the event loop instead of spinning in MPI."""
    req = comm.Ibarrier()
    while not req.Test():
        await asyncio.sleep(poll_s)


class RankRunner:
    def __init__(self, cfg: Config, run_dir: RunDir, comm: Any) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.group_names = sorted(cfg.groups)
        self.max_model_len = min(group_engine(cfg, g).max_model_len for g in cfg.groups)
        self.prompts: PromptSource = instantiate(cfg.workload.prompts)
        self.env_factory = instantiate(cfg.workload.env, _partial_=True)
        self.sampling = Sampling(max_tokens=cfg.workload.max_tokens, temperature=cfg.workload.temperature,
                                 top_p=cfg.workload.top_p)
        self.tail = TailWatch(run_dir, cfg.job, cfg.tail.group, cfg.tail.threshold is not None)
        self.client = RouterClient(run_dir)
        # Responses stay token ids unless asked: decoding is the costliest thing a rank could do per token.
        self.tokenizer = load_tokenizer(cfg.workload.tokenizer) if cfg.rollout.decode_responses else None

    def _my_cap(self) -> int:
        cap = self.cfg.rollout.max_concurrent_rollouts
        if cap is None:
            return 1 << 30
        # Split the step-wide cap exactly across ranks.
        return max(1, cap // self.size + (1 if self.rank < cap % self.size else 0))

    async def run(self) -> None:
        await self.client.connect(self.cfg.cluster.ready_timeout_s)
        try:
            for step in range(self.cfg.steps):
                await self.run_step(step)
        finally:
            await self.client.close()

    async def run_step(self, step: int) -> None:
        cfg = self.cfg
        n = cfg.sessions_per_step
        if self.rank == 0:
            if (ckpt := weights_for_step(cfg.rollout.weights_dir, step)) is not None:
                await self.client.update_weights(str(ckpt), step)  # every replica, before the step's requests
            await self.client.step_begin(cfg.job, step, n)
        await async_barrier(self.comm)
        t0 = time.time()
        sem = asyncio.Semaphore(self._my_cap())
        log = RequestLog()
        mine = range(self.rank, n, self.size)
        samples = await asyncio.gather(*(self.session(step, i, sem, log) for i in mine))
        cols = pack(samples, self.group_names)
        del samples  # their Python lists take ~60 B per token, the packed columns 9 B
        shard: tuple[int, int] | None = None
        if cfg.rollout.output == "shards":
            # Each rank writes its own rows; only the per-session stats of the step report go to rank 0.
            table = to_table(cols, self.group_names, self._session_ids(step, cols), sort=False)
            shard = write_shard(self.run_dir.steps, step, self.rank, table)
            cols = {name: cols[name] for name in STAT_COLUMNS}
        # Everyone is at the gather before it starts: blocking collectives spin a core while they
        # wait, and the cores belong to the engines and the router until the last session ends.
        await async_barrier(self.comm)
        gathered = gather_columns(self.comm, cols)
        del cols  # rank 0 holds its own rows twice otherwise while it writes the step
        requests = gather_columns(self.comm, log.columns(self.group_names))
        shards = gather_shard_info(self.comm, *shard) if shard is not None else None
        if self.rank == 0:
            assert gathered is not None and requests is not None
            self._write_step(step, t0, gathered, requests, shards)

    def _session_ids(self, step: int, cols: Columns) -> list[str]:
        return [f"{self.cfg.job}/{step}/{i}" for i in cols["index"].tolist()]

    def _write_step(self, step: int, t0: float, cols: Columns, requests: Columns,
                    shards: np.ndarray | None = None) -> None:
        cfg = self.cfg
        if shards is not None:
            write_manifest(self.run_dir.steps, step, shards)
        else:
            table = to_table(cols, self.group_names, self._session_ids(step, cols), sort=False)
            write_parquet(table, self.run_dir.step_parquet(step))
        wall = time.time() - t0
        flip = self.tail.info() if cfg.tail.threshold is not None else None
        if flip is not None and flip.get("step") != step:
            flip = None
        report = step_report(step, wall, t0, cols, requests, self.group_names, cfg, flip)
        write_step_report(self.run_dir.step_report(step), report)

    async def session(self, step: int, index: int, sem: asyncio.Semaphore, log: RequestLog) -> Sample:
        cfg = self.cfg
        sid = f"{cfg.job}/{step}/{index}"
        async with sem:
            env: Environment = self.env_factory()
            context = env.reset(self.prompts.get(step, index))
            sample = Sample.start(index, sid, context)
            for turn in range(MAX_TURNS_HARD):
                budget = min(self.sampling.max_tokens, self.max_model_len - len(context))
                if budget < 1:
                    sample.mark("truncated", "context reached max_model_len")
                    break
                msg = Generate(
                    request_id=f"{sid}/{turn}", job=cfg.job, session_id=sid, step=step,
                    prompt_token_ids=context,
                    sampling=Sampling(budget, self.sampling.temperature, self.sampling.top_p),
                    group=self.tail.group_for(step),
                    deadline=time.time() + cfg.rollout.request_timeout_s,
                )
                sent = time.time()
                res, route = await self.client.generate(msg)
                log.add(res, route, len(context), sent, time.time())
                if res.status != "ok":
                    sample.mark("aborted" if res.status == "cancelled" else "failed", f"{res.status}: {res.error}")
                    break
                try:
                    sample.add_turn(context, res)
                except NonPrefixTurn as exc:
                    sample.mark("failed", str(exc))
                    break
                outcome = env.step(res.output_token_ids, res.finish_reason)
                sample.reward += outcome.reward
                if outcome.done:
                    break
                sample.extend_observation(outcome.observation)
                context = list(sample.tokens)
            else:
                sample.mark("truncated", f"more than {MAX_TURNS_HARD} turns")
            if self.tokenizer is not None:
                sample.decode_response(self.tokenizer)
        log.sessions_done_at.append(time.time())
        await self.client.session_done(cfg.job, step, sid)
        return sample


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One rollout rank (start with mpiexec).")
    parser.add_argument("run_dir")
    parser.add_argument("--owner", default="", help="pid:starttime of the launching process")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rd = RunDir(Path(args.run_dir))
    setup_logging(rd.logs / f"rank-{comm.Get_rank()}.log")
    exit_on_sigterm()
    write_pidfile(rd.pids, f"rank-{comm.Get_rank()}")
    if args.owner:
        pid, _, start = args.owner.partition(":")
        watch_owner(ProcessRef(int(pid), int(start) if start else None, "owner"))
    cfg = load_run_config(rd.root)
    if comm.Get_size() != cfg.ranks:
        # A launcher that did not wire MPI (e.g. srun --mpi=none) gives R worlds of size 1.
        print(f"error: MPI world has {comm.Get_size()} rank(s) but ranks={cfg.ranks} were asked for; "
              "is the launcher wired for MPI (mpiexec, srun --mpi=pmi2)?", file=sys.stderr)
        return 3
    try:
        asyncio.run(RankRunner(cfg, rd, comm).run())
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        # One rank failing must end the step on every rank, never leave the others in a collective.
        logger.error("rank %d failed:\n%s", comm.Get_rank(), traceback.format_exc())
        print(f"rank {comm.Get_rank()} failed: {exc!r}", file=sys.stderr, flush=True)
        comm.Abort(1)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
