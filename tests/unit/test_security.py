"""CURVE keys: private and stable (the router admitting only its run's own, with real processes:
tests/integration/test_security.py)."""

from __future__ import annotations

import stat
from pathlib import Path

import zmq

from toolkit.core.security import client_curve, gateway_token, generate_keys
from toolkit.core.sockets import UNEXPLAINED_FAILURES, refusal


def test_keys_are_private_and_stable(tmp_path: Path) -> None:
    d = generate_keys(tmp_path)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    files = sorted(p.name for p in d.iterdir())
    assert files == ["client.key", "client.key_secret", "gateway.token", "router.key", "router.key_secret"]
    assert all(stat.S_IMODE((d / f).stat().st_mode) == 0o600 for f in files)
    first, token = client_curve(tmp_path), gateway_token(tmp_path)
    assert token is not None and len(token) >= 40
    generate_keys(tmp_path)  # a second call (e.g. a restarted launch step) keeps the keys
    assert client_curve(tmp_path) == first and gateway_token(tmp_path) == token
    assert gateway_token(tmp_path / "elsewhere") is None  # no CURVE: the gateways admit anyone on loopback
    assert client_curve(tmp_path / "elsewhere") is None


def test_a_refused_handshake_is_told_from_a_passing_failure() -> None:
    auth, proto, vague = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    why = refusal(auth, 400, 1, curve=True)
    assert why is not None and "not the ones the router was started with" in why
    mismatch = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    assert "router.curve=false" in (refusal(proto, mismatch, 1, curve=True) or "")
    assert "has no keys" in (refusal(proto, mismatch, 1, curve=False) or "")
    assert refusal(proto, zmq.PROTOCOL_ERROR_ZMTP_UNSPECIFIED, 1, curve=True) is None  # not a refusal
    # A router gone mid-handshake fails one with no reason given; a key it cannot read fails every one.
    assert all(refusal(vague, 32, n, curve=True) is None for n in range(1, UNEXPLAINED_FAILURES))
    assert "another run's keys" in (refusal(vague, 32, UNEXPLAINED_FAILURES, curve=True) or "")
    assert "has no keys" in (refusal(vague, 32, UNEXPLAINED_FAILURES, curve=False) or "")
