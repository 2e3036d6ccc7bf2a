"""CURVE keys: private and stable (the router admitting only its run's own, with real processes:
tests/integration/test_security.py)."""

from __future__ import annotations

import stat
from pathlib import Path

from toolkit.core.security import client_curve, gateway_token, generate_keys


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
