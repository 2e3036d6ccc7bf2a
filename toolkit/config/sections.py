"""The run's other sections: router, tail routing, rollout, weights, workload, gateway and report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from toolkit.config.constraints import Choice, bounded


class RouterPolicyName(Choice):
    """``router.policy``: the policies of ``toolkit/router/policy.py`` (``POLICIES``)."""

    consistent_hash = "consistent_hash"
    least_loaded = "least_loaded"
    power_of_two = "power_of_two"
    round_robin = "round_robin"
    kv_aware = "kv_aware"


class Affinity(Choice):
    """``router.affinity``: what a session's request does when its own replica is full."""

    spill = "spill"
    wait = "wait"


class QueueOrder(Choice):
    """``router.queue``."""

    fair = "fair"
    fifo = "fifo"


@dataclass
class RouterConfig:
    host: str | None = None
    """Address the router binds its two sockets on (ports are picked free); null = 127.0.0.1 with
    ``cluster=local``, else every interface (0.0.0.0), advertising this node's hostname."""
    curve: bool | None = None
    """ZeroMQ CURVE: encrypted sockets, only the run's own replicas and ranks get in (keys in
    ``<run dir>/keys``, mode 0600); null = on for Slurm clusters, off for ``cluster=local``."""
    policy: RouterPolicyName = RouterPolicyName.consistent_hash
    """Replica choice in a group: consistent_hash | least_loaded | power_of_two | round_robin | kv_aware
    (a turn goes where the longest prefix of its tokens is cached, by the engines' own KV events, within
    ``load_factor``; docs/router.md#kv-aware-routing)."""
    load_factor: float = bounded(1.25, ge=1.0)
    """Bounded-load consistent hashing: no replica above ceil(load_factor * average load)."""
    kv_budget: float | None = bounded(None, gt=0, le=1, null="0.9 with kv_aware, none with the others")
    """Admission by KV budget: a new session starts on a replica only while the KV its running sessions
    take there, plus the new one's expected KV, stays under this fraction of the replica's KV cache (as
    its engine reports it); new sessions beyond every replica's budget wait in the router's queue, fair
    between jobs, instead of evicting each other's prefixes. 1.0 admits up to the whole cache."""
    kv_idle_s: float = bounded(60.0, gt=0)
    """A session admitted under ``kv_budget`` that sends no request for this long (a client that never
    says ``SessionDone``) gives its reservation back; raise it for agents whose tool calls take longer."""
    affinity: Affinity = Affinity.spill
    """``consistent_hash``: a request whose session's replica has no free slot ``spill``s to the next
    one with room, computing its context there again, or ``wait``s in the queue for a slot on its own
    (its prefix cached there; the queue serves the requests behind it meanwhile). ``wait`` pays on a
    saturated fleet: docs/router.md#affinity."""
    heartbeat_s: float = bounded(0.5, gt=0)
    """Interval of replica heartbeats."""
    missed_heartbeats: int = bounded(6, ge=1)
    """A replica silent for this many intervals is dropped and its requests re-queued."""
    max_engine_deaths: int = bounded(2, ge=1)
    """A request in flight at this many replica deaths fails as ``engine_dead``."""
    suspects_per_replica: int = bounded(1, ge=1)
    """Requests that were in flight at a death run at most this many per replica, so the next death
    points at one of them and innocent co-travellers of a poison request are not failed with it."""
    stall_timeout_s: float = bounded(60.0, gt=0)
    """A replica with requests in flight that generates no token for this long is dropped as hung."""
    queue: QueueOrder = QueueOrder.fair
    """``fair``: one request per job in turn; ``fifo``: plain arrival order (a baseline)."""
    probe_timeout_s: float = bounded(30.0, gt=0)
    """A replica whose readiness probe has not answered by then is probed again."""
    result_cache: int = bounded(200000, ge=0)
    """At most this many Results, the newest, kept to answer a duplicate submission of a request id (a
    client's resend) with the Result already sent; an id resubmitted after its Result was dropped runs
    again. Also the number of early Aborts kept (an Abort that overtook its own Generate)."""
    result_cache_mb: float = bounded(256.0, ge=0)
    """...and at most this many MB of them, encoded (a Result of 8,000 tokens is about 110 kB): the bound
    that holds on long outputs, where 200,000 Results would take tens of GB of the router's memory."""
    no_replica_timeout_s: float | None = bounded(300.0, gt=0)
    """A group with no ready replica (scaled to zero, drained, all dead) makes its requests wait, not
    fail; a request that has waited this long while its target group had no ready replica fails as
    ``no_replica``. null = wait forever."""


class TailPolicyName(Choice):
    """``tail.policy``: the policies of ``toolkit/router/tail/`` (``TAIL_POLICIES``)."""

    count = "count"
    age = "age"
    predict = "predict"


class Move(Choice):
    """``tail.move``: how a moving request takes its context (``auto``: ``kv`` where every engine can
    receive it, else ``recompute``)."""

    auto = "auto"
    recompute = "recompute"
    kv = "kv"


@dataclass
class TailConfig:
    policy: TailPolicyName = TailPolicyName.count
    """How a step's long runners reach ``group`` (``toolkit/router/tail/``): ``count``: only at the flip
    (``threshold``); ``age``: a running request whose turn has generated more than a long turn
    (``long_quantile``/``long_tokens``) moves there with its tokens at once, oldest first, while the group
    has room; ``predict``: a session whose earlier turns or prompt siblings were long starts its next turn
    there. With ``age`` and ``predict`` the group serves only such requests until the flip, and a session
    that ran there keeps its later turns there while it has room."""
    threshold: float | None = bounded(None, gt=0, le=1, null="for no flip")
    """Fraction of a step's sessions done at which the rest of the step flips to ``group``; null = no
    flip (with ``policy=count``: tail routing off)."""
    group: str = "tail"
    """The fast group that takes a step's long runners, and the whole step after its flip."""
    migrate_inflight: bool = False
    """After the flip, the step's requests running outside the tail group move to it too (aborted and
    continued from where they stopped: prompt + tokens so far, remaining budget), oldest first, as
    it has room."""
    long_quantile: float = bounded(0.9, gt=0, lt=1)
    """A turn is long when it has generated more tokens than this quantile of the turns the step has
    finished so far (``age`` and ``predict``)."""
    long_tokens: int | None = bounded(None, ge=1)
    """A fixed token count to call a turn long, instead of ``long_quantile``; null = the quantile."""
    long_min_finished: int = bounded(8, ge=1)
    """Turns the step must have finished before ``long_quantile`` means anything (no move before)."""
    move: Move = Move.auto
    """How a request that moves between groups takes its context: ``recompute``: the replica it lands
    on prefills it (but for what its prefix cache holds); ``kv``: its KV cache travels with it over the
    replicas' KV link, as vLLM's KV connectors (NIXL) do between GPUs. Only sim engines take ``kv``
    today (they model the link: ``engine.kv_link_bytes_per_s``); ``auto``: ``kv`` when every group's
    engine does, else ``recompute``."""
    trade_margin: int | None = bounded(None, ge=0)
    """``age`` (other policies move nothing for their age, so trade nothing): with the tail group full, a long runner trades places with the tail group's request of
    least expected work left once its own is larger by this many tokens; null = no trades. Expected
    work left: what a turn that has run this long still makes, plus the turns its session has still to
    run times the mean turn, by the job's last step (no trade in a job's first step)."""

    @property
    def active(self) -> bool:
        """Tail routing is on: a flip, or a policy that moves long runners early."""
        return self.threshold is not None or self.policy != "count"

    @property
    def reserves_group(self) -> bool:
        """Before the flip, ``group`` serves only what the policy sends there (``age``, ``predict``); with
        ``count`` every group serves the step until its flip."""
        return self.policy != "count"


def flip_count(threshold: float, n_sessions: int) -> int:
    """Sessions done at which a step of ``n_sessions`` flips: ``ceil(threshold * n_sessions)``, at least 1."""
    # Round away float noise first: 0.95 * 100 is 94.99999999999999 in binary.
    return max(1, math.ceil(round(threshold * n_sessions, 9)))


class Output(Choice):
    """``rollout.output``."""

    gather = "gather"
    shards = "shards"


class UpdateMode(Choice):
    """``rollout.update_mode``."""

    pause = "pause"
    drain = "drain"


class WeightsTransport(Choice):
    """``rollout.weights_transport``."""

    checkpoint = "checkpoint"
    stream = "stream"


class DeltaMode(Choice):
    """``weights.delta``."""

    off = "off"
    auto = "auto"


class CloseMode(Choice):
    """``rollout.close``."""

    all = "all"
    count = "count"


class StaleAction(Choice):
    """``rollout.stale``."""

    drop = "drop"
    restart = "restart"


class GroupFilter(Choice):
    """``rollout.filter_groups``."""

    none = "none"
    zero_variance = "zero_variance"


@dataclass
class RolloutConfig:
    max_concurrent_rollouts: int | None = None
    """Cap on a step's sessions in flight across all ranks (at least ``ranks``: each runs one at a time
    at least); null = all at once."""
    output: Output = Output.gather
    """``gather``: rank 0 gathers every sample (Gatherv) and writes ``steps/step_XXXXX.parquet``;
    ``shards``: each rank writes ``steps/step_XXXXX/shard_RRRRR.parquet``, rank 0 only a manifest."""
    decode_responses: bool = False
    """Decode each sample's response text on its rank (needs ``workload.tokenizer``); off: ``response = ""``."""
    request_timeout_s: float = bounded(600.0, gt=0)
    """Deadline of each generation request, counted from its submission."""
    max_failed_fraction: float | None = bounded(0.1, ge=0, le=1)
    """A step whose share of ``failed`` samples (an environment or agent that raised, hung past
    ``workload.env_timeout_s`` or sent garbage) is above this fails the run, after its files are
    written; null = never. Failed samples below it are rows with ``status = failed`` and the error."""
    update_mode: UpdateMode = UpdateMode.pause
    """How a replica takes new weights while requests run: ``pause``: it pauses between engine steps,
    reloads, resets its prefix cache and resumes the same requests, whose later tokens come from the new
    weights (their Results list both versions); ``drain``: it lets the requests in the engine finish
    first, new ones wait. Either way no request is aborted or retried. An engine that cannot update in
    place drains."""
    weights_transport: WeightsTransport = WeightsTransport.checkpoint
    """How the trainer's weights reach the replicas: ``checkpoint``: it publishes them in ``weights_dir``
    and every replica reads them back; ``stream``: it sends them over the network into every replica
    (``toolkit.weights.Streamer``, the ``weights`` section), and step ``s`` waits for version ``s - k``
    to reach the replicas (``max_staleness``)."""
    weights_dir: str | None = None
    """Published checkpoints (``toolkit.weights.publish``): before step ``s``, if the latest published
    ``<weights_dir>/step_XXXXX`` up to ``s`` is newer than the replicas' weights, every replica loads it
    (``update_mode``) as weight version ``XXXXX`` (the model's own weights are version 0), and so again
    whenever one up to ``s`` is published while step ``s`` runs; null = off."""
    max_staleness: int | None = bounded(None, ge=0, note="(0 = on-policy)", null="(never wait)")
    """Bounded staleness ``k`` (needs ``weights_dir`` or ``weights_transport=stream``): step ``s`` starts only once weights of version
    ``>= s - k`` are published; 0 = strictly on-policy (each step waits for the update from the step
    before), 1 = the rollout of step ``s`` overlaps training on step ``s-1``; null = never wait."""
    weights_timeout_s: float = bounded(3600.0, gt=0)
    """How long a step waits for the weights ``max_staleness`` asks for; past it the run fails, naming
    the missing version and ``weights_dir``."""
    load_timeout_s: float = bounded(1800.0, gt=0)
    """How long every replica may take to load a checkpoint; past it the run fails, naming the replicas
    still loading it (a hung file system, a stuck engine)."""
    weights_poll_s: float = bounded(0.2, gt=0)
    """How often rank 0 looks in ``weights_dir`` for a new checkpoint: while a step waits for one, and
    while a step runs (a checkpoint up to the running step is loaded as soon as it is published)."""
    close: CloseMode = CloseMode.all
    """When a step ends: ``all``: once every session it started has ended; ``count``: once
    ``sessions_per_step`` sessions (in whole GRPO groups) have ended, wherever they started. The sessions
    still running are carried on, not aborted, and land in the step in which they end (docs/partial.md)."""
    over_sample: float = bounded(0.0, ge=0, le=4)
    """``close=count``: keep ``sessions_per_step * (1 + over_sample)`` sessions (whole groups) in flight:
    each step starts as many new ones as that needs, closes on the fastest, and carries the rest."""
    stale: StaleAction = StaleAction.drop
    """``close=count`` with ``max_staleness = k``: a carried session whose oldest token's weights would
    be more than ``k`` versions behind the newest when it lands (without ``weights_dir``: carried across
    more than ``k`` step boundaries) is ``drop``ped (its rows written with status ``stale``) or ``restart``ed
    from its first turn on the current weights."""
    filter_groups: GroupFilter = GroupFilter.none
    """``close=count``: ``zero_variance``: a finished group whose rewards are all equal (no gradient for
    GRPO) does not count toward closing its step (rows written with status ``filtered``), and another
    group is started in its place."""
    max_group_starts_per_step: int | None = bounded(None, ge=1, null="(4x the groups a step keeps in flight)")
    """``close=count``: groups a step may start, replacements of filtered ones included; a step that
    reaches it and has nothing left to land closes short (its report says so)."""


    @property
    def handshake(self) -> bool:
        """The trainer's weights reach the replicas through the run (a checkpoint directory or streams)."""
        return bool(self.weights_dir) or self.weights_transport == WeightsTransport.stream


@dataclass
class WeightsConfig:
    """Streamed updates (``rollout.weights_transport=stream``): how the trainer's ``Streamer`` sends them."""

    bucket_mb: float = bounded(64.0, gt=0)
    """Size of the chunks the update moves in (two in flight per link): a replica forwards one as soon
    as it has it, so the chain's fill time is one bucket per replica."""
    delta: DeltaMode = DeltaMode.auto
    """``auto``: a tensor goes as its changed elements (indices + values) against the version every
    replica holds, where that is smaller than dense; ``off``: every tensor dense."""
    timeout_s: float = bounded(300.0, gt=0)
    """How long a peer of the chain may stall mid-update before the update fails (every replica keeps
    its previous version)."""
    apply_timeout_s: float = bounded(1800.0, gt=0)
    """How long the trainer waits, once the payload is through, for every replica to apply it
    (``rollout.update_mode=drain`` first lets the running requests end); past it ``send`` raises."""
    host: str | None = None
    """The address the trainer's rendezvous listens on, reachable from every replica; null = the
    router's host if that is a loopback address, else this node's hostname."""


@dataclass
class WorkloadConfig:
    name: str = "multiturn"
    """A short name for reports."""
    env: dict[str, Any] = field(default_factory=dict)
    """Environment: a Hydra ``_target_`` class implementing ``toolkit.rollout.envs.Environment``."""
    prompts: dict[str, Any] = field(default_factory=dict)
    """Prompt source: a Hydra ``_target_`` class implementing ``toolkit.rollout.prompts.PromptSource``."""
    max_tokens: int = bounded(256, ge=1)
    """Generation budget of one turn."""
    temperature: float = bounded(1.0, ge=0)
    """Sampling temperature."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling."""
    tokenizer: Any = None
    """For text prompts and ``rollout.decode_responses``: null, a path to a ``tokenizer.json`` (HF
    ``tokenizers`` library), or a Hydra ``_target_`` with ``encode``/``decode`` (``toolkit/model/tokenizer.py``).
    With ``agent``: the model's directory (tokenizer files and chat template), or ``tiny``."""
    agent: dict[str, Any] = field(default_factory=dict)
    """Agents over HTTP instead of ``env``: a Hydra ``_target_`` of ``async def solve(base_url, task) ->
    reward`` (extra keys are bound as keyword arguments), run once per session against the rank's
    gateway (``toolkit/gateway``); ``toolkit.rollout.agents.run_command`` starts a harness program per
    session. Empty = the in-process ``env``."""
    env_timeout_s: float | None = bounded(600.0, gt=0)
    """Bound on one session's environment or agent (all its turns); past it the sample is ``failed``
    and the step goes on. null = none."""
    record_messages: bool = False
    """Agent sessions: keep the conversation as JSON in the ``messages`` column."""
    length_hint: dict[str, Any] = field(default_factory=dict)
    """A predictor of each turn's length, sent with it so a tail policy can start a turn hinted long on
    the tail group: a Hydra ``_target_`` of a ``toolkit.rollout.hints.LengthHint`` (``SimOracle``: the
    sim's plan, off by a chosen sigma, for benchmarks). Empty = no hints."""


class ToolParser(Choice):
    """``gateway.tool_parser``: the parsers of ``toolkit/gateway/toolcalls.py`` (``PARSERS``)."""

    hermes = "hermes"
    none = "none"


@dataclass
class GatewayConfig:
    """The HTTP gateway each rank serves to agents (``workload.agent``; ``toolkit/gateway``)."""

    host: str | None = None
    """Address to bind; null = 127.0.0.1 with ``cluster=local``, else every interface (advertising
    the node's hostname). Like the router, it admits only the run's token when ``router.curve`` is on."""
    port: int = bounded(0, ge=0, le=65535)
    """0 = a free port per rank; N = port N + rank (ranks that share a node need one each)."""
    max_concurrent_requests: int = bounded(1024, ge=1)
    """Sessions whose calls a rank's gateway serves at once (a session's calls, which run one at a time,
    count once); more are answered 429 (the SDKs retry with backoff)."""
    max_body_mb: float = bounded(32.0, gt=0)
    """Largest request body; larger ones are answered 413."""
    tool_parser: ToolParser = ToolParser.hermes
    """How tool calls are found in generated text (``toolkit/gateway/toolcalls.py``): hermes | none."""
    keepalive_s: float = bounded(15.0, gt=0)
    """A streaming call whose turn runs longer starts its stream at once and sends an SSE comment this
    often until the turn's frames, so a client's idle timeout between bytes never fires on a long turn."""


class WandbMode(Choice):
    """``report.wandb_mode``."""

    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class ReportConfig:
    log_interval_s: float = bounded(30.0, gt=0, note="(seconds)")
    """When launch's output is not a terminal (a Slurm log, a pipe): a plain progress line of the running
    step this often (on a terminal the display is redrawn every second)."""
    metrics: bool = True
    """The router, every replica and every rank serve Prometheus metrics on ``/metrics``
    (``toolkit/core/metrics.py``); launch lists the endpoints in ``<run dir>/prometheus_targets.json`` (file_sd)."""
    trackers: list[str] = field(default_factory=list)
    """Experiment trackers that log every step report (flattened, keyed by step) with the run's config:
    ``wandb`` (needs ``pip install wandb``), ``tensorboard`` (``pip install tensorboardX``); files under
    ``<run dir>/trackers``."""
    wandb_project: str = "rollout-toolkit"
    """The W&B project of the run."""
    wandb_mode: WandbMode | None = None
    """``online``, ``offline`` (no network; ``wandb sync`` later) or ``disabled``; null = W&B's own
    setting (``WANDB_MODE``, else online)."""
