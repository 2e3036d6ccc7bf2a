"""Node rank 0's beacon (``toolkit/engine/beacon.py``) in a real process: the other node ranks' watch
sees it gone when that process is killed, even while a process it forked (as the engine's are) lives."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from toolkit.core.lifecycle import ProcessRef
from toolkit.engine.beacon import Watch, knock

NODE_RANK_0 = """
import os, sys, time
from toolkit.engine.beacon import Beacon
beacon = Beacon()
child = os.fork()
if child == 0:
    time.sleep(120)  # the engine's process: outlives its parent unless killed
    os._exit(0)
print(beacon.port, child, flush=True)
time.sleep(120)
"""


def test_the_watch_sees_node_rank_0_gone_though_a_child_it_forked_lives() -> None:
    proc = subprocess.Popen([sys.executable, "-c", NODE_RANK_0], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert proc.stdout is not None
        port, child = (int(v) for v in proc.stdout.readline().split())
        assert knock("127.0.0.1", port) is True
        gone: list[bool] = []
        watch = Watch("127.0.0.1", port, lambda: gone.append(True), every_s=0.05)
        try:
            assert not watch.gone.wait(0.5)  # knocked ~10 times at a live beacon
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            assert watch.gone.wait(30) and gone and all(gone)
            n = len(gone)
            time.sleep(0.5)  # and again, for what this node starts after (a worker of a boot that went on)
            assert len(gone) > n
        finally:
            watch.stop()
        assert ProcessRef.of(child, "child").alive()  # the forked one lives on, its copy closed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if child:
            os.kill(child, signal.SIGKILL)  # reparented: whoever adopted it reaps it


BUSY_NODE_RANK_0 = """
import ctypes, ctypes.util, sys, time
from toolkit.engine.beacon import Beacon
beacon = Beacon()
print(beacon.port, flush=True)
sys.stdin.readline()
# One C call that holds the GIL for 5 s (a PyDLL call never releases it): the beacon's thread never runs.
ctypes.PyDLL(ctypes.util.find_library("c")).sleep(5)
print("done", flush=True)
time.sleep(120)
"""


def test_a_node_rank_0_that_holds_the_gil_for_seconds_is_not_taken_for_gone() -> None:
    """A knock is answered by the kernel from the listening queue: node rank 0 busy in a C call (an
    import, a tokenizer) keeps its replica; a knock that waited for its thread would have ended it."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY_NODE_RANK_0], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        watch = Watch("127.0.0.1", port, every_s=0.05, misses=2)
        try:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "done"  # seconds of knocks while it was busy
            assert not watch.gone.is_set()
        finally:
            watch.stop()
    finally:
        proc.kill()
        proc.wait(30)


def test_knocks_that_nothing_answers_end_the_watch_only_after_lost_s() -> None:
    """A lost node refuses nothing: its knocks go unanswered (here: a listening queue that is full and
    never drained), and node rank 0 is gone only once ``lost_s`` has passed without an answer."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as full:
        port = full.getsockname()[1]
        for _ in range(16):  # each knock's connection stays queued, never accepted
            if knock("127.0.0.1", port, timeout_s=0.3) is None:
                break
        else:
            raise AssertionError("the listening queue never filled")
        watch = Watch("127.0.0.1", port, every_s=0.05, misses=2, lost_s=1.5)
        try:
            assert not watch.gone.wait(0.8)  # unanswered, not refused: not yet
            assert watch.gone.wait(30)
        finally:
            watch.stop()
