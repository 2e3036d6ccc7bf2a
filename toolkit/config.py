"""Structured configs, registered in Hydra's ConfigStore.

YAML under ``conf/`` picks defaults; these dataclasses give every field a type and a docstring.
The entry point converts Hydra's DictConfig to these plain objects once (:func:`from_dictconfig`),
validates them (:func:`toolkit.validation.validate`, every error at once) and writes ``config.yaml``
into the run directory, from which every other process reloads the same objects (:func:`load_run_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, ValidationError

from toolkit.errors import ConfigError, FieldError

QUEUES = ("fair", "fifo")
OUTPUTS = ("gather", "shards")
UPDATE_MODES = ("pause", "drain")


@dataclass
class ClusterConfig:
    type: str = "local"
    """Cluster backend: ``local`` (submitit LocalExecutor + mpiexec), ``slurm`` (submitit SlurmExecutor
    from a login node) or ``allocation`` (srun steps inside an sbatch allocation, see ``slurm/``)."""
    ready_timeout_s: float = 120.0
    """How long to wait for the router and every replica to be ready before failing the run."""
    job_timeout_min: int = 24 * 60
    """Wall-clock limit of each component job (submitit ``timeout_min``)."""
    mpiexec: str | None = None
    """``mpiexec`` to start the ranks with; default: the one beside the running Python (mpich wheel)."""
    restart_replicas: bool = True
    """Start a replacement when a replica process dies during the run."""
    restart_router: bool = True
    """Start a new router when the router dies; clients and replicas follow it and resend."""
    lease_s: float = 60.0
    """Every component exits when launch has not renewed its lease (``<run dir>/lease.json``) for this
    long: the jobs of a launch that was killed end (``toolkit/lease.py``)."""
    gpus_per_node: int = 0
    """Devices of one node (GPUs; on vLLM's CPU build, engine worker processes). 0: every replica fits on
    one node (``cluster.replica.nodes`` says otherwise on Slurm). N: a replica whose tensor x pipeline
    parallel size W is larger than N spans W / N nodes (W must be a multiple of N), one node rank per
    node, each with N devices; ``allocation`` also packs smaller replicas onto nodes by it. Locally, each
    node rank is its own process, and they meet only through the master address."""
    signal_grace_s: int = 180
    """On SIGUSR1 (the sbatch templates have Slurm send it this many seconds before the time limit,
    ``--signal=B:USR1@N``) launch finishes the step in flight if it can in this time less a teardown
    margin, else abandons it; it stops every component and, inside an sbatch job, requeues the job,
    which resumes."""


@dataclass
class ReplicaResources:
    """What one engine replica asks Slurm for."""

    gpus: int = 0
    """GPUs per node of one replica; 0 for a CPU engine such as ``sim``."""
    nodes: int = 1
    """Nodes one replica spans (vLLM multi-node: each node gets its node rank and the master address)."""
    cpus: int = 1
    """CPUs per node of one replica."""
    mem: str = "2G"
    """Memory per node of one replica (sbatch ``--mem``: a number with an optional K/M/G/T suffix)."""
    partition: str | None = None
    """``cluster=slurm``: the partition of this group's replica jobs (null = ``cluster.partition``), e.g.
    a preemptible one: its replicas come and go, the step goes on with the others."""
    requeue: bool = True
    """``cluster=slurm``: Slurm requeues a preempted replica job and it comes back as itself; false:
    it ends, and launch starts a replacement (``cluster.restart_replicas``)."""


@dataclass
class SlurmClusterConfig(ClusterConfig):
    """``cluster=slurm`` (one Slurm job per component, submitted through submitit from a login node)
    and ``cluster=allocation`` (the same components as ``srun`` steps of one sbatch allocation)."""

    type: str = "slurm"
    """``slurm`` or ``allocation``."""
    partition: str | None = None
    """Slurm partition (``--partition``); null = the cluster's default."""
    account: str | None = None
    """Slurm account (``--account``) to charge; null = the user's default."""
    qos: str | None = None
    """Quality of service (``--qos``); null = the default."""
    constraint: str | None = None
    """Node features the jobs need (``--constraint``), e.g. ``h100``."""
    extra_sbatch: list[str] = field(default_factory=list)
    """More sbatch options, one per entry, e.g. ``--reservation=rl`` (written as ``#SBATCH`` lines)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before every component, e.g. ``module load cuda``, ``source ~/venv/bin/activate``."""
    python: str | None = None
    """Python that the jobs run; null = the interpreter running ``launch``."""
    replica: ReplicaResources = field(default_factory=ReplicaResources)
    """Resources of one replica of every group."""
    group_resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-group overrides of ``replica``, e.g. ``{tail: {gpus: 2}}``."""
    router_cpus: int = 1
    """CPUs of the router job (a CPU job)."""
    router_mem: str = "1G"
    """Memory of the router job."""
    rank_cpus: int = 1
    """CPUs of each rollout rank."""
    rank_mem: str = "1G"
    """Memory of each rollout rank."""
    ranks_per_node: int | None = None
    """Rollout ranks on one node; null = all ranks on one node."""
    mpi: str = "pmi2"
    """``srun --mpi`` plugin that wires the ranks into one MPI world (pmi2 works with the mpich wheel)."""
    cache_dir: str | None = None
    """Shared compile-cache dir (vLLM, Triton, TorchInductor), so a replaced or added replica starts
    warm; null = ``<run dir>/cache``. Must be on a file system every node sees."""
    shared_fs_check: bool = True
    """Refuse a run dir (or cache dir) on node-local storage (see ``toolkit/cluster/slurm.py``); turn
    off only where every component runs on one node."""
    poll_s: float = 1.0
    """Interval of the ``squeue``/``sacct`` queries that watch the jobs."""


@dataclass
class SimEngineConfig:
    """A simulator of a continuous-batching engine (see ``toolkit/engine/sim.py``): not a model."""

    type: str = "sim"
    """Engine backend: ``sim``."""
    model: str = "sim-8b"
    """Name reported to the router; requests without a job are grouped under it."""
    time_scale: float = 1.0
    """Multiplies every simulated duration: 1.0 runs in modelled real time, 0.1 ten times faster."""
    weight_bytes: float = 16e9
    """Bytes of weights read per decode step: an 8B-parameter model in bf16."""
    hbm_bandwidth: float = 4.3e12
    """Bytes/s of device memory: about what an H200 measures for device copies."""
    kv_bytes_per_token: int = 131072
    """KV bytes per token: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes."""
    step_overhead_s: float = 0.0004
    """Fixed cost of a decode step (scheduling, kernel launches, sampling)."""
    prefill_tokens_per_s: float = 30000.0
    """Prefill throughput for uncached prompt tokens: 16 GFLOP/token at about 50% of ~1 PFLOP/s."""
    tensor_parallel_size: int = 1
    """Divides weight and KV reads across devices (a tail group uses more)."""
    tp_efficiency: float = 0.85
    """Fraction of the ideal tensor-parallel speedup left after all-reduce communication."""
    max_num_seqs: int = 256
    """Sequences decoded together in one step (the engine's batch cap)."""
    max_model_len: int = 8192
    """Longest prompt + output; longer prompts are client errors."""
    vocab_size: int = 32000
    """Token ids must be below this."""
    block_size: int = 16
    """Tokens per prefix-cache block."""
    kv_cache_tokens: int = 400000
    """Prefix cache capacity in tokens (LRU over blocks)."""
    output_len_median: float = 180.0
    """Median of the lognormal natural output length, in tokens, before ``max_tokens`` cuts it."""
    output_len_sigma: float = 1.0
    """Sigma of that lognormal: 1.0 puts p99 at ~10x the median (a heavy tail)."""
    output_len_session_share: float = 0.0
    """Share of the log-length variance the turns of one session have in common (0 = independent
    turns; a hard task makes every turn of its session long)."""
    output_len_prompt_share: float = 0.0
    """Share of the log-length variance the sessions of one prompt (``Generate.prompt_key``: GRPO
    siblings; a session without one is its own prompt) have in common, on top of the session's share
    (their sum at most 1). Sampled siblings (temperature > 0, no seed) get different tokens."""
    tokenizer: Any = None
    """Only for structured outputs (the gateway's ``tool_choice``/``response_format``): the tokenizer
    (as ``workload.tokenizer``) that encodes the seeded instance of the schema the sim emits;
    null = a structured request is a client error."""
    fault_crash_token: int | None = None
    """Test hook: the replica process dies (exit 70) when it schedules a prompt holding this token id."""
    fault_hang_token: int | None = None
    """Test hook: the engine stops generating (heartbeats go on) once it schedules a prompt holding it."""


@dataclass
class VllmEngineConfig:
    """vLLM's AsyncLLM in the replica process (see ``toolkit/engine/vllm.py``): token ids in and out."""

    type: str = "vllm"
    """Engine backend: ``vllm``."""
    model: str = "tiny"
    """Model directory on the shared file system (or a hub name where a hub is reachable). ``tiny`` is
    the built-in random-weight test model (``toolkit/engine/tiny.py``), built into ``cache_dir`` on first use."""
    cache_dir: str = "~/.cache/rollout-toolkit"
    """Where ``model: tiny`` is built (once; replicas that start together wait on a file lock)."""
    max_model_len: int = 1024
    """Longest prompt + output (vLLM ``max_model_len``); the replica reports the engine's own value to the router."""
    vocab_size: int = 512
    """The model's vocabulary size, for workloads that make token ids (``${engine.vocab_size}``); the
    router checks prompts against the value the engine reports."""
    tensor_parallel_size: int = 1
    """Devices per replica (vLLM ``tensor_parallel_size``); on vLLM's CPU build the replica's CPUs are
    split between the workers."""
    pipeline_parallel_size: int = 1
    """Pipeline stages per replica (vLLM ``pipeline_parallel_size``): a replica has tensor x pipeline
    parallel devices, across nodes when that is more than ``cluster.gpus_per_node``."""
    kv_cache_gib: float | None = None
    """KV cache per replica in GiB (vLLM ``kv_cache_memory_bytes``); null = vLLM's own sizing
    (``gpu_memory_utilization`` on GPUs, ``VLLM_CPU_KVCACHE_SPACE`` or 4 GiB on CPUs)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Every other engine argument, passed through to vLLM's ``AsyncEngineArgs`` as is: ``dtype``,
    ``max_num_seqs``, ``enable_prefix_caching``, ``block_size``, ``enforce_eager``, ``enable_lora``,
    ``max_lora_rank``, ``max_loras``, ``seed``, ... (``engine.args.max_num_seqs=128`` on the command line)."""
    max_restarts: int = 2
    """Engine restarts a replica makes after engine deaths; at the next death the replica process exits
    and the cluster backend replaces it."""
    cpu_engine_nice: int = 10
    """On vLLM's CPU build only: niceness added to the engine processes. Their worker threads spin on
    every core they have; lowered, they leave the replica process (its heartbeats, the router's
    messages, vLLM's output handling) the CPU it needs, as a GPU engine does. 0 = as they are."""
    adapter_poll_s: float = 0.5
    """How often a request whose LoRA adapter directory has no ``adapter_config.json`` yet looks again."""
    adapter_wait_s: float = 600.0
    """How long a request without a deadline waits for its adapter before failing as ``adapter_missing``."""
    adapter_margin_s: float = 1.0
    """A request whose adapter is still missing fails this long before its deadline, so that the
    ``adapter_missing`` answer reaches the router before the router times the request out."""


# Engine arguments that have their own field above (the field wins; one place to set each).
VLLM_OWN_ARGS = ("model", "max_model_len", "tensor_parallel_size", "pipeline_parallel_size", "kv_cache_memory_bytes",
                 "disable_log_stats", "nnodes", "node_rank", "master_addr", "master_port")


@dataclass
class GroupConfig:
    replicas: int = 1
    """Number of engine replicas in this group."""
    max_inflight: int = 64
    """Requests the router keeps in flight on one replica at most; the rest wait in the router."""
    labels: dict[str, str] = field(default_factory=dict)
    """Extra labels the replicas register with (``group`` is always set)."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Overrides of ``engine.*`` fields for this group (e.g. ``tensor_parallel_size: 2``)."""


@dataclass
class RouterConfig:
    host: str | None = None
    """Address the router binds its two sockets on (ports are picked free); null = 127.0.0.1 with
    ``cluster=local``, else every interface (0.0.0.0), advertising this node's hostname."""
    curve: bool | None = None
    """ZeroMQ CURVE: encrypted sockets, only the run's own replicas and ranks get in (keys in
    ``<run dir>/keys``, mode 0600); null = on for Slurm clusters, off for ``cluster=local``."""
    policy: str = "consistent_hash"
    """Replica choice in a group: consistent_hash | least_loaded | power_of_two | round_robin."""
    load_factor: float = 1.25
    """Bounded-load consistent hashing: no replica above ceil(load_factor * average load)."""
    heartbeat_s: float = 0.5
    """Interval of replica heartbeats."""
    missed_heartbeats: int = 6
    """A replica silent for this many intervals is dropped and its requests re-queued."""
    max_engine_deaths: int = 2
    """A request in flight at this many replica deaths fails as ``engine_dead``."""
    suspects_per_replica: int = 1
    """Requests that were in flight at a death run at most this many per replica, so the next death
    points at one of them and innocent co-travellers of a poison request are not failed with it."""
    stall_timeout_s: float = 60.0
    """A replica with requests in flight that generates no token for this long is dropped as hung."""
    queue: str = "fair"
    """``fair``: one request per job in turn; ``fifo``: plain arrival order (a baseline)."""
    probe_timeout_s: float = 30.0
    """A replica whose readiness probe has not answered by then is probed again."""
    result_cache: int = 200000
    """Results kept to answer duplicate submissions of a request id."""
    no_replica_timeout_s: float | None = 300.0
    """A group with no ready replica (scaled to zero, drained, all dead) makes its requests wait, not
    fail; a request that has waited this long while its target group had no ready replica fails as
    ``no_replica``. null = wait forever."""


@dataclass
class TailConfig:
    policy: str = "count"
    """How a step's long runners reach ``group`` (``toolkit/router/tail/``): ``count``: only at the flip
    (``threshold``); ``age``: a running request whose turn has generated more than a long turn
    (``long_quantile``/``long_tokens``) moves there with its tokens at once, oldest first, while the group
    has room; ``predict``: a session whose earlier turns or prompt siblings were long starts its next turn
    there. With ``age`` and ``predict`` the group serves only such requests until the flip, and a session
    that ran there keeps its later turns there while it has room."""
    threshold: float | None = None
    """Fraction of a step's sessions done at which the rest of the step flips to ``group``; null = no
    flip (with ``policy=count``: tail routing off)."""
    group: str = "tail"
    """The fast group that takes a step's long runners, and the whole step after its flip."""
    migrate_inflight: bool = False
    """After the flip, the step's requests running outside the tail group move to it too (aborted and
    continued from where they stopped: prompt + tokens so far, remaining budget), oldest first, as
    it has room."""
    long_quantile: float = 0.9
    """A turn is long when it has generated more tokens than this quantile of the turns the step has
    finished so far (``age`` and ``predict``)."""
    long_tokens: int | None = None
    """A fixed token count to call a turn long, instead of ``long_quantile``; null = the quantile."""
    long_min_finished: int = 8
    """Turns the step must have finished before ``long_quantile`` means anything (no move before)."""

    @property
    def active(self) -> bool:
        """Tail routing is on: a flip, or a policy that moves long runners early."""
        return self.threshold is not None or self.policy != "count"


@dataclass
class RolloutConfig:
    max_concurrent_rollouts: int | None = None
    """Cap on a step's sessions in flight across all ranks; null = all at once."""
    output: str = "gather"
    """``gather``: rank 0 gathers every sample (Gatherv) and writes ``steps/step_XXXXX.parquet``;
    ``shards``: each rank writes ``steps/step_XXXXX/shard_RRRRR.parquet``, rank 0 only a manifest."""
    decode_responses: bool = False
    """Decode each sample's response text on its rank (needs ``workload.tokenizer``); off: ``response = ""``."""
    request_timeout_s: float = 600.0
    """Deadline of each generation request, counted from its submission."""
    max_failed_fraction: float | None = 0.1
    """A step whose share of ``failed`` samples (an environment or agent that raised, hung past
    ``workload.env_timeout_s`` or sent garbage) is above this fails the run, after its files are
    written; null = never. Failed samples below it are rows with ``status = failed`` and the error."""
    update_mode: str = "pause"
    """How a replica takes new weights while requests run: ``pause``: it pauses between engine steps,
    reloads, resets its prefix cache and resumes the same requests, whose later tokens come from the new
    weights (their Results list both versions); ``drain``: it lets the requests in the engine finish
    first, new ones wait. Either way no request is aborted or retried. An engine that cannot update in
    place drains."""
    weights_dir: str | None = None
    """Published checkpoints (``toolkit.weights.publish``): before step ``s``, if the latest published
    ``<weights_dir>/step_XXXXX`` up to ``s`` is newer than the replicas' weights, every replica loads it
    (``update_mode``) as weight version ``XXXXX`` (the model's own weights are version 0), and so again
    whenever one up to ``s`` is published while step ``s`` runs; null = off."""
    max_staleness: int | None = None
    """Bounded staleness ``k`` (needs ``weights_dir``): step ``s`` starts only once weights of version
    ``>= s - k`` are published; 0 = strictly on-policy (each step waits for the update from the step
    before), 1 = the rollout of step ``s`` overlaps training on step ``s-1``; null = never wait."""
    weights_timeout_s: float = 3600.0
    """How long a step waits for the weights ``max_staleness`` asks for; past it the run fails, naming
    the missing version and ``weights_dir``."""
    weights_poll_s: float = 0.2
    """How often rank 0 looks in ``weights_dir`` for a new checkpoint: while a step waits for one, and
    while a step runs (a checkpoint up to the running step is loaded as soon as it is published)."""


@dataclass
class WorkloadConfig:
    name: str = "multiturn"
    """A short name for reports."""
    env: dict[str, Any] = field(default_factory=dict)
    """Environment: a Hydra ``_target_`` class implementing ``toolkit.rollout.envs.Environment``."""
    prompts: dict[str, Any] = field(default_factory=dict)
    """Prompt source: a Hydra ``_target_`` class implementing ``toolkit.rollout.prompts.PromptSource``."""
    max_tokens: int = 256
    """Generation budget of one turn."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling."""
    tokenizer: Any = None
    """For text prompts and ``rollout.decode_responses``: null, a path to a ``tokenizer.json`` (HF
    ``tokenizers`` library), or a Hydra ``_target_`` with ``encode``/``decode`` (``toolkit/rollout/tokenizer.py``).
    With ``agent``: the model's directory (tokenizer files and chat template), or ``tiny``."""
    agent: dict[str, Any] = field(default_factory=dict)
    """Agents over HTTP instead of ``env``: a Hydra ``_target_`` of ``async def solve(base_url, task) ->
    reward`` (extra keys are bound as keyword arguments), run once per session against the rank's
    gateway (``toolkit/gateway``); ``toolkit.rollout.agents.run_command`` starts a harness program per
    session. Empty = the in-process ``env``."""
    env_timeout_s: float | None = 600.0
    """Bound on one session's environment or agent (all its turns); past it the sample is ``failed``
    and the step goes on. null = none."""
    record_messages: bool = False
    """Agent sessions: keep the conversation as JSON in the ``messages`` column."""
    length_hint: dict[str, Any] = field(default_factory=dict)
    """A predictor of each turn's length, sent with it so a tail policy can start a turn hinted long on
    the tail group: a Hydra ``_target_`` of a ``toolkit.rollout.hints.LengthHint`` (``SimOracle``: the
    sim's plan, off by a chosen sigma, for benchmarks). Empty = no hints."""


@dataclass
class GatewayConfig:
    """The HTTP gateway each rank serves to agents (``workload.agent``; ``toolkit/gateway``)."""

    host: str | None = None
    """Address to bind; null = 127.0.0.1 with ``cluster=local``, else every interface (advertising
    the node's hostname). Like the router, it admits only the run's token when ``router.curve`` is on."""
    port: int = 0
    """0 = a free port per rank; N = port N + rank (ranks that share a node need one each)."""
    max_concurrent_requests: int = 1024
    """Requests a rank's gateway serves at once; more are answered 429 (the SDKs retry with backoff)."""
    max_body_mb: float = 32.0
    """Largest request body; larger ones are answered 413."""
    tool_parser: str = "hermes"
    """How tool calls are found in generated text (``toolkit/gateway/toolcalls.py``): hermes | none."""


@dataclass
class ReportConfig:
    log_interval_s: float = 30.0
    """When launch's output is not a terminal (a Slurm log, a pipe): a plain progress line of the running
    step this often (on a terminal the display is redrawn every second)."""
    metrics: bool = True
    """The router, every replica and every rank serve Prometheus metrics on ``/metrics``
    (``toolkit/metrics.py``); launch lists the endpoints in ``<run dir>/prometheus_targets.json`` (file_sd)."""
    trackers: list[str] = field(default_factory=list)
    """Experiment trackers that log every step report (flattened, keyed by step) with the run's config:
    ``wandb`` (needs ``pip install wandb``), ``tensorboard`` (``pip install tensorboardX``); files under
    ``<run dir>/trackers``."""
    wandb_project: str = "rollout-toolkit"
    """The W&B project of the run."""
    wandb_mode: str | None = None
    """``online``, ``offline`` (no network; ``wandb sync`` later) or ``disabled``; null = W&B's own
    setting (``WANDB_MODE``, else online)."""


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """How components start, typed by the ``cluster`` config group (its ``type`` field)."""
    engine: Any = MISSING
    """Engine backend config, chosen by the ``engine`` config group (its ``type`` field)."""
    groups: dict[str, GroupConfig] = field(default_factory=dict)
    """Engine groups by name."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    tail: TailConfig = field(default_factory=TailConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    steps: int = 2
    """Rollout steps to run."""
    sessions_per_step: int = 32
    """Sessions (prompts) per step; one Parquet row each."""
    ranks: int = 2
    """MPI rollout ranks."""
    job: str = "rollout"
    """Job name: the router shares replicas fairly between jobs."""
    seed: int = 0
    """Seeds prompts and the simulator."""
    resume: bool = False
    """Continue the run in ``hydra.run.dir`` at its first step without a step report (a fresh run if
    the directory holds none). The config must equal the stored one except for run settings
    (``toolkit/resume.py``: steps, timeouts, cluster, replica counts...)."""


@dataclass
class ConfigSchema(Config):
    """What Hydra composes against: :class:`Config` with ``groups`` untyped, because OmegaConf cannot
    assign a new mapping to a ``dict[str, GroupConfig]`` node (``+groups.mid={replicas: 1}`` and
    ``+groups.mid.replicas=1`` failed inside OmegaConf). :func:`from_dictconfig` types the groups and
    lists every bad group field."""

    groups: dict[str, Any] = field(default_factory=dict)
    """Engine groups by name (fields of :class:`GroupConfig`)."""


GROUP_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(GroupConfig)}


def typed_groups(raw: Any) -> dict[str, GroupConfig]:
    """``groups`` as :class:`GroupConfig` objects; a :class:`ConfigError` naming every bad field."""
    if not isinstance(raw, dict):
        raise ConfigError([FieldError("groups", raw, "a mapping of group name to group fields")])
    groups: dict[str, GroupConfig] = {}
    errors = []
    for name, fields in raw.items():
        fields = {} if fields is None else fields
        if not isinstance(fields, dict):
            errors.append(FieldError(f"groups.{name}", fields, f"a mapping of group fields: {', '.join(GROUP_FIELDS)}"))
            continue
        node = OmegaConf.structured(GroupConfig)
        for key, value in fields.items():
            if key not in GROUP_FIELDS:
                errors.append(FieldError(f"groups.{name}.{key}", value,
                                         f"not a group field; one of {', '.join(GROUP_FIELDS)}"))
                continue
            try:
                node = OmegaConf.merge(node, {key: value})
            except (ValidationError, ValueError):
                errors.append(FieldError(f"groups.{name}.{key}", value, f"must be {GROUP_FIELDS[key]}"))
        if not errors:
            obj = OmegaConf.to_object(node)
            assert isinstance(obj, GroupConfig)
            groups[str(name)] = obj
    if errors:
        raise ConfigError(errors)
    return groups


def register_configs() -> None:
    """The schemas the YAML in ``conf/`` builds on: the whole config, each backend's (from the
    registries beside the engine and cluster base classes) and the workload's."""
    from toolkit.cluster.base import CLUSTERS
    from toolkit.engine.base import ENGINES

    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=ConfigSchema)
    for group, registry in (("cluster", CLUSTERS), ("engine", ENGINES)):
        for name in registry.names():
            cs.store(group=group, name=f"{name}_schema", node=registry.schema(name))
    cs.store(group="workload", name="workload_schema", node=WorkloadConfig)


def engine_schema(type_name: str) -> type:
    from toolkit.engine.base import ENGINES

    return ENGINES.schema(type_name)


def cluster_schema(type_name: str) -> type:
    from toolkit.cluster.base import CLUSTERS

    return CLUSTERS.schema(type_name)


def from_dictconfig(cfg: DictConfig | dict) -> Config:
    """Turn a composed (or reloaded) config into plain dataclasses, typing ``engine`` and ``cluster``
    by their ``type``."""
    raw = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    raw = OmegaConf.to_container(raw, resolve=True)
    assert isinstance(raw, dict)
    engine_raw = raw.pop("engine", None) or {}
    cluster_raw = raw.pop("cluster", None) or {}
    groups = typed_groups(raw.pop("groups", None) or {})
    raw.pop("defaults", None)
    schema = engine_schema(str(engine_raw.get("type", "sim")))
    merged = OmegaConf.merge(OmegaConf.structured(Config), {k: v for k, v in raw.items()})
    merged.engine = OmegaConf.merge(OmegaConf.structured(schema), engine_raw)
    merged.cluster = OmegaConf.merge(OmegaConf.structured(cluster_schema(str(cluster_raw.get("type", "local")))),
                                     cluster_raw)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, Config)
    obj.groups = groups
    return obj


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose_config(overrides: list[str] | None = None) -> Config:
    """The config ``launch`` gets for these overrides (composed from ``conf/``; not yet validated)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return from_dictconfig(compose(config_name="config", overrides=overrides or []))


def group_engine(cfg: Config, group: str) -> Any:
    """The engine config of one group: ``engine`` with the group's overrides applied."""
    return dataclasses.replace(cfg.engine, **cfg.groups[group].engine)


def replica_devices(cfg: Config, group: str) -> int:
    """Devices one replica of ``group`` uses: vLLM's tensor x pipeline parallel size (1 for the sim)."""
    e = group_engine(cfg, group)
    return int(getattr(e, "tensor_parallel_size", 1)) * int(getattr(e, "pipeline_parallel_size", 1))


def replica_shape(cfg: Config, group: str) -> tuple[int, int] | None:
    """``(devices per node, nodes)`` of one replica of ``group`` as ``cluster.gpus_per_node`` places it;
    None when it does not (``gpus_per_node`` 0) or cannot (devices not a multiple of it)."""
    per_node = cfg.cluster.gpus_per_node
    devices = replica_devices(cfg, group)
    if per_node <= 0 or (devices > per_node and devices % per_node):
        return None
    return (devices, 1) if devices <= per_node else (per_node, devices // per_node)


def replica_nodes(cfg: Config, group: str) -> int:
    """Node ranks (processes that meet through a master address) of one replica of ``group``."""
    if isinstance(cfg.cluster, SlurmClusterConfig):
        return replica_resources(cfg, group).nodes
    shape = replica_shape(cfg, group)
    return shape[1] if shape else 1


def replica_resources(cfg: Config, group: str) -> ReplicaResources:
    """What one replica of ``group`` asks Slurm for: ``cluster.replica`` with the group's overrides; with
    ``cluster.gpus_per_node``, GPUs per node and nodes follow the group's tensor x pipeline parallel size
    (validation refuses explicit values that disagree)."""
    assert isinstance(cfg.cluster, SlurmClusterConfig)
    res = dataclasses.replace(cfg.cluster.replica, **cfg.cluster.group_resources.get(group, {}))
    shape = replica_shape(cfg, group) if isinstance(group_engine(cfg, group), VllmEngineConfig) else None
    if shape is not None:
        res = dataclasses.replace(res, gpus=shape[0], nodes=shape[1])
    return res


def save_run_config(cfg: Config, path: Path) -> None:
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def load_run_config(run_dir: str | Path) -> Config:
    """Reload the validated config that ``launch`` wrote into the run directory."""
    return from_dictconfig(OmegaConf.load(Path(run_dir) / "config.yaml"))
