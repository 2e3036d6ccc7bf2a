"""How a step's ranks agree without talking through the router: the job's tail sentinel on the shared
file system, and MPI collectives awaited on the event loop (a rank keeps serving its sessions while
it waits)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from toolkit.core.rundir import RunDir, read_json


class TailWatch:
    """Reads the job's tail sentinel for the step report (where requests go is the router's alone)."""

    def __init__(self, run_dir: RunDir, job: str, enabled: bool) -> None:
        self.path = run_dir.sentinel(job)
        self.enabled = enabled

    def flip_of(self, step: int, wait_s: float) -> dict[str, Any] | None:
        """``step``'s flip as its sentinel records it, waited for up to ``wait_s``: the step's last
        SessionDone may have flipped it (``tail.threshold=1``) a moment before the router's file writer
        wrote the sentinel."""
        deadline = time.monotonic() + wait_s
        while True:
            info = read_json(self.path) if self.enabled else None
            if info is not None and info.get("step") == step:
                return info
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)


async def awaited(req: Any, poll_s: float = 0.005) -> None:
    """Wait for a non-blocking MPI request on the event loop (a blocking wait spins a core in MPI and
    stops the rank's sessions)."""
    while not req.Test():
        await asyncio.sleep(poll_s)


async def async_barrier(comm: Any) -> None:
    await awaited(comm.Ibarrier())


async def async_bcast_ints(comm: Any, values: list[int]) -> list[int]:
    """Rank 0's ``values`` on every rank (the other ranks' are ignored; as many on each)."""
    buf = np.array(values, dtype=np.int64)
    await awaited(comm.Ibcast(buf, root=0))
    return [int(v) for v in buf]
