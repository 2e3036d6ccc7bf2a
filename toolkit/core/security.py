"""ZeroMQ CURVE for a run: on a shared cluster anyone can reach the router's ports.

``launch`` generates two keypairs into ``<run dir>/keys`` (directory 0700, files 0600, so only the
user who owns the run can read them on the shared file system): the router's, and one client
keypair shared by the run's replicas, ranks and ``launch`` itself. The router's sockets are CURVE
servers, and a ZAP authenticator lets in only that client key: an outsider without it completes no
handshake, so it can neither submit, register nor read anything.

Who uses CURVE: the router when the config says so (``toolkit.config.curve_enabled``; a missing key is an
error), a client whenever the run dir holds keys (clients such as the ranks only know the run dir).
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from toolkit.core.errors import ToolkitError
from toolkit.core.rundir import RunDir

logger = logging.getLogger(__name__)

ROUTER_CERT = "router"
CLIENT_CERT = "client"
# The bearer token the ranks' HTTP gateways admit (agents over HTTP; see toolkit/gateway/server.py).
GATEWAY_TOKEN = "gateway.token"


class KeysMissing(ToolkitError):
    """CURVE is on but the run dir has no keys (``launch`` writes them before starting anything)."""


def keys_dir(run_dir: Path) -> Path:
    return RunDir(Path(run_dir)).keys


def _write_cert(path: Path, public: bytes, secret: bytes | None) -> None:
    # zmq.auth's certificate format (load_certificate reads it), created 0600 from the start: a
    # chmod after writing would leave a window in which the secret is readable.
    lines = ["#   ZeroMQ CURVE certificate of a rollout-toolkit run; keep the secret file private",
             "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


def generate_keys(run_dir: Path) -> Path:
    """Create the run's router and client keypairs (idempotent: existing keys are kept, so a
    restarted router and every client keep agreeing). Returns the keys directory."""
    d = keys_dir(run_dir)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for name in (ROUTER_CERT, CLIENT_CERT):
        if (d / f"{name}.key_secret").exists():
            continue
        public, secret = zmq.curve_keypair()
        _write_cert(d / f"{name}.key", public, None)
        _write_cert(d / f"{name}.key_secret", public, secret)
    if not (d / GATEWAY_TOKEN).exists():
        fd = os.open(d / GATEWAY_TOKEN, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    logger.info("CURVE keys in %s", d)
    return d


def gateway_token(run_dir: Path) -> str | None:
    """The token the run's gateways admit (``Authorization: Bearer`` or ``x-api-key``); None when the
    run does not use CURVE (then the gateways, like the router, admit anyone on their address)."""
    path = keys_dir(run_dir) / GATEWAY_TOKEN
    return path.read_text().strip() if path.exists() else None


@dataclass(frozen=True)
class ClientCurve:
    """Client side: the run's client keypair and the router's public key."""

    public: bytes
    secret: bytes
    server_public: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_serverkey = self.server_public


def client_curve(run_dir: Path) -> ClientCurve | None:
    """The client keys of a run, or None if the run does not use CURVE (no keys in its run dir)."""
    d = keys_dir(run_dir)
    if not (d / f"{CLIENT_CERT}.key_secret").exists():
        return None
    public, secret = zmq.auth.load_certificate(d / f"{CLIENT_CERT}.key_secret")
    server_public, _ = zmq.auth.load_certificate(d / f"{ROUTER_CERT}.key")
    assert secret is not None
    return ClientCurve(public, secret, server_public)


class _AllowKeys:
    """ZAP credentials provider: exactly the run's client public key(s)."""

    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.allowed
        if not ok:
            logger.warning("refused a CURVE connection with an unknown client key")
        return ok


class ServerCurve:
    """Server side: the router's keypair plus a ZAP authenticator (a thread of the router process)
    that admits only the run's client key. ``close()`` stops the authenticator."""

    def __init__(self, ctx: zmq.Context, run_dir: Path) -> None:
        d = keys_dir(run_dir)
        try:
            self.public, secret = zmq.auth.load_certificate(d / f"{ROUTER_CERT}.key_secret")
            client_public, _ = zmq.auth.load_certificate(d / f"{CLIENT_CERT}.key")
        except OSError as exc:
            raise KeysMissing(f"router.curve is on but the run's keys are missing in {d}: {exc}") from exc
        assert secret is not None
        self.secret = secret
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve_callback("*", credentials_provider=_AllowKeys({client_public}))

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret

    def close(self) -> None:
        self.auth.stop()


def server_curve(enabled: bool, ctx: zmq.Context, run_dir: Path) -> ServerCurve | None:
    """The router's CURVE side when ``enabled`` (the config's ``curve_enabled``)."""
    return ServerCurve(ctx, run_dir) if enabled else None
