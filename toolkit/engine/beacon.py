"""Node rank 0's beacon: a port it listens on for as long as its process lives, published beside its
master address (``toolkit/engine/nodes.py``). The other node ranks of the replica watch it from the
moment they read that address, through their engine's boot and after. Unanswered (node rank 0 gone,
whatever ended it: an error at boot, the OOM killer, a lost node), they stop their workers, so the
replica lives and dies as a whole.

The engine's own master port is no substitute: it listens only once the engine is up (a node rank 0
that fails at boot would leave the others waiting in ``torch.distributed``'s rendezvous for its 30
minutes), and it belongs to the engine's processes, not to node rank 0's."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

WATCH_S = 1.0
"""How often a watcher knocks."""
MISSES = 2
"""Knocks in a row without an answer that mean node rank 0 is gone."""
ALIVE = b"1"


class Beacon:
    """Listens on a free port of every interface and answers whatever knocks, from a thread of this
    process: a process it forked (the engine's) may hold a copy of the socket, but never answers, and
    closes its copy at once, so the port is refused as soon as this process is gone."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("", 0), backlog=64)
        self.port = int(self.sock.getsockname()[1])
        os.register_at_fork(after_in_child=self.close)
        threading.Thread(target=self._serve, daemon=True, name="beacon").start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            try:
                conn.sendall(ALIVE)
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def answers(addr: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether the beacon at ``addr:port`` answers within ``timeout_s``."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s) as s:
            return s.recv(len(ALIVE)) == ALIVE
    except OSError:
        return False


class Watch:
    """Knocks at node rank 0's beacon every ``every_s`` in a thread; once it has not answered ``misses``
    times in a row, :attr:`gone` is set and ``on_gone`` runs (in that thread)."""

    def __init__(self, addr: str, port: int, on_gone: Callable[[], None] = lambda: None,
                 every_s: float = WATCH_S, misses: int = MISSES) -> None:
        self.addr, self.port = addr, port
        self.gone = threading.Event()
        self._stop = threading.Event()
        self._on_gone, self._every_s, self._misses = on_gone, every_s, misses
        self._thread = threading.Thread(target=self._run, daemon=True, name="watch-node-rank-0")
        self._thread.start()

    def _run(self) -> None:
        misses = 0
        while not self._stop.wait(self._every_s):
            misses = 0 if answers(self.addr, self.port) else misses + 1
            if misses >= self._misses:
                logger.error("node rank 0 (beacon %s:%d) is gone", self.addr, self.port)
                self.gone.set()
                self._on_gone()
                return

    def stop(self) -> None:
        self._stop.set()
