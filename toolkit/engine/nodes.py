"""The node ranks of one replica. A replica wider than a node (``cluster.gpus_per_node`` against its
tensor x pipeline parallel size) runs one process per node rank; they meet only through the master
address. Node rank 0 is the replica (``toolkit/engine/replica.py``: the engine, the router link,
restarts); every other node rank runs the backend's workers for it (vLLM: its headless multiprocessing
workers, ``toolkit/engine/vllm_workers.py``) and exits when node rank 0 is gone, so the replica lives
and dies as a whole: the router requeues its requests and launch replaces the job.

The cluster backends give each process its role: Slurm from ``srun``'s variables
(``toolkit.cluster.slurm.node_role``), locally from submitit's task rank with a master on loopback.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

from toolkit.config import ENGINES
from toolkit.config.entry import enter_component
from toolkit.core.lifecycle import ProcessRef, write_pidfile
from toolkit.core.names import process_name
from toolkit.core.rundir import RunDir, atomic_write, read_json
from toolkit.core.sockets import node_address, reserved_free_port
from toolkit.engine import replica
from toolkit.engine.beacon import Beacon, Watch
from toolkit.engine.node_role import NodeRole

logger = logging.getLogger(__name__)

EXIT_REPLICA_GONE = 75
"""A worker node rank whose replica's node rank 0 is gone (EX_TEMPFAIL: the job is replaced)."""


def serve_node(run_dir: str, group: str, index: int, role: NodeRole | None, owner: ProcessRef | None = None) -> None:
    """Entry point of one node rank of replica ``group``-``index`` (node rank 0, or a one-node replica:
    the replica itself)."""
    replica_name = process_name(group, index)
    beacon: Beacon | None = None
    if role is not None and role.rank == 0 and role.rendezvous and role.nnodes > 1:
        role, beacon = publish_master(role, RunDir(Path(run_dir)).node_master(replica_name, role.rendezvous))
    if role is not None:
        os.environ.update(role.env())
    if role is None or role.rank == 0:
        try:
            replica.serve(run_dir, group, index, owner)
        finally:
            if beacon is not None:
                beacon.close()
        return
    name = f"{replica_name}-node{role.rank}"
    rd, cfg = enter_component(run_dir, name, owner)
    watch: Watch | None = None
    if role.rendezvous and role.nnodes > 1:
        met = read_master(role, rd.node_master(replica_name, role.rendezvous), cfg.cluster.ready_timeout_s)
        if met is None:
            logger.error("node rank 0 of %s wrote no address in %.0fs (%s)", replica_name,
                         cfg.cluster.ready_timeout_s, rd.node_master(replica_name, role.rendezvous))
            sys.exit(EXIT_REPLICA_GONE)
        role = met
        os.environ.update(role.env())
        # From now on, through the engine's boot: node rank 0 gone, this node's workers are stopped.
        watch = Watch(role.master_addr, role.beacon_port, _stop_children)
    ecfg = replica.engine_config(cfg, group)
    logger.info("node rank %d of %d of replica %s-%d (master %s:%d)", role.rank, role.nnodes, group, index,
                role.master_addr, role.master_port)

    def record(pids: list[int]) -> None:
        for pid in pids:
            write_pidfile(rd.pidfile(f"{name}-worker", pid), ProcessRef.of(pid, f"{name}-worker"))

    marker = rd.replica_stopped(replica_name)
    started = time.time()
    gone = watch.gone if watch is not None else threading.Event()
    try:
        if gone.is_set():  # seen while this node rank was importing and building its config
            logger.error("node rank 0 of replica %s is gone before this node rank started: it ends with it",
                         replica_name)
            sys.exit(EXIT_REPLICA_GONE)
        if ENGINES.impl(ecfg.type).serve_node_rank(ecfg, role, record):
            if _stopped_after_drain(marker, started):
                logger.info("node rank 0 of replica %s stopped after its drain; this node rank too", replica_name)
                return
            logger.error("node rank 0 of replica %s is gone: this node rank ends with it", replica_name)
            sys.exit(EXIT_REPLICA_GONE)
        _hold(marker, group, index, gone)
    except (KeyboardInterrupt, SystemExit) as exc:
        if isinstance(exc, SystemExit) and exc.code == EXIT_REPLICA_GONE:
            raise
        logger.info("node rank %d of replica %s-%d stopping", role.rank, group, index)
    except Exception:
        if not gone.is_set():
            raise
        # Its workers stopped while they started (vLLM's executor raises): the replica ends as a whole.
        logger.error("node rank 0 of %s is gone while this node rank started: it ends with it", replica_name,
                     exc_info=True)
        sys.exit(EXIT_REPLICA_GONE)
    finally:
        if watch is not None:
            watch.stop()


def _stop_children() -> None:
    """This node's workers (the backend's processes, started with ``multiprocessing``), killed: a worker
    blocked in the engine's rendezvous or on its scheduler's queue heeds nothing else."""
    for child in multiprocessing.active_children():
        child.kill()


def publish_master(role: NodeRole, path: Path) -> tuple[NodeRole, Beacon]:
    """Node rank 0: its address, a port free on it now, and its beacon's port (the beacon listens until
    it is closed), written to ``path`` for the other node ranks. A port fixed in advance (derived from
    the job id, say) can be held by any process of the node by then, and the engine's rendezvous would
    fail to bind it, or reach a stranger. The engine binds it only once its workers start: the port is
    drawn outside the kernel's ephemeral range, which the node's other sockets come from meanwhile."""
    beacon = Beacon()
    addr = role.master_addr if role.one_host else node_address()
    role = dataclasses.replace(role, master_addr=addr, master_port=reserved_free_port(), beacon_port=beacon.port)
    atomic_write(path, json.dumps({"addr": role.master_addr, "port": role.master_port, "beacon": beacon.port}))
    return role, beacon


def read_master(role: NodeRole, path: Path, timeout_s: float, poll_s: float = 0.5) -> NodeRole | None:
    """Another node rank: ``role`` with the address and ports node rank 0 wrote to ``path``, once it has
    (None if it has not within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (info := read_json(path)) is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(poll_s)
    return dataclasses.replace(role, master_addr=str(info["addr"]), master_port=int(info["port"]),
                               beacon_port=int(info["beacon"]))


def _stopped_after_drain(marker: Path, since: float, wait_s: float = 10.0) -> bool:
    """Node rank 0 ended after a drain (its marker, newer than ``since``), not by a failure. It writes the
    marker once its engine has closed, a little after its workers (whose end this node rank saw) exit."""
    deadline = time.monotonic() + wait_s
    while True:
        if marker.exists() and marker.stat().st_mtime >= since - 1:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def _hold(marker: Path, group: str, index: int, gone: threading.Event) -> None:
    """A backend with nothing to run on the other nodes: hold the node until node rank 0 stops after a
    drain (a marker newer than this process: an index is reused when a group scales up again), is gone
    (``gone``), or SIGTERM."""
    started = time.time()
    logger.info("holding the node for replica %s-%d", group, index)
    while not (marker.exists() and marker.stat().st_mtime >= started - 1):
        if gone.wait(2.0) and not (marker.exists() and marker.stat().st_mtime >= started - 1):
            logger.error("node rank 0 of replica %s-%d is gone: releasing the node", group, index)
            sys.exit(EXIT_REPLICA_GONE)
    logger.info("node 0 of replica %s-%d stopped after its drain; releasing the node", group, index)
