"""ZeroMQ CURVE: a real router process and real sim replica processes with the run's keys; outsiders
(no keys, or keys of their own) get nothing from the router and change nothing in it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import zmq

from tests.helpers.procs import wait_for
from toolkit.client import RouterClient, router_status
from toolkit.core import protocol as P
from toolkit.core.errors import RouterRefused
from toolkit.core.rundir import RunDir, read_json
from toolkit.core.security import ClientCurve, client_curve, generate_keys, keys_dir
from toolkit.core.sockets import make_socket

FAST = ["engine.time_scale=0.05", "router.heartbeat_s=0.2", "router.curve=true", "groups=single"]


def _ask(address: str, msg: P.Message, curve: ClientCurve | None, timeout_s: float = 1.0) -> list[bytes] | None:
    """Send one message on a fresh DEALER; the reply frames, or None if nothing came back."""
    ctx = zmq.Context.instance()
    s = make_socket(ctx, zmq.DEALER, curve=curve)
    s.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        s.connect(address)
        try:
            s.send_multipart(P.encode(msg))
        except zmq.Again:
            # Not even queued: nothing reached the router. A DEALER refused by the router's handshake can be
            # left with no peer: CI at 0892ab1 blocked here 300 s, and a loop here blocked once in about 300
            # tries, on a send right after the connect. libzmq ends a session whose handshake failed with a
            # protocol error without reconnecting (session_base_t::engine_error), which would explain it.
            return None
        return s.recv_multipart() if s.poll(int(timeout_s * 1000)) else None
    finally:
        s.close(0)


def _outsider_key(run: Path) -> ClientCurve:
    """An attacker who knows the router's public key but has a keypair of its own."""
    mine = client_curve(run)
    assert mine is not None
    public, secret = zmq.curve_keypair()
    return ClientCurve(public, secret, mine.server_public)


def test_the_router_admits_only_the_runs_own_replicas_and_ranks(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run(FAST)
    generate_keys(rd.root)
    stack.start_router()
    stack.start_replica("throughput", 0)
    ours = client_curve(rd.root)
    address = read_json(rd.router_address)
    wait_for(lambda: (st := router_status(address["frontend"], 1.0, curve=ours)) is not None
             and st.groups["throughput"].ready == 1, 30, "the replica to be ready over CURVE")

    stranger = _outsider_key(rd.root)
    for curve in (None, stranger):
        # Clients: no status, no result, nothing queued.
        assert _ask(address["frontend"], P.StatusRequest(), curve) is None
        gen = P.Generate("evil", job="x", session_id="evil", step=0, prompt_token_ids=[1, 2, 3],
                         sampling=P.Sampling(max_tokens=4))
        assert _ask(address["frontend"], gen, curve) is None
        # Replicas: a fake one cannot register (it would be sent real requests).
        fake = P.Register(replica_id="fake", group="throughput", labels={"group": "throughput"}, model="m",
                          max_inflight=4, max_model_len=100, vocab_size=100)
        assert _ask(address["backend"], fake, curve) is None

    time.sleep(0.5)
    st = router_status(address["frontend"], 2.0, curve=ours)
    assert st is not None
    assert st.groups["throughput"].registered == 1 and st.queued == 0 and st.completed == 0
    assert "fake" not in (rd.logs / "router.log").read_text()
    assert "refused a CURVE connection" in (rd.logs / "router.log").read_text()

    async def one_request() -> P.Result:
        c = RouterClient(rd)  # a rank: picks the keys up from the run dir
        await c.connect(10)
        try:
            res, _ = await asyncio.wait_for(c.generate(P.Generate(
                "ok1", job="j", session_id="s", step=0, prompt_token_ids=[1, 2, 3],
                sampling=P.Sampling(max_tokens=8))), 30)
            return res
        finally:
            await c.close()

    res = asyncio.run(one_request())
    assert res.status == "ok" and res.output_token_ids
    st = router_status(address["frontend"], 2.0, curve=ours)
    assert st is not None and st.completed == 1

    # A rank whose run dir has keys the router refuses fails at once, saying why, instead of waiting.
    another_run = _rank_dir(rd.root, rd.root.parent / "another-run", keys=True)
    assert "handshakes in a row failed" in _refused_rank(another_run)
    stranger = _rank_dir(rd.root, rd.root.parent / "stranger", keys=True)
    # The router's own public key: only the client key is wrong.
    (keys_dir(stranger) / "router.key").write_bytes((keys_dir(rd.root) / "router.key").read_bytes())
    assert "did not admit this process's CURVE key" in _refused_rank(stranger)
    assert "has no keys" in _refused_rank(_rank_dir(rd.root, rd.root.parent / "no-keys", keys=False))


def _rank_dir(run: Path, other: Path, keys: bool) -> Path:
    """A run dir ``other`` that holds ``run``'s router address, and keys of its own if ``keys``."""
    other.mkdir()
    address = RunDir(run).router_address
    (other / address.relative_to(run)).write_bytes(address.read_bytes())
    if keys:
        generate_keys(other)
    return other


def _refused_rank(other: Path) -> str:
    """A rank in run dir ``other`` asks for a generation; the error it gets."""

    async def ask() -> str:
        c = RouterClient(RunDir(other))
        await c.connect(10)
        try:
            await asyncio.wait_for(c.generate(P.Generate("r", job="j", session_id="s", step=0, prompt_token_ids=[1],
                                                         sampling=P.Sampling(max_tokens=2))), 30)
        except RouterRefused as exc:
            with pytest.raises(RouterRefused):  # and so does every later call
                await c.step_begin("j", 0, 1)
            return str(exc)
        finally:
            await c.close()
        raise AssertionError("the router answered a refused rank")

    return asyncio.run(ask())


def test_without_curve_keys_nothing_changes_for_local_runs(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run(["engine.time_scale=0.05", "groups=single"])
    stack.start(timeout_s=30)  # plain sockets: the local default
    assert not keys_dir(rd.root).exists()
    assert router_status(stack.frontend, 2.0) is not None
