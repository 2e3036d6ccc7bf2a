"""A real ``Router`` in a thread of the test process, and fake replicas on loopback DEALER sockets: the
exact messages a replica gets (unit tier: no process is started); or a ``Router`` driven call by call
in the test's thread, its messages recorded (``router_in_process``)."""

from __future__ import annotations

import threading
from pathlib import Path

import zmq

from toolkit.client import router_status
from toolkit.config import Config
from toolkit.core import protocol as P
from toolkit.core.rundir import RunDir
from toolkit.router.links import Links
from toolkit.router.replica import Replica
from toolkit.router.server import Router


class RouterThread:
    def __init__(self, cfg: Config, root: Path) -> None:
        rd = RunDir(root)
        rd.make()
        self.ctx = zmq.Context()
        self.router = Router(cfg, rd, self.ctx)
        info = self.router.bind("127.0.0.1")
        self.frontend, self.backend = info["frontend"], info["backend"]
        self._stop = threading.Event()
        # The router's sockets are used only by this thread from here on (thread start is a barrier).
        self.thread = threading.Thread(target=self.router.run, args=(self._stop.is_set,), daemon=True)
        self.thread.start()

    def socket(self, routing_id: str | None = None) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            s.setsockopt(zmq.ROUTING_ID, routing_id.encode())
        s.connect(self.backend if routing_id is not None else self.frontend)
        return s

    def close(self) -> None:
        self._stop.set()
        self.thread.join(10)
        self.router.close()


def recv(sock: zmq.Socket, timeout_s: float = 10.0) -> P.Message:
    assert sock.poll(int(timeout_s * 1000)), "no message"
    frames = sock.recv_multipart()
    return P.decode(frames[0], frames[1])


def quiet(sock: zmq.Socket, timeout_s: float = 0.3) -> bool:
    """Nothing arrives within ``timeout_s`` (for 'no second message' checks; no duration asserted)."""
    return not sock.poll(int(timeout_s * 1000))


class FakeReplica:
    def __init__(self, rt: RouterThread, name: str, max_inflight: int = 4, streams: str = "",
                 stream_ranks: int = 1) -> None:
        self.replica_id = f"{name}@testhost:1"
        self.sock = rt.socket(self.replica_id)
        self.register = P.Register(self.replica_id, name.rsplit("-", 1)[0], max_inflight=max_inflight,
                                   streams=streams, stream_ranks=stream_ranks)
        self.send(self.register)

    def send(self, msg: P.Message) -> None:
        self.sock.send_multipart(P.encode(msg))

    def recv(self) -> P.Message:
        return recv(self.sock)

    def become_ready(self) -> None:
        probe = self.recv()
        assert isinstance(probe, P.Generate) and probe.job == "__probe__"
        self.send(P.Result(probe.request_id, output_token_ids=[7], replica_id=self.replica_id))

    def close(self) -> None:
        self.sock.close(0)


def status(rt: RouterThread, group: str = "throughput") -> P.GroupStatus:
    st = router_status(rt.frontend, 5.0, ctx=rt.ctx)
    assert st is not None
    return st.groups[group]


class RecordingLinks(Links):
    """A router's links that keep what it sends (to replicas: decoded) instead of sending it."""

    def __init__(self) -> None:
        self.to_replicas: list[tuple[bytes, P.Message]] = []
        self.to_clients: list[tuple[bytes, tuple[bytes, ...]]] = []

    def to_replica(self, ident: bytes, *frames: bytes) -> None:
        self.to_replicas.append((ident, P.decode(frames[0], frames[1])))

    def to_client(self, ident: bytes, *frames: bytes) -> None:
        self.to_clients.append((ident, frames))


def router_in_process(root: Path, overrides: list[str]) -> tuple[Router, RecordingLinks]:
    """A ``Router`` driven by the test's calls (``submit``, ``on_backend``, ``dispatch``): no thread, no socket."""
    from toolkit.config import compose_config
    from toolkit.launch.validation import validate

    cfg = compose_config(overrides)
    validate(cfg)
    rd = RunDir(root)
    rd.make()
    links = RecordingLinks()
    return Router(cfg, rd, links=links), links


def ready_replica(router: Router, rid: str, group: str, slots: int, block_size: int = 4, capacity: int = 1000,
                  max_model_len: int = 100_000) -> Replica:
    """A registered replica of ``router`` in dispatch, reporting KV events of ``block_size`` and a cache of
    ``capacity`` tokens."""
    ident = rid.encode()
    router.membership.register(ident, P.Register(rid, group, {}, "m", slots, max_model_len, 1000,
                                                 kv_block_size=block_size, kv_capacity_tokens=capacity))
    r = router.pool.known(ident)
    assert r is not None
    router.pool.set_ready(r)
    router.membership.heartbeat(ident, P.Heartbeat(rid))
    return r


def submit(router: Router, rid: str, tokens: list[int], session: str = "", job: str = "j", max_tokens: int = 10,
           group: str | None = None, lora: str | None = None) -> None:
    msg = P.Generate(rid, job=job, session_id=session, prompt_token_ids=tokens, sampling=P.Sampling(max_tokens=max_tokens),
                     group=group, lora=lora)
    router.submit(b"client", msg, P.encode(msg)[1])


def answer(router: Router, r: Replica, rid: str, out: list[int], status: str = "ok") -> None:
    router.on_backend(r.identity, *P.encode(P.Result(rid, status=status, output_token_ids=out, replica_id=r.replica_id)))
