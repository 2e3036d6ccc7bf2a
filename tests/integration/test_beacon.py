"""Node rank 0's beacon (``toolkit/engine/beacon.py``) in a real process: the other node ranks' watch
sees it gone when that process is killed, even while a process it forked (as the engine's are) lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from toolkit.core.lifecycle import ProcessRef
from toolkit.engine.beacon import Watch, answers

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
        assert answers("127.0.0.1", port)
        gone: list[bool] = []
        watch = Watch("127.0.0.1", port, lambda: gone.append(True), every_s=0.05)
        try:
            assert not watch.gone.wait(0.5)  # knocked ~10 times at a live beacon
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            assert watch.gone.wait(30) and gone == [True]
        finally:
            watch.stop()
        assert ProcessRef.of(child, "child").alive()  # the forked one lives on, its copy closed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if child:
            os.kill(child, signal.SIGKILL)  # reparented: whoever adopted it reaps it
