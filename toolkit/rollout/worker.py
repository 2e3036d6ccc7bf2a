"""A rollout rank: runs its share of each step's sessions against the router, merges them where they
ran, and gathers compact columns to rank 0, which writes ``steps/step_XXXXX.parquet`` and the step
report (``rollout.output=shards``: every rank writes its own shard, rank 0 a manifest, see
``toolkit/rollout/shards.py``). Started as ``mpiexec -n R python -m toolkit.rollout.worker RUN_DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import logging
import os
import sys
import time
import traceback
from typing import Any

import numpy as np
from hydra.utils import instantiate

from toolkit.client import RouterClient
from toolkit.config import CloseMode, Config, group_engine, samples_per_prompt
from toolkit.config.entry import enter_component
from toolkit.core.errors import RouterUnavailable
from toolkit.core.lifecycle import ProcessRef, quiet_gc
from toolkit.core.metrics import Endpoint
from toolkit.core.protocol import GroupStatus
from toolkit.core.rundir import RunDir, atomic_write
from toolkit.core.sockets import own_bind_host
from toolkit.gateway.chat import ChatTokenizer
from toolkit.gateway.server import Gateway, gateway_settings
from toolkit.model.tokenizer import chat_tokenizer_dir, load_tokenizer
from toolkit.rollout.close import CLOSERS, STEP_COUNTERS, Landed
from toolkit.rollout.coordination import TailWatch, async_barrier, async_bcast_ints
from toolkit.rollout.guard import (
    check_failure_budget,
    finite_reward,
    guarded,
    in_own_thread,
    maybe_await,
)
from toolkit.rollout.loopwatch import LoopWatch
from toolkit.rollout.metrics import RankMetrics
from toolkit.rollout.prompts import PromptSource
from toolkit.rollout.sessions import EnvSessions, rank_cap
from toolkit.rollout.shards import gather_shard_info, write_manifest, write_shard
from toolkit.rollout.stepreport import closing_report, step_report, write_step_report
from toolkit.rollout.stepweights import StepWeights
from toolkit.session.columns import (
    STAT_COLUMNS,
    Columns,
    gather_columns,
    to_table,
    write_parquet,
)
from toolkit.session.requests import RequestLog
from toolkit.session.sample import Sample, session_id

logger = logging.getLogger(__name__)


class RankRunner:
    def __init__(self, cfg: Config, run_dir: RunDir, comm: Any, first_step: int = 0) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.comm = comm
        self.first_step = first_step
        """Where launch starts this run (a resumed run: the first step without a step report)."""
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.group_names = sorted(cfg.groups)
        self.max_model_len = min(group_engine(cfg, g).max_model_len for g in cfg.groups)
        self.prompts: PromptSource = instantiate(cfg.workload.prompts)
        self.agent = instantiate(cfg.workload.agent, _partial_=True) if cfg.workload.agent else None
        self.agent_is_async = inspect.iscoroutinefunction(getattr(self.agent, "func", self.agent))
        self.gateway: Any = None
        self.watch: LoopWatch | None = None
        self.tail = TailWatch(run_dir, cfg.job, cfg.tail.threshold is not None)
        self.client = RouterClient(run_dir)
        # Responses stay token ids unless asked: decoding is the costliest thing a rank could do per token.
        self.tokenizer = (load_tokenizer(cfg.workload.tokenizer)
                          if cfg.rollout.decode_responses and self.agent is None else None)
        self.weights = StepWeights(cfg.rollout, self.client, run_dir.stop_request.exists)  # rank 0's
        self.metrics = RankMetrics() if cfg.report.metrics else None
        self.sem: asyncio.Semaphore | None = None
        self.closer = CLOSERS[cfg.rollout.close](
            cfg, self.rank, self.size, samples_per_prompt(cfg), self._run_session, self.group_names,
            lambda: RequestLog(self.metrics.request if self.metrics is not None else None), first_step,
            lambda step, sid: self.client.session_done(cfg.job, step, sid))
        self.env_sessions = (EnvSessions(cfg, self.client, self.prompts, self.max_model_len, lambda: self.closer.open)
                             if self.agent is None else None)

    async def run(self) -> None:
        await self.client.connect(self.cfg.cluster.ready_timeout_s)
        endpoint = None
        if self.metrics is not None:
            endpoint = Endpoint(self.metrics.registry, own_bind_host(self.cfg.router.host, self.cfg.cluster.type),
                                self.run_dir, f"rank-{self.rank}", {"rank": str(self.rank)})
        self.sem = asyncio.Semaphore(rank_cap(self.cfg, self.rank, self.size))
        try:
            if self.agent is not None:
                await self._start_gateway()
            self.closer.resume(self._carried_into(self.first_step))
            quiet_gc()
            async with LoopWatch() as self.watch:
                for step in range(self.first_step, self.cfg.steps):
                    go, version = await self.begin_step(step)
                    if not go:
                        logger.info("launch asked to stop before step %d", step)
                        break
                    await self.run_step(step, version)
        finally:
            await self.closer.aclose()  # sessions carried past the run's last step
            if self.gateway is not None:
                await self.gateway.close()
            await self.client.close()
            if endpoint is not None:
                endpoint.close()

    async def _start_gateway(self) -> None:
        cfg = self.cfg
        chat = await asyncio.to_thread(ChatTokenizer, chat_tokenizer_dir(cfg))
        settings = gateway_settings(cfg, self.run_dir, self.rank, self.max_model_len)
        self.gateway = Gateway(settings, chat, self.client)
        url = await self.gateway.start()
        if cfg.rollout.decode_responses:
            self.tokenizer = chat
        # The SDKs read their key from the environment: harnesses run unchanged, and get in. A user's
        # own keys (for a judge that calls the real API) stay in TOOLKIT_USER_<VAR>.
        for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
            if var in os.environ:
                os.environ.setdefault(f"TOOLKIT_USER_{var}", os.environ[var])
            os.environ[var] = settings.token or "toolkit"
        atomic_write(self.run_dir.gateway_address(self.rank),
                     json.dumps({"url": url, "rank": self.rank, "pid": os.getpid()}))

    async def begin_step(self, step: int) -> tuple[bool, int]:
        """Rank 0 decides for every rank: stop (launch asked, before a time limit) or begin ``step``:
        weights first, then StepBegin; the other ranks start once it has been sent, with the weights
        version the step runs with (what a group that lands in it is judged against)."""
        cfg = self.cfg
        go, version = True, 0
        if self.rank == 0:
            go = not self.run_dir.stop_request.exists() and await self.weights.before(step)
            if go:
                version = int(self.weights.steps[step]["version"])
                await self.client.step_begin(cfg.job, step, cfg.sessions_per_step)
        go_flag, version = await async_bcast_ints(self.comm, [int(go), version])
        return bool(go_flag), version

    def _carried_into(self, step: int) -> list[tuple[int, int, int]]:
        """This rank's share of the groups a resumed run restarts: what the step before ``step`` carried
        on (``close=count``), by its step report."""
        if step == 0 or self.cfg.rollout.close != CloseMode.count:
            return []
        path = self.run_dir.step_report(step - 1)
        groups = json.loads(path.read_text()).get("carried_groups", []) if path.exists() else []
        return [tuple(g) for i, g in enumerate(groups) if i % self.size == self.rank]

    async def run_step(self, step: int, version: int = 0) -> None:
        cfg = self.cfg
        t0 = time.time()
        if self.metrics is not None:
            self.metrics.begin(step, self.closer.sessions_to_close())
        done = asyncio.Event()
        follow = (asyncio.create_task(self.weights.follow(step, done), name="weights")
                  if self.rank == 0 and cfg.rollout.handshake else None)
        collect = asyncio.create_task(self.closer.collect(step, version), name=f"step {step}")
        try:
            if follow is not None:
                # A load that fails mid-step ends the run: at once, not once every session has ended.
                await asyncio.wait({collect, follow}, return_when=asyncio.FIRST_COMPLETED)
                if follow.done() and not follow.cancelled() and follow.exception() is not None:
                    collect.cancel()
                    await asyncio.gather(collect, return_exceptions=True)
                    await follow  # raises the load's error
            landed = await collect
        except BaseException:
            collect.cancel()
            if follow is not None:
                follow.cancel()  # the step failed: its error is the one to report, not a load's
            raise
        done.set()
        if follow is not None:
            await follow  # a load under way is finished: the report lists every version the rows hold
        cols = landed.builder.columns()  # in the order sessions landed; the step's files are written sorted
        shard: tuple[int, int] | None = None
        if cfg.rollout.output == "shards":
            # Each rank writes its own rows; only the per-session stats of the step report go to rank 0.
            table = to_table(cols, self.group_names, self._session_ids(cols), sort=False)
            shard = write_shard(self.run_dir, step, self.rank, table)
            cols = {name: cols[name] for name in STAT_COLUMNS}
        # Rank 0's sessions are done: the groups for the step's bound, while the other ranks finish
        # theirs (not counted in the step's wall time beyond what they take anyway).
        speeds = await self._group_status() if self.rank == 0 else None
        # Everyone is at the gather before it starts: blocking collectives spin a core while they
        # wait, and the cores belong to the engines and the router until the last session ends.
        await async_barrier(self.comm)
        with self.watch.held() if self.watch is not None else contextlib.nullcontext():
            gathered = gather_columns(self.comm, cols)
            del cols  # rank 0 holds its own rows twice otherwise while it writes the step
            requests = gather_columns(self.comm, landed.log.columns(self.group_names))
            closing = gather_columns(self.comm, _closing_columns(landed))
            shards = gather_shard_info(self.comm, *shard) if shard is not None else None
            if self.rank == 0:
                assert gathered is not None and requests is not None and closing is not None
                self._write_step(step, t0, gathered, requests, closing, shards, speeds)

    async def _group_status(self) -> dict[str, GroupStatus] | None:
        """Rank 0, for the step's bound: the router's groups at the step's end (the replicas serving;
        for engines with no time model, the speeds it learned from heartbeats). None if it is silent."""
        try:
            return (await self.client.status(timeout_s=5.0)).groups
        except RouterUnavailable as exc:
            logger.warning("no speeds for the step's bound: %s", exc)
            return None

    def _session_ids(self, cols: Columns) -> list[str]:
        return [session_id(self.cfg.job, s, i) + (f"#{b}" if b else "") for s, i, b in
                zip(cols["started_step"].tolist(), cols["index"].tolist(), cols["branch"].tolist(), strict=True)]

    def _write_step(self, step: int, t0: float, cols: Columns, requests: Columns, closing: Columns,
                    shards: np.ndarray | None = None, speeds: dict[str, GroupStatus] | None = None) -> None:
        cfg = self.cfg
        if shards is not None:
            write_manifest(self.run_dir, step, shards)
        else:
            table = to_table(cols, self.group_names, self._session_ids(cols), sort=False)
            write_parquet(table, self.run_dir.step_parquet(step))
        wall = time.time() - t0
        # Every session of the step has sent its SessionDone: a threshold flipped it, at most a moment ago.
        flip = self.tail.flip_of(step, wait_s=2.0) if cfg.tail.threshold is not None else None
        report = step_report(step, wall, t0, cols, requests, self.group_names, cfg, flip, speeds)
        # Launch's record of what interrupted this step: the resume that restarted it, replicas
        # added, removed or preempted while it ran.
        end = time.time()
        report["interruptions"] = [e for e in self.run_dir.read_events()
                                   if (e.get("step") == step and e.get("kind") == "resume")
                                   or t0 <= float(e.get("t", 0)) <= end]
        report["weights"] = self.weights.report(step)
        report.update(closing_report(closing, cfg.rollout.close))
        write_step_report(self.run_dir.step_report(step), report)
        check_failure_budget(step, cols, self.cfg.rollout.max_failed_fraction)

    async def _run_session(self, started: int, index: int, attempt: int) -> list[Sample]:
        """Session ``index`` of step ``started`` to its end (``attempt`` > 0: restarted)."""
        assert self.sem is not None
        run = self.agent_session if self.agent is not None else self.session
        async with self.sem:
            samples = await run(started, index, attempt)
        return self._done(samples)

    def _done(self, samples: list[Sample]) -> list[Sample]:
        if self.tokenizer is not None:
            for s in samples:
                try:
                    s.decode_response(self.tokenizer)
                except Exception as exc:  # noqa: BLE001 - a user's tokenizer, or ids it does not know
                    s.mark("failed", f"decoding the response raised {type(exc).__name__}: {exc}")
        self.closer.open.log.sessions_done_at.append(time.time())
        if self.metrics is not None and samples:
            self.metrics.session_done(samples[-1].status)  # the step report's outcome: the last row
        return samples  # its SessionDone goes to the router as it lands (the closer's)

    async def session(self, step: int, index: int, attempt: int = 0) -> list[Sample]:
        assert self.env_sessions is not None
        return await self.env_sessions.run(step, index, attempt)

    async def agent_session(self, step: int, index: int, attempt: int = 0) -> list[Sample]:
        """One session of an agent over HTTP: the agent runs against its own base URL on this rank's
        gateway; whatever it does, the session ends with its samples (then a SessionDone)."""
        cfg = self.cfg
        sid = session_id(cfg.job, step, index)
        key, sess = self.gateway.open_session(self.closer.open, index, sid, cfg.workload.record_messages,
                                                attempt, step)
        try:
            got, error = await guarded("agent", sid, self._agent(key, step, index), self.cfg.workload.env_timeout_s)
        finally:
            await self.gateway.close_session(key)
        reward = float(got) if got is not None else (sess.reward or 0.0)
        return sess.samples("failed" if error else "completed", error, reward)

    async def _agent(self, key: str, step: int, index: int) -> Any:
        task = dict(self.prompts.get(step, index).metadata)
        self.gateway.set_prompt_key(key, self.prompts.prompt_key(step, index))  # GRPO siblings share it
        url = self.gateway.base_url(key)
        # A synchronous agent (the sync SDKs) runs in a thread: in the loop it would block the gateway
        # it talks to. At a timeout it is abandoned (its calls then get 404).
        got = await (self.agent(url, task) if self.agent_is_async else in_own_thread(self.agent, url, task))
        # An async agent behind a plain decorator looks sync: its thread hands back the coroutine.
        got = await maybe_await(got)
        return None if got is None else finite_reward(got)  # a reward that is not a finite number fails the session


def _closing_columns(landed: Landed) -> Columns:
    return {"counts": np.array([landed.counts[k] for k in STEP_COUNTERS], dtype=np.int64),
            "in_flight": np.array(landed.in_flight, dtype=np.int64).reshape(-1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One rollout rank (start with mpiexec).")
    parser.add_argument("run_dir")
    parser.add_argument("--owner", default="", help="pid:starttime of the launching process")
    parser.add_argument("--first-step", type=int, default=0, help="the step to begin at (a resumed run)")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    owner = ProcessRef.from_arg(args.owner) if args.owner else None
    rd, cfg = enter_component(args.run_dir, f"rank-{comm.Get_rank()}", owner)
    if comm.Get_size() != cfg.ranks:
        # A launcher that did not wire MPI (e.g. srun --mpi=none) gives R worlds of size 1.
        print(f"error: MPI world has {comm.Get_size()} rank(s) but ranks={cfg.ranks} were asked for; "
              "is the launcher wired for MPI (mpiexec, srun --mpi=pmi2)?", file=sys.stderr)
        return 3
    try:
        asyncio.run(RankRunner(cfg, rd, comm, args.first_step).run())
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        # One rank failing must end the step on every rank, never leave the others in a collective.
        logger.error("rank %d failed: %s\n%s", comm.Get_rank(), exc, traceback.format_exc())
        print(f"rank {comm.Get_rank()} failed: {exc!r}", file=sys.stderr, flush=True)
        comm.Abort(1)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
