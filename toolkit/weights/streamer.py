"""The trainer's side of streamed updates (``rollout.weights_transport=stream``): ``Streamer(run_dir).send``.

``send(version, named_tensors)`` encodes the tensors (dense, or deltas against the version every
replica holds: ``weights.delta``), announces the update to the run's router, which answers with the
chain (``StreamPlan``), sends the payload down the chain and returns once every replica of the plan
has applied it. A replica that missed a version (registered late, restarted, failed an apply) asks
for the current one through the router (``StreamWanted``); a thread of the streamer sends it a dense
copy of the last version that landed. Nothing is committed as the base of the next delta until an
update has landed, so a failed send leaves the trainer and every replica on the previous version.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgspec
import numpy as np

from toolkit.client import RouterClient
from toolkit.config import DeltaMode, WeightsTransport, load_run_config
from toolkit.core import protocol as P
from toolkit.core.errors import ConfigError, FieldError, RouterUnavailable, ToolkitError
from toolkit.core.rundir import RunDir
from toolkit.weights.transport import Link, LinkBroken, require_torch
from toolkit.weights.wire import Encoder, Update

logger = logging.getLogger(__name__)


class StreamFailed(ToolkitError):
    """A streamed update did not reach every replica of its plan: the message names the version and each
    replica that failed and why. The replicas that failed serve on their previous version (out of
    dispatch until they get the current one); the next ``send`` is dense to them."""


def as_bits(tensor: Any) -> tuple[np.ndarray, str]:
    """A tensor's elements as a numpy array of their width (no copy where possible) and torch's name of its
    dtype: torch tensors (any device; bfloat16 included) and numpy arrays."""
    if isinstance(tensor, np.ndarray):
        return tensor, tensor.dtype.name if tensor.dtype != np.bool_ else "bool"
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype != "bool":  # bfloat16 has no numpy dtype: its bits as ints of its width
        import torch  # the trainer's own: it gave a torch tensor

        t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t.numpy(), dtype


def _host(run_dir: RunDir, configured: str | None) -> str:
    """The address the rendezvous listens on: ``weights.host``, else loopback when the router's is (one
    host), else this node's."""
    if configured:
        return configured
    info = run_dir.wait_router_address(60.0)
    router = urlparse(info["frontend"].replace("tcp://", "http://")).hostname or ""
    if router.startswith("127.") or router in ("localhost", "::1"):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


class Streamer:
    """Streams the trainer's weights into every replica of the run in ``run_dir``. Use it from one
    thread (the trainer's); ``close`` it (or use it as a context manager) at the end."""

    def __init__(self, run_dir: str | Path, *, delta: bool | None = None, bucket_mb: float | None = None,
                 timeout_s: float | None = None, host: str | None = None, connect_timeout_s: float = 600.0) -> None:
        self.run_dir = RunDir(Path(run_dir))
        self.run_dir.wait_router_address(connect_timeout_s)
        cfg = load_run_config(self.run_dir.root)
        if cfg.rollout.weights_transport != WeightsTransport.stream:
            raise ConfigError([FieldError(
                "rollout.weights_transport", str(cfg.rollout.weights_transport),
                f"stream for a Streamer (the run in {run_dir}), or publish checkpoints with toolkit.weights.publish")])
        require_torch()  # here, not at the first send: the run would wait for that version meanwhile
        w = cfg.weights
        self.delta = w.delta == DeltaMode.auto if delta is None else delta
        self.timeout_s = timeout_s or w.timeout_s
        self.apply_timeout_s = w.apply_timeout_s
        self.host = _host(self.run_dir, host or w.host)
        self.encoder = Encoder(int((bucket_mb or w.bucket_mb) * 2**20))
        self._lock = threading.Lock()  # the encoder's committed state: the trainer's thread and catch-ups
        self._committed = threading.Condition(self._lock)
        self._sending_copy = False
        """A dense copy of the committed state is being sent: a commit must not recycle its arrays."""
        self.last: dict[str, Any] = {}
        """What the last ``send`` did: ``version``, ``update_s``, ``bytes``, ``dense_bytes``, ``delta``, ``replicas``."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="streamer-loop", daemon=True)
        self._thread.start()
        self.client = RouterClient(self.run_dir)
        self.client.on_stream_wanted = self._wanted
        self._run(self.client.connect(connect_timeout_s))
        self.caught_up: list[tuple[int, str]] = []
        """(version, replica id) of every dense copy sent to a replica that asked for one."""
        self._catch_ups: queue.Queue[P.StreamWanted | None] = queue.Queue()
        self._asked: set[str] = set()
        self._worker = threading.Thread(target=self._serve_catch_ups, name="streamer-catch-up", daemon=True)
        self._worker.start()

    def _run(self, coro: Any, timeout_s: float | None = None) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout_s)

    # ---- the trainer's call ----------------------------------------------------------------------------
    def send(self, version: int, named_tensors: Iterable[tuple[str, Any]], delta: bool | None = None) -> P.WeightsUpdated:
        """Stream ``named_tensors`` (``(name, tensor)`` pairs, the checkpoint's names; torch tensors or
        numpy arrays) into every replica as weights ``version``; returns the router's answer once every
        replica of the plan applied it. Raises StreamFailed (naming the replicas and the version) if
        any could not; the replicas that failed serve on their previous version meanwhile, out of
        dispatch until they hold this one. ``delta`` overrides ``weights.delta`` for this update."""
        if version < 1:
            raise ValueError(f"weights version {version}: streamed versions start at 1 (0 is the model's own weights)")
        t0 = time.monotonic()
        named = ((name, *as_bits(t)) for name, t in named_tensors)
        with self._committed:  # a dense copy being sent reads the committed state, never the spare one
            update = self.encoder.encode(version, named, self.delta if delta is None else delta)
        try:
            ack = self._stream(update)
            if ack is None:  # no replica holds the delta's base: the whole update dense
                update = self.encoder.dense(staged=True)
                ack = self._stream(update)
                if ack is None:
                    raise StreamFailed(f"weights version {version}: the router asked for it dense again")
        except BaseException:
            with self._committed:
                self.encoder.abandon()
            raise
        with self._committed:
            self.encoder.commit(recycle=not self._sending_copy)
            self._committed.notify_all()
        m = update.manifest
        self.last = {"version": version, "update_s": time.monotonic() - t0, "bytes": m.total,
                     "dense_bytes": m.dense_bytes, "delta": m.base >= 0, "replicas": ack.replicas}
        logger.info("weights version %d streamed to %d replica(s) in %.2fs (%s, %.1f MB of %.1f MB dense)", version,
                    ack.replicas, self.last["update_s"], "delta" if m.base >= 0 else "dense", m.total / 1e6,
                    m.dense_bytes / 1e6)
        return ack

    def _stream(self, update: Update, target: str = "") -> P.WeightsUpdated | None:
        """One update down one chain: None if the router asks for it dense."""
        m = update.manifest
        store, port = Link.rendezvous(self.host, None, self.timeout_s)
        try:
            msg = P.StreamWeights(m.version, msgspec.msgpack.encode(m), self.host, port, m.base, self.timeout_s, target)
            plan, answer = self._run(self.client.stream_weights(msg))
            deadline = time.monotonic() + self.timeout_s
            while plan.busy and time.monotonic() < deadline:  # every replica takes a dense copy: soon done
                self.client.forget_stream(m.version)
                time.sleep(0.2)
                plan, answer = self._run(self.client.stream_weights(msg))
            try:
                if plan.error:
                    raise StreamFailed(f"weights version {m.version}: {plan.error}")
                if plan.dense:
                    return None
                broken = ""
                if plan.world > 1:
                    try:
                        link = Link(self.host, port, 0, plan.world, self.timeout_s, store=store)
                        try:
                            link.send(m, update.pieces)
                        finally:
                            link.close()
                    except LinkBroken as exc:
                        broken = str(exc)
                if answer is None:  # a catch-up: the router forwards no answer
                    if broken:
                        raise StreamFailed(f"weights version {m.version} to {target}: {broken}")
                    return P.WeightsUpdated(m.version, replicas=1)
                try:
                    ack: P.WeightsUpdated = self._run(asyncio.wait_for(answer, self.apply_timeout_s))
                except TimeoutError:
                    raise StreamFailed(f"weights version {m.version}: the router did not answer within "
                                       f"weights.apply_timeout_s = {self.apply_timeout_s:g}s after the payload (replicas: "
                                       f"{', '.join(plan.replicas)}){'; ' + broken if broken else ''}") from None
                if ack.error or broken:
                    raise StreamFailed(f"weights version {m.version} (replicas {', '.join(plan.replicas)}): "
                                       + "; ".join(x for x in (ack.error, broken) if x))
                return ack
            finally:
                if answer is not None:
                    self.client.forget_stream(m.version)
        finally:
            del store  # the rendezvous' server socket closes with it

    # ---- replicas that missed a version ------------------------------------------------------------------
    def _wanted(self, msg: P.StreamWanted) -> None:
        """On the client's loop: queue a dense copy for that replica (once until it is sent)."""
        if msg.replica_id not in self._asked:
            self._asked.add(msg.replica_id)
            self._catch_ups.put(msg)

    def _serve_catch_ups(self) -> None:
        while (msg := self._catch_ups.get()) is not None:
            try:
                with self._committed:
                    # The router asks once an update landed; the trainer's thread commits it just after.
                    self._committed.wait_for(lambda: self.encoder.version is not None
                                             and self.encoder.version >= msg.version, 30.0)
                    if self.encoder.version is None:
                        continue
                    update = self.encoder.dense()
                    self._sending_copy = True
                try:
                    self._stream(update, target=msg.replica_id)
                finally:
                    with self._committed:
                        self._sending_copy = False
                self.caught_up.append((update.manifest.version, msg.replica_id))
                logger.info("weights version %d sent to %s (dense)", update.manifest.version, msg.replica_id)
            except (StreamFailed, RouterUnavailable, LinkBroken) as exc:
                logger.warning("a dense copy for %s failed (the router asks again): %s", msg.replica_id, exc)
            except Exception:
                logger.exception("a dense copy for %s failed", msg.replica_id)
            finally:
                self._loop.call_soon_threadsafe(self._asked.discard, msg.replica_id)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def close(self) -> None:
        self._catch_ups.put(None)
        try:
            self._run(self.client.close(), 30.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
            self._worker.join(10.0)

    def __enter__(self) -> Streamer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
