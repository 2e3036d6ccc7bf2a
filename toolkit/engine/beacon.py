"""Node rank 0's beacon: a port it listens on for as long as its process lives, published beside its
master address (``toolkit/engine/nodes.py``). The other node ranks of the replica watch it from the
moment they read that address, through their engine's boot and after. Gone (node rank 0 ended,
whatever ended it: an error at boot, the OOM killer, a lost node), they stop their workers, so the
replica lives and dies as a whole.

A knock is a TCP connect and nothing more: the kernel completes it from the listening socket's
queue, whatever node rank 0's process is busy with (a C call holding the GIL for seconds, a loaded
CPU). A refused connect is certain (the process, and so its socket, is gone); a knock with no answer at
all (a lost node) counts only after ``LOST_S``.

The engine's own master port is no substitute: it listens only once the engine is up (a node rank 0
that fails at boot would leave the others waiting in ``torch.distributed``'s rendezvous for its 30
minutes), and it belongs to the engine's processes, not to node rank 0's."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

WATCH_S = 1.0
"""How often a watcher knocks."""
MISSES = 2
"""Knocks in a row refused that mean node rank 0 is gone."""
LOST_S = 30.0
"""How long knocks may go unanswered (no refusal: its node unreachable) before node rank 0 is gone."""


class Beacon:
    """Listens on a free port of every interface for as long as this process lives; a thread accepts
    (and closes) the knocks. A process it forks (the engine's) closes its copy of the socket at once, so
    the port is refused as soon as this process is gone."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("", 0), backlog=256)  # knocks queue there while this process is busy
        self.port = int(self.sock.getsockname()[1])
        os.register_at_fork(after_in_child=self._close_copy)
        threading.Thread(target=self._serve, daemon=True, name="beacon").start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()  # a knock needs nothing more: this only drains the queue
            except OSError:  # closed
                return
            conn.close()

    def close(self) -> None:
        """Stop listening: ``shutdown`` first, or the accepting thread would keep the socket listening."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._close_copy()

    def _close_copy(self) -> None:
        """A forked child's copy of the socket (never ``shutdown``: that would end the parent's too)."""
        try:
            self.sock.close()
        except OSError:
            pass


def knock(addr: str, port: int, timeout_s: float = 2.0) -> bool | None:
    """Whether the beacon at ``addr:port`` is there: True if the connect completes, False if it is
    refused (nothing listens: the process is gone), None if nothing answers within ``timeout_s``."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


class Watch:
    """Knocks at node rank 0's beacon every ``every_s`` in a thread; once refused ``misses`` times in a
    row, or unanswered for ``lost_s``, :attr:`gone` is set and ``on_gone`` runs (in that thread), and again
    every ``every_s`` until :meth:`stop`: what this node starts after (a worker spawned by a boot that
    went on) is stopped too."""

    def __init__(self, addr: str, port: int, on_gone: Callable[[], None] = lambda: None,
                 every_s: float = WATCH_S, misses: int = MISSES, lost_s: float = LOST_S) -> None:
        self.addr, self.port = addr, port
        self.gone = threading.Event()
        self._stop = threading.Event()
        self._on_gone, self._every_s, self._misses, self._lost_s = on_gone, every_s, misses, lost_s
        self._thread = threading.Thread(target=self._run, daemon=True, name="watch-node-rank-0")
        self._thread.start()

    def _run(self) -> None:
        refused = 0
        last_answer = time.monotonic()
        while not self._stop.wait(self._every_s):
            if self.gone.is_set():
                self._on_gone()
                continue
            there = knock(self.addr, self.port, timeout_s=min(2.0, self._lost_s))
            now = time.monotonic()
            if there:
                refused, last_answer = 0, now
                continue
            refused = refused + 1 if there is False else 0
            if refused >= self._misses or now - last_answer >= self._lost_s:
                logger.error("node rank 0 (beacon %s:%d) is gone: %s", self.addr, self.port,
                             f"refused {refused} times" if refused >= self._misses
                             else f"no answer for {now - last_answer:.0f}s")
                self.gone.set()
                self._on_gone()

    def stop(self) -> None:
        self._stop.set()
