"""Weights between steps, the router's part: forward a checkpoint to every replica, answer once all have
loaded it, hand it to replicas that register later, and keep it across a router restart."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from toolkit.core import protocol as P
from toolkit.core.rundir import read_json
from toolkit.core.sockets import send_msg

if TYPE_CHECKING:
    from toolkit.router.policy import Replica

logger = logging.getLogger(__name__)


class WeightsMixin:
    """Part of :class:`toolkit.router.server.Router` (uses its sockets, replicas and run dir)."""

    # Provided by Router.
    frontend: Any
    backend: Any
    replicas: dict[bytes, Replica]
    run_dir: Any
    files: Any
    pool: Any
    enter_service: Any

    def init_weights(self) -> None:
        self.weights: P.UpdateWeights | None = self._adopt_weights()
        """The latest UpdateWeights, sent to every replica that registers (a restarted router's from
        ``weights.json``)."""
        self.weights_from_client = False
        """A client's update reached this router (until then a replica may hold newer weights than the
        recorded ones: its previous router forwarded them and died before recording them)."""
        self.serial_seen = 0
        """The highest serial a registering replica held: a client's next update is numbered above it (an
        update forwarded by a router that died before recording it keeps its number)."""
        self.good: P.UpdateWeights | None = None
        """The latest weights a replica acknowledged loading: the ones a replica must hold to serve."""
        self.weight_acks: dict[bytes, tuple[int, str]] = {}
        """Each replica's acknowledged (version, error), by socket identity."""
        self.weight_waiters: dict[tuple[str, int], set[bytes]] = {}
        """Clients waiting for a version, by (path, version)."""

    def update_weights(self, client: bytes, msg: P.UpdateWeights) -> None:
        """A client asks every replica to load a checkpoint; it is answered once every ready replica has.
        Clients resend until answered: a resend re-forwards to the replicas that have not acknowledged
        and re-counts (a replica dropped meanwhile is no longer waited for)."""
        key = (msg.path, msg.version)
        self.weights_from_client = True
        if self.weights is None or (self.weights.path, self.weights.version) != key:
            msg = P.UpdateWeights(msg.path, msg.version, max(self.weights.serial if self.weights else 0,
                                                             self.serial_seen) + 1)
            logger.info("weights %s as version %d: forwarding to %d replica(s)", msg.path, msg.version,
                        len(self.replicas))
            self.weights = msg
            self._record_weights(msg)
        elif self.files.error(self.run_dir.router_weights) is not None:
            self._record_weights(self.weights)  # a resend tries the failed write again
        self.weight_waiters.setdefault(key, set()).add(client)
        for r in self.replicas.values():
            # A draining replica generates nothing new: it is not asked, nor waited for.
            if not r.draining and self.loading_weights(r):
                self._push_weights(r)
        self._answer_weights()

    def _record_weights(self, msg: P.UpdateWeights) -> None:
        """Kept for a restarted router. Written off the loop, so the replicas get the update at once;
        the client is answered only once the file is on disk (a router restarted after the answer must
        not hand out older weights)."""
        self.files.write(self.run_dir.router_weights,
                         json.dumps({"path": msg.path, "version": msg.version, "serial": msg.serial}))

    def _adopt_weights(self) -> P.UpdateWeights | None:
        """The latest weights a previous router of this run handed out (a restarted router gives them
        to replicas that register with it, as the old one would have)."""
        info = read_json(self.run_dir.router_weights)
        return P.UpdateWeights(info["path"], int(info["version"]), int(info.get("serial", 0))) if info else None

    def held(self, r: Replica, msg: P.Register) -> None:
        """A registering replica says which checkpoint it holds. One handed out after what this router
        found in ``weights.json`` (a higher ``serial``), before any client's update reached it, is the
        run's latest: the previous router forwarded it and died before recording it. It becomes the
        run's weights, so the other replicas load it, rather than the recorded ones first and these on
        the trainer's resend (each a full reload, and a window of rows on older weights). One handed out
        before (a replica that missed a later update, a rollback's included) is told to load the run's."""
        # An earlier registration of this identity (a re-register before the sweep dropped it) acknowledged
        # nothing this replica still holds.
        self.weight_acks.pop(r.identity, None)
        if not msg.weights_path:
            return
        held = P.UpdateWeights(msg.weights_path, msg.weights_version, msg.weights_serial)
        self.serial_seen = max(self.serial_seen, held.serial)
        r.loaded = held.version
        self.weight_acks[r.identity] = (held.version, "")
        if not self.weights_from_client and (self.weights is None or held.serial > self.weights.serial):
            logger.info("replica %s holds weights version %d (%s), newer than the recorded ones: the run's now",
                        r.replica_id, held.version, held.path)
            self._record_weights(held)
            self.weights = held
            for other in self.replicas.values():
                if other is not r and not other.draining and self.loading_weights(other):
                    self._push_weights(other)
        if self.weights is not None and (self.weights.path, self.weights.version) == (held.path, held.version):
            self.good = self.weights

    def _push_weights(self, r: Replica) -> None:
        """Send the latest weights to ``r`` (a new replica gets them before its readiness probe)."""
        if self.weights is not None:
            send_msg(self.backend, r.identity, self.weights)

    def holds_current_weights(self, r: Replica) -> bool:
        """Whether ``r`` may serve: it loaded the run's weights, the latest a replica has loaded (or no
        replica has loaded any). One whose load failed where others' succeeded would serve older
        weights than the rest; if a load failed everywhere, the replicas serve on their last good ones."""
        return self.good is None or r.loaded == self.good.version

    def loading_weights(self, r: Replica) -> bool:
        """``r`` was handed the latest weights and has not answered yet (its engine may be paused)."""
        return self.weights is not None and self.weight_acks.get(r.identity, (None, ""))[0] != self.weights.version

    def weights_updated(self, ident: bytes, msg: P.WeightsUpdated) -> None:
        r = self.replicas.get(ident)
        if r is None:
            return
        if msg.error:
            logger.error("replica %s failed to load weights version %d: %s", r.replica_id, msg.version, msg.error)
        else:
            logger.info("replica %s has weights version %d", r.replica_id, msg.version)
            r.loaded = msg.version
            if self.weights is not None and msg.version == self.weights.version:
                self.good = self.weights
        self.weight_acks[ident] = (msg.version, msg.error)
        r.progress_at = time.monotonic()  # a load pauses generation: the stall clock starts after it
        r.weights_error = msg.error if not r.ready else ""
        if r.awaiting_weights and self.holds_current_weights(r):
            self.enter_service(r)
        self._answer_weights()

    def retry_weights(self, r: Replica, now: float) -> bool:
        """The sweep's part for a replica kept out of service by a failed load: hand it the run's
        weights again (a file system's hiccup passes; a checkpoint gone for good keeps it out, said each
        time)."""
        if not (r.awaiting_weights and r.weights_error and self.good is not None):
            return False
        logger.warning("replica %s stays out of service: it could not load weights version %d (%s); asking again",
                       r.replica_id, self.good.version, r.weights_error)
        r.probe_sent_at = now
        send_msg(self.backend, r.identity, self.good)
        return True

    def _answer_weights(self) -> None:
        """Answer the clients whose update every ready replica has acknowledged (or one failed), once
        ``weights.json`` is written; the sweep calls it again while an answer waits for the file."""
        for gone in [i for i in self.weight_acks if i not in self.replicas]:
            del self.weight_acks[gone]
        recorded = self.run_dir.router_weights
        if not self.weight_waiters or self.files.pending(recorded):
            return
        write_error = self.files.error(recorded)
        ready = [r for r in self.replicas.values() if r.serving]
        for key in list(self.weight_waiters):
            version = key[1]
            acks = [self.weight_acks.get(r.identity) for r in ready]
            errors = [f"{r.replica_id}: {a[1]}" for r, a in zip(ready, acks, strict=True)
                      if a is not None and a[0] == version and a[1]]
            done = sum(1 for a in acks if a is not None and a[0] == version and not a[1])
            if not errors and done < len(ready):
                continue
            if write_error is not None:
                errors.append(f"the router could not record the weights in {recorded} (a restarted router "
                              f"would hand out older ones; update again to retry): {write_error}")
            answer = P.WeightsUpdated(version, error="; ".join(errors), replicas=done)
            for client in self.weight_waiters.pop(key):
                send_msg(self.frontend, client, answer)
