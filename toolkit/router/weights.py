"""Weights between steps, the router's part: forward a checkpoint to every replica, answer once all have
loaded it, hand it to replicas that register later, keep replicas that do not hold it out of service,
and keep it across a router restart (``weights.json``).

A streamed update (``StreamWeights``) goes the same way, with a plan first: the router names the chain
(every replica that holds the update's base; all of them for a dense one) and answers the trainer
with it, then forwards each replica its rank. A replica left out (it registered late, restarted, or
holds another version) or whose apply failed is out of dispatch until the trainer that streamed the
run's weights sends it the current version dense (``StreamWanted``)."""

from __future__ import annotations

import json
import logging
from typing import NamedTuple

from toolkit.core import clock
from toolkit.core import protocol as P
from toolkit.core.rundir import FileWriter, RunDir, read_json
from toolkit.router.pool import ReplicaPool
from toolkit.router.replica import Replica, Send

logger = logging.getLogger(__name__)


class Ack(NamedTuple):
    """A replica's answer to an UpdateWeights."""

    version: int
    error: str


class ReplicaWeights:
    """What one registered replica did with the run's weights."""

    __slots__ = ("ack", "loaded", "load_error", "awaiting", "streaming", "streaming_until")

    def __init__(self) -> None:
        self.ack: Ack | None = None
        """Its latest acknowledgement (a registration holding a checkpoint counts as one)."""
        self.loaded: int | None = None
        """The version it last loaded (None: none yet; it serves the model's own)."""
        self.load_error = ""
        """Why its last load failed, while it is out of service: it stays out until it holds the run's
        weights, asked again each ``router.probe_timeout_s``."""
        self.awaiting = False
        """Its probe passed before it held the run's weights: it serves once it acknowledges them."""
        self.streaming: int | None = None
        """The streamed version it was sent and has not answered yet."""
        self.streaming_until = 0.0
        """When an unanswered stream counts as lost (``clock.monotonic``): its link's timeout past the
        payload's, and as long again for the apply. Asked again before that, the replica, still taking
        it, would be put on a chain it cannot join, stalling every other peer for the link's timeout."""


class WeightSync:
    def __init__(self, run_dir: RunDir, files: FileWriter, pool: ReplicaPool, send_to_replica: Send,
                 send_to_client: Send) -> None:
        self.run_dir = run_dir
        self.files = files
        self.pool = pool
        self.send_to_replica = send_to_replica
        self.send_to_client = send_to_client
        self.latest: P.UpdateWeights | None = self._recorded()
        """The run's weights: the latest UpdateWeights, sent to every replica that registers (a restarted
        router's from ``weights.json``)."""
        self.client_updated = False
        """A client's update reached this router (until then a replica may hold newer weights than the
        recorded ones: its previous router forwarded them and died before recording them)."""
        self.highest_held_serial = 0
        """The highest serial a registering replica held: a client's next update is numbered above it (an
        update forwarded by a router that died before recording it keeps its number)."""
        self.required: P.UpdateWeights | None = None
        """The weights a replica must hold to serve: the latest a replica acknowledged loading (None: no
        replica loaded any, so every replica serves)."""
        self.waiting_clients: dict[tuple[str, int], set[bytes]] = {}
        """Clients waiting for a version, by (path, version)."""
        self.members: dict[int, list[Replica]] = {}
        """The replicas a version's answer waits for while they stay registered: a streamed version's plan,
        or the replicas serving when a checkpoint was forwarded (one whose engine dies loading it leaves
        service before its failed acknowledgement arrives: that failure is still the answer's)."""
        self.source: bytes | None = None
        """The client that streamed the run's weights: it sends a replica that lacks them a dense copy."""
        self.landed = self.latest.version if self.latest is not None and self.latest.path else -1
        """The latest version whose update every replica it went to has answered, or that a replica
        applied since (a dense copy to one that missed it), or, after a restart, that a replica
        registered holding (streamed weights: ``weights.json`` may name one no replica applied) (``Status``)."""
        self._replicas: dict[Replica, ReplicaWeights] = {}

    def _of(self, r: Replica) -> ReplicaWeights:
        w = self._replicas.get(r)
        if w is None:
            w = self._replicas[r] = ReplicaWeights()
        return w

    # ---- clients ---------------------------------------------------------------------------
    def update(self, client: bytes, msg: P.UpdateWeights) -> None:
        """A client asks every replica to load a checkpoint; it is answered once every ready replica has,
        and every one it was forwarded to that is still registered has answered (loaded or failed).
        Clients resend until answered: a resend re-forwards to the replicas that have not acknowledged
        and re-counts (a replica dropped meanwhile is no longer waited for)."""
        key = (msg.path, msg.version)
        self.client_updated = True
        if self.latest is None or (self.latest.path, self.latest.version) != key:
            msg = P.UpdateWeights(msg.path, msg.version, max(self.latest.serial if self.latest else 0,
                                                             self.highest_held_serial) + 1)
            logger.info("weights %s as version %d: forwarding to %d replica(s)", msg.path, msg.version,
                        len(self.pool.all()))
            self.latest = msg
            self._record(msg)
            self.members[msg.version] = [r for r in self.pool.all() if r.serving]
        elif self.files.error(self.run_dir.router_weights) is not None:
            self._record(self.latest)  # a resend tries the failed write again
        self.waiting_clients.setdefault(key, set()).add(client)
        for r in self.pool.all():
            # A draining replica generates nothing new: it is not asked, nor waited for.
            if not r.draining and self.is_loading(r):
                self.push(r)
        self.answer_clients()

    def stream(self, client: bytes, msg: P.StreamWeights) -> None:
        """A trainer streams ``msg.version``: plan the chain, answer the trainer with it, forward each
        replica its part. A delta goes to the replicas that hold its base (none: the trainer is told to
        send it dense); the others are out of dispatch until they get the version dense."""
        if msg.version < 1:
            self.send_to_client(client, P.StreamPlan(msg.version, error=(
                f"weights version {msg.version}: streamed versions start at 1 (0 is the model's own weights)")))
            return
        if msg.target:
            self._catch_up(client, msg)
            return
        everyone = [r for r in self.pool.all() if not r.draining]
        cannot = [r.replica_id for r in everyone if not r.streams]
        if cannot:
            self.send_to_client(client, P.StreamPlan(msg.version, error=(
                f"replica(s) {', '.join(cannot)} cannot take streamed weights (their engine has no stream "
                "transport): rollout.weights_transport=stream needs engine.type sim or vllm")))
            return
        free = [r for r in everyone if self._of(r).streaming is None]  # not taking another update now
        if everyone and not free:
            self.send_to_client(client, P.StreamPlan(msg.version, busy=True, error=(
                f"every replica ({', '.join(r.replica_id for r in everyone)}) is taking another update")))
            return
        held = [r for r in free if self._of(r).loaded == msg.version]  # a resend: they answered it already
        takers = [r for r in free if r not in held]
        chosen = takers if msg.base < 0 else [r for r in takers if self._of(r).loaded == msg.base]
        if everyone and not chosen and not held:
            self.send_to_client(client, P.StreamPlan(msg.version, dense=True))
            return
        self.source = client
        self.client_updated = True
        serial = max(self.latest.serial if self.latest else 0, self.highest_held_serial) + 1
        self.latest = P.UpdateWeights("", msg.version, serial)
        self._record(self.latest)
        plan = self._send_chain(msg, chosen, serial)
        logger.info("streamed weights version %d (%s): %d replica(s) on the chain, %d left for a dense copy",
                    msg.version, "delta" if msg.base >= 0 else "dense", len(chosen), len(everyone) - len(chosen))
        self.members[msg.version] = [*chosen, *held]
        self.send_to_client(client, plan)
        self.waiting_clients.setdefault(("", msg.version), set()).add(client)
        self.answer_clients()  # no replica at all: answered at once (replicas=0)

    def _send_chain(self, msg: P.StreamWeights, replicas: list[Replica], serial: int, target: str = "") -> P.StreamPlan:
        """Forward ``msg`` to ``replicas`` with their ranks (the chain: those that join it, in order);
        the plan for the trainer."""
        chain = [r for r in replicas if r.streams == "gloo"]
        first, prev, at = {}, {}, 1
        for k, r in enumerate(chain):  # each replica's workers take consecutive ranks; first workers chain up
            first[r], prev[r] = at, first[chain[k - 1]] if k else 0
            at += r.stream_ranks
        world = at
        until = clock.monotonic() + 2 * msg.timeout_s
        for r in replicas:
            rank = first.get(r, 0)
            w = self._of(r)
            w.streaming, w.streaming_until = msg.version, until
            w.ack = None  # what it answered an earlier send of this version is not this one's answer
            self.send_to_replica(r.identity, P.StreamWeights(
                msg.version, msg.manifest, msg.master, msg.port, msg.base, msg.timeout_s, target, rank, world, serial,
                prev.get(r, 0)))
        return P.StreamPlan(msg.version, world, [r.replica_id for r in chain + [r for r in replicas if r not in chain]],
                            target)

    def _catch_up(self, client: bytes, msg: P.StreamWeights) -> None:
        """The trainer's dense copy of the run's weights for the one replica that asked for it."""
        r = self.pool.get(msg.target)
        run = self.latest.version if self.latest is not None and not self.latest.path else None
        why = ("it is gone" if r is None else "it is draining" if r.draining
               else "it is taking an update" if self._of(r).streaming is not None
               else f"it holds version {msg.version} already" if self._of(r).loaded == msg.version
               else f"the run's weights are version {run}" if msg.version != run else "")
        if why:
            self.send_to_client(client, P.StreamPlan(msg.version, target=msg.target, error=f"{msg.target}: {why}"))
            return
        assert r is not None
        logger.info("replica %s gets streamed weights version %d (dense)", r.replica_id, msg.version)
        serial = self.latest.serial if self.latest is not None else 0
        self.send_to_client(client, self._send_chain(msg, [r], serial, msg.target))

    def _left_behind(self) -> None:
        """Once a replica holds the streamed version the run requires: every serving replica that does
        not and is not taking it (left out of the chain, or its apply failed) leaves dispatch until it
        gets the version dense from the trainer."""
        if self.required is None or self.required.path:
            return
        for r in self.pool.all():
            w = self._of(r)
            if r.ready and not r.draining and w.loaded != self.required.version and w.streaming is None:
                logger.warning("replica %s holds weights version %s, not %d: out of dispatch until it gets it",
                               r.replica_id, w.loaded, self.required.version)
                self.pool.set_unready(r)
                w.awaiting = True
                w.load_error = w.load_error or f"it holds version {w.loaded}, not {self.required.version}"
                self.push(r)

    def answer_clients(self) -> None:
        """Answer the clients whose update every ready replica, and every replica it was forwarded to that is
        still registered, has acknowledged (or one failed), once
        ``weights.json`` is written; the sweep calls it again while an answer waits for the file."""
        recorded = self.run_dir.router_weights
        if not self.waiting_clients or self.files.pending(recorded):
            return
        write_error = self.files.error(recorded)
        serving = [r for r in self.pool.all() if r.serving]
        for key in list(self.waiting_clients):
            version = key[1]
            plan = self.members.get(version, [])
            asked = [r for r in plan if r in self._replicas and not r.draining]
            ready = [*serving, *(r for r in asked if r not in serving)] if key[0] else asked
            acks = [self._of(r).ack for r in ready]
            errors = [f"{r.replica_id}: {a.error}" for r, a in zip(ready, acks, strict=True)
                      if a is not None and a.version == version and a.error]
            done = sum(1 for a in acks if a is not None and a.version == version and not a.error)
            if key[0] == "":
                # A stream: every replica of the plan answers first. Answered at its first failure, the
                # trainer would be told none applied it while others still were (and the run's weights
                # rolled back under them).
                if done + len(errors) < len(ready):
                    continue
                if plan and not ready:
                    errors.append("every replica of its plan left before applying it ("
                                  + ", ".join(r.replica_id for r in plan) + ")")
            elif not errors and done < len(ready):
                continue
            if write_error is not None:
                errors.append(f"the router could not record the weights in {recorded} (a restarted router "
                              f"would hand out older ones; update again to retry): {write_error}")
            answer = P.WeightsUpdated(version, error="; ".join(errors), replicas=done)
            for client in self.waiting_clients.pop(key):
                self.send_to_client(client, answer)
            self.members.pop(version, None)
            if done:
                self.landed = max(self.landed, version) if key[0] == "" else version
            elif key[0] == "" and plan and self.latest is not None and self.latest.version == version:
                self._roll_back(plan)

    def _roll_back(self, plan: list[Replica]) -> None:
        """No replica applied the streamed version (a trainer that died mid-update, a broken link): the
        run's weights are still the ones they hold, which a replica that registers now must get, and a
        restarted router must not hand out the version none has (``weights.json`` goes back too)."""
        self.latest = self.required
        self._record(self.required)
        for r in plan:  # what each answered was the failure: it holds, and is done with, what it had
            w = self._replicas.get(r)
            if w is not None and w.loaded is not None and self.latest is not None and w.loaded == self.latest.version:
                w.ack = Ack(w.loaded, "")

    def _record(self, msg: P.UpdateWeights | None) -> None:
        """Kept for a restarted router (None: no weights but the model's own). Written off the loop, so the
        replicas get the update at once; the client is answered only once the file is on disk (a router
        restarted after the answer must not hand out older weights)."""
        self.files.write(self.run_dir.router_weights, "{}" if msg is None else
                         json.dumps({"path": msg.path, "version": msg.version, "serial": msg.serial}))

    def _recorded(self) -> P.UpdateWeights | None:
        """The latest weights a previous router of this run handed out (a restarted router gives them
        to replicas that register with it, as the old one would have)."""
        info = read_json(self.run_dir.router_weights)
        return P.UpdateWeights(info["path"], int(info["version"]), int(info.get("serial", 0))) if info else None

    # ---- replicas --------------------------------------------------------------------------
    def registered(self, r: Replica, held: P.UpdateWeights | None) -> None:
        """A replica registered holding ``held`` (None: the model's own weights); it is handed the run's
        weights if it does not hold them, before its readiness probe.

        A checkpoint handed out after what this router found in ``weights.json`` (a higher ``serial``),
        before any client's update reached it, is the run's latest: the previous router forwarded it and
        died before recording it. It becomes the run's weights, so the other replicas load it, rather
        than the recorded ones first and these on the trainer's resend (each a full reload, and a window
        of rows on older weights). One handed out before (a replica that missed a later update, a
        rollback's included) is told to load the run's."""
        # A new registration acknowledged nothing yet (an earlier one of this identity is forgotten).
        w = self._replicas[r] = ReplicaWeights()
        if held is not None:
            self.highest_held_serial = max(self.highest_held_serial, held.serial)
            w.loaded = held.version
            w.ack = Ack(held.version, "")
            if not self.client_updated and (self.latest is None or held.serial > self.latest.serial):
                logger.info("replica %s holds weights version %d (%s), newer than the recorded ones: the "
                            "run's now", r.replica_id, held.version, held.path)
                self._record(held)
                self.latest = held
                for other in self.pool.all():
                    if other is not r and not other.draining and self.is_loading(other):
                        self.push(other)
            if not held.path:  # a restarted router's streamed version: what a replica holds, not the file
                self.landed = max(self.landed, held.version)
            if self.latest is not None and (self.latest.path, self.latest.version) == (held.path, held.version):
                self.required = self.latest
                self._left_behind()  # replicas that registered before it, holding an older version
        if self.is_loading(r):
            self.push(r)

    def forget(self, r: Replica) -> None:
        """``r`` left the router."""
        self._replicas.pop(r, None)

    def push(self, r: Replica) -> None:
        """Send the run's weights to ``r`` (streamed ones: ask the trainer that streamed them)."""
        if self.latest is None:
            return
        if self.latest.path:
            self.send_to_replica(r.identity, self.latest)
        elif self.source is not None and self._of(r).streaming is None:
            self.send_to_client(self.source, P.StreamWanted(self.latest.version, r.replica_id))
        elif self.source is None:
            logger.warning("replica %s needs streamed weights version %d, and no trainer has streamed to this "
                           "router yet: it waits for the next update", r.replica_id, self.latest.version)

    def may_serve(self, r: Replica) -> bool:
        """``r`` holds the weights a replica must hold to serve. One whose load failed where others'
        succeeded would serve older weights than the rest; if a load failed everywhere, the replicas
        serve on their last good ones."""
        return self.required is None or self._of(r).loaded == self.required.version

    def is_loading(self, r: Replica) -> bool:
        """``r`` was handed the run's weights and has not answered yet (its engine may be paused)."""
        if self.latest is None:
            return False
        ack = self._of(r).ack
        return ack is None or ack.version != self.latest.version

    def is_stale(self, r: Replica) -> bool:
        """``r`` is kept out of service: it could not load the run's weights."""
        w = self._replicas.get(r)
        return w is not None and bool(w.load_error)

    def admit(self, r: Replica) -> bool:
        """``r`` passed its readiness probe: True if it may serve now, else it waits for the run's weights."""
        w = self._of(r)
        if self.may_serve(r):
            w.awaiting = False
            w.load_error = ""
            return True
        w.awaiting = True  # ready once it acknowledges them (:meth:`acknowledged`)
        return False

    def acknowledged(self, r: Replica, msg: P.WeightsUpdated) -> None:
        """``r`` answered an UpdateWeights; one that waited for these weights enters service."""
        w = self._of(r)
        if w.streaming == msg.version:
            w.streaming = None
        if msg.error:
            logger.error("replica %s failed to load weights version %d: %s", r.replica_id, msg.version, msg.error)
        else:
            logger.info("replica %s has weights version %d", r.replica_id, msg.version)
            w.loaded = msg.version
            if self.latest is not None and msg.version == self.latest.version:
                self.required = self.latest
                if not self.latest.path and ("", msg.version) not in self.waiting_clients:
                    self.landed = max(self.landed, msg.version)  # a dense copy to a replica that missed it
        w.ack = Ack(msg.version, msg.error)
        r.restart_stall_clock(clock.monotonic())  # a load pauses generation: the stall clock starts after it
        w.load_error = msg.error if not r.ready else ""
        if w.awaiting and self.may_serve(r):
            w.awaiting = False
            w.load_error = ""
            self.pool.set_ready(r)
        self.answer_clients()
        self._left_behind()

    def retry_failed_load(self, r: Replica) -> bool:
        """The sweep's part for a replica kept out of service by a failed load: hand it the run's weights
        again (a file system's hiccup passes; a checkpoint gone for good keeps it out, said each time).
        True if it was asked."""
        w = self._replicas.get(r)
        if w is None or not (w.awaiting and self.required is not None and (w.load_error or not self.required.path)):
            return False
        if not self.required.path and w.streaming is not None and clock.monotonic() < w.streaming_until:
            return False  # still taking a dense copy
        logger.warning("replica %s stays out of service: it could not load weights version %d (%s); asking "
                       "again", r.replica_id, self.required.version, w.load_error)
        if self.required.path:
            self.send_to_replica(r.identity, self.required)
        else:
            w.streaming = None  # a catch-up that never answered is asked again
            self.push(r)
        return True
