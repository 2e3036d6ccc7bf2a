"""What each backend takes: the cluster backends' settings (``cluster``), the engine backends'
(``engine``) and an engine group's (``groups.<name>``). The registries beside each base class
(``toolkit/cluster/base.py``, ``toolkit/engine/base.py``) name these schemas by ``type``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from toolkit.config.constraints import Choice, bounded, matching, overrides
from toolkit.core.registry import Backend, Registry

MEM = r"^[0-9]+[KMGT]?$"
"""Memory the way sbatch's ``--mem`` takes it (megabytes without a suffix)."""
MEM_WORDS = "sbatch memory, e.g. 512M or 4G"


@dataclass
class ClusterConfig:
    type: str = "local"
    """Cluster backend: ``local`` (submitit LocalExecutor + mpiexec), ``slurm`` (submitit SlurmExecutor
    from a login node) or ``allocation`` (srun steps inside an sbatch allocation, see ``slurm/``)."""
    ready_timeout_s: float = bounded(120.0, gt=0)
    """How long to wait for the router and every replica to be ready before failing the run."""
    job_timeout_min: int = bounded(24 * 60, ge=1, note="(minutes)")
    """Wall-clock limit of each component job (submitit ``timeout_min``)."""
    mpiexec: str | None = None
    """``mpiexec`` to start the ranks with; default: the one beside the running Python (mpich wheel)."""
    restart_replicas: bool = True
    """Start a replacement when a replica process dies during the run."""
    boot_retries: int = bounded(1, ge=0)
    """Times launch starts a replica again that ended before the run was first ready (a bad node, a
    node lost while it booted), each time reporting why; each try gets ``ready_timeout_s``. Past that
    the run fails with the last one's log and output: a config error fails every try (0: the first
    failure fails the run). Per replica."""
    restart_router: bool = True
    """Start a new router when the router dies; clients and replicas follow it and resend."""
    lease_s: float = bounded(60.0, ge=1, note="(seconds)")
    """Every component exits when launch has not renewed its lease (``<run dir>/lease.json``) for this
    long: the jobs of a launch that was killed end (``toolkit/core/lease.py``)."""
    gpus_per_node: int = bounded(0, ge=0)
    """Devices of one node (GPUs; on vLLM's CPU build, engine worker processes). 0: every replica fits on
    one node (``cluster.replica.nodes`` says otherwise on Slurm). N: a replica whose tensor x pipeline
    parallel size W is larger than N spans W / N nodes (W must be a multiple of N), one node rank per
    node, each with N devices; ``allocation`` also packs smaller replicas onto nodes by it. Locally, each
    node rank is its own process, and they meet only through the master address."""
    signal_grace_s: int = bounded(180, ge=0, note="(seconds)")
    """On SIGUSR1 (the sbatch templates have Slurm send it this many seconds before the time limit,
    ``--signal=B:USR1@N``) launch finishes the step in flight if it can in this time less a teardown
    margin, else abandons it; it stops every component and, inside an sbatch job, requeues the job,
    which resumes."""


@dataclass
class ReplicaResources:
    """What one engine replica asks Slurm for."""

    gpus: int = bounded(0, ge=0)
    """GPUs per node of one replica; 0 for a CPU engine such as ``sim``."""
    nodes: int = bounded(1, ge=1)
    """Nodes one replica spans (vLLM multi-node: each node gets its node rank and the master address)."""
    cpus: int = bounded(1, ge=1)
    """CPUs per node of one replica."""
    mem: str = matching("2G", MEM, MEM_WORDS)
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
    """Python that the jobs run, as a command's words (``apptainer exec /shared/img.sif python``); null = the
    interpreter running ``launch``."""
    replica: ReplicaResources = field(default_factory=ReplicaResources)
    """Resources of one replica of every group."""
    group_resources: dict[str, dict[str, Any]] = overrides("cluster.replica", keyed=True)
    """Per-group overrides of ``replica``, e.g. ``{tail: {gpus: 2}}``."""
    router_cpus: int = bounded(1, ge=1)
    """CPUs of the router job (a CPU job)."""
    router_mem: str = matching("1G", MEM, MEM_WORDS)
    """Memory of the router job."""
    rank_cpus: int = bounded(1, ge=1)
    """CPUs of each rollout rank."""
    rank_mem: str = matching("1G", MEM, MEM_WORDS)
    """Memory of each rollout rank."""
    ranks_per_node: int | None = bounded(None, ge=1)
    """Rollout ranks on one node; null = all ranks on one node."""
    mpi: str = "pmi2"
    """``srun --mpi`` plugin that wires the ranks into one MPI world (pmi2 works with the mpich wheel)."""
    cache_dir: str | None = matching(None, r"^/", "an absolute path on a shared file system")
    """Shared compile-cache dir (vLLM, Triton, TorchInductor), so a replaced or added replica starts
    warm; null = ``<run dir>/cache``. Must be on a file system every node sees."""
    shared_fs_check: bool = True
    """Refuse a run dir (or cache dir) on node-local storage (see ``toolkit/cluster/slurm.py``); turn
    off only where every component runs on one node."""
    poll_s: float = bounded(1.0, gt=0)
    """Interval of the ``squeue``/``sacct`` queries that watch the jobs."""


@dataclass
class SimEngineConfig:
    """A simulator of a continuous-batching engine (see ``toolkit/engine/sim.py``): not a model."""

    receives_kv: ClassVar[bool] = True
    """A moved request's KV can travel into this engine (``tail.move=kv``): the sim models the link."""
    type: str = "sim"
    """Engine backend: ``sim``."""
    model: str = "sim-8b"
    """Name reported to the router; requests without a job are grouped under it."""
    time_scale: float = bounded(1.0, gt=0)
    """Multiplies every simulated duration: 1.0 runs in modelled real time, 0.1 ten times faster."""
    weight_bytes: float = bounded(16e9, gt=0)
    """Bytes of weights read per decode step: an 8B-parameter model in bf16."""
    hbm_bandwidth: float = bounded(4.3e12, gt=0)
    """Bytes/s of device memory: about what an H200 measures for device copies."""
    kv_bytes_per_token: int = bounded(131072, ge=1)
    """KV bytes per token: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes."""
    kv_link_bytes_per_s: float = bounded(50e9, gt=0)
    """Bytes/s at which a request's KV reaches this replica when it moves here with it
    (``tail.move=kv``): a 400 Gb/s NIC."""
    weights_link_bytes_per_s: float = bounded(50e9, gt=0)
    """Bytes/s at which a streamed weight update reaches this replica (``rollout.weights_transport=stream``:
    the sim models the link's time from the update's bytes): a 400 Gb/s NIC."""
    step_overhead_s: float = bounded(0.0004, ge=0)
    """Fixed cost of a decode step (scheduling, kernel launches, sampling)."""
    prefill_tokens_per_s: float = bounded(30000.0, gt=0)
    """Prefill throughput for uncached prompt tokens: 16 GFLOP/token at about 50% of ~1 PFLOP/s."""
    tensor_parallel_size: int = bounded(1, ge=1)
    """Divides weight and KV reads across devices (a tail group uses more)."""
    tp_efficiency: float = bounded(0.85, gt=0, le=1)
    """Fraction of the ideal tensor-parallel speedup left after all-reduce communication."""
    max_num_seqs: int = bounded(256, ge=1)
    """Sequences decoded together in one step (the engine's batch cap)."""
    max_model_len: int = bounded(8192, ge=1)
    """Longest prompt + output; a prompt of this many tokens or more is a client error (no room for one token)."""
    vocab_size: int = bounded(32000, ge=1)
    """Token ids must be below this."""
    block_size: int = bounded(16, ge=1)
    """Tokens per prefix-cache block."""
    kv_cache_tokens: int = bounded(400000, ge=1)
    """Prefix cache capacity in tokens (LRU over blocks)."""
    output_len_median: float = bounded(180.0, gt=0)
    """Median of the lognormal natural output length, in tokens, before ``max_tokens`` cuts it."""
    output_len_sigma: float = bounded(1.0, ge=0)
    """Sigma of that lognormal: 1.0 puts p99 at ~10x the median (a heavy tail)."""
    output_len_session_share: float = bounded(0.0, ge=0, le=1)
    """Share of the log-length variance the turns of one session have in common (0 = independent
    turns; a hard task makes every turn of its session long)."""
    output_len_prompt_share: float = bounded(0.0, ge=0, le=1)
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
    fault_kv_gap_batch: int | None = None
    """Test hook: its replica's KV events batch of this number (``KvEvents.seq``) is lost on the way."""


class CpuAllocator(Choice):
    """``engine.cpu_allocator``."""

    auto = "auto"
    tcmalloc = "tcmalloc"
    system = "system"


@dataclass
class VllmEngineConfig:
    """vLLM's AsyncLLM in the replica process (see ``toolkit/engine/vllm.py``): token ids in and out."""

    receives_kv: ClassVar[bool] = False
    """No KV connector is wired to receive a moved request's KV: moves into vLLM recompute."""
    type: str = "vllm"
    """Engine backend: ``vllm``."""
    model: str = matching("tiny", "(?s).", "a model directory, or tiny (the built-in test model)")
    """Model directory on the shared file system (or a hub name where a hub is reachable). ``tiny`` is
    the built-in random-weight test model (``toolkit/model/tiny.py``), built into ``cache_dir`` on first use."""
    cache_dir: str = matching("~/.cache/rollout-toolkit", "(?s).", "a directory")
    """Where ``model: tiny`` is built (once; replicas that start together wait on a file lock)."""
    max_model_len: int = bounded(1024, ge=1)
    """Longest prompt + output (vLLM ``max_model_len``); the replica reports the engine's own value to the router."""
    vocab_size: int = bounded(512, ge=1)
    """The model's vocabulary size, for workloads that make token ids (``${engine.vocab_size}``); the
    router checks prompts against the value the engine reports."""
    tensor_parallel_size: int = bounded(1, ge=1)
    """Devices per replica (vLLM ``tensor_parallel_size``); on vLLM's CPU build the replica's CPUs are
    split between the workers."""
    pipeline_parallel_size: int = bounded(1, ge=1)
    """Pipeline stages per replica (vLLM ``pipeline_parallel_size``): a replica has tensor x pipeline
    parallel devices, across nodes when that is more than ``cluster.gpus_per_node``."""
    kv_cache_gib: float | None = bounded(None, gt=0)
    """KV cache per replica in GiB (vLLM ``kv_cache_memory_bytes``); null = vLLM's own sizing
    (``gpu_memory_utilization`` on GPUs, ``VLLM_CPU_KVCACHE_SPACE`` or 4 GiB on CPUs)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Every other engine argument, passed through to vLLM's ``AsyncEngineArgs`` as is: ``dtype``,
    ``max_num_seqs``, ``enable_prefix_caching``, ``block_size``, ``enforce_eager``, ``enable_lora``,
    ``max_lora_rank``, ``max_loras``, ``seed``, ... (``engine.args.max_num_seqs=128`` on the command line)."""
    max_restarts: int = bounded(2, ge=0)
    """Engine restarts a replica makes after engine deaths; at the next death the replica process exits
    and the cluster backend replaces it."""
    cpu_engine_nice: int = bounded(10, ge=0, le=19)
    """On vLLM's CPU build only: niceness added to the engine processes. Their worker threads spin on
    every core they have; lowered, they leave the replica process (its heartbeats, the router's
    messages, vLLM's output handling) the CPU it needs, as a GPU engine does. 0 = as they are."""
    cpu_allocator: CpuAllocator = CpuAllocator.auto
    """On vLLM's CPU build only: the engine processes' memory allocator. ``auto``: TCMalloc where the node
    has it (Debian/Ubuntu ``libtcmalloc-minimal4``), as vLLM's CPU guide advises (docs/engines.md has what
    it saves), else the system's with a warning; ``tcmalloc``: a replica on a node without it fails at
    start; ``system``: glibc's. An allocator already in ``LD_PRELOAD`` stays."""
    adapter_poll_s: float = bounded(0.5, gt=0)
    """How often a request whose LoRA adapter directory has no ``adapter_config.json`` yet looks again."""
    adapter_wait_s: float = bounded(600.0, ge=0)
    """How long a request without a deadline waits for its adapter before failing as ``adapter_missing``."""
    adapter_margin_s: float = bounded(1.0, ge=0)
    """A request whose adapter is still missing fails this long before its deadline, so that the
    ``adapter_missing`` answer reaches the router before the router times the request out."""


# Engine arguments that have their own field above (the field wins; one place to set each).
VLLM_OWN_ARGS = ("model", "max_model_len", "tensor_parallel_size", "pipeline_parallel_size", "kv_cache_memory_bytes",
                 "disable_log_stats", "nnodes", "node_rank", "master_addr", "master_port")


@dataclass
class GroupConfig:
    replicas: int = bounded(1, ge=1)
    """Number of engine replicas in this group."""
    max_inflight: int = bounded(64, ge=1)
    """Requests the router keeps in flight on one replica at most; the rest wait in the router."""
    labels: dict[str, str] = field(default_factory=dict)
    """Extra labels the replicas register with (``group`` is always set)."""
    engine: dict[str, Any] = overrides("engine")
    """Overrides of ``engine.*`` fields for this group (e.g. ``tensor_parallel_size: 2``)."""


ENGINES = Registry("engine", {
    "sim": Backend("toolkit.config.backends:SimEngineConfig", "toolkit.engine.sim:SimEngine",
                   "toolkit.engine.sim_checks:check"),
    "vllm": Backend("toolkit.config.backends:VllmEngineConfig", "toolkit.engine.vllm:VllmEngine",
                    "toolkit.engine.vllm_checks:check"),
})
"""Engine backends by ``engine.type``."""

CLUSTERS = Registry("cluster", {
    "local": Backend("toolkit.config.backends:ClusterConfig", "toolkit.cluster.local:LocalCluster",
                     "toolkit.cluster.local:check_local"),
    "slurm": Backend("toolkit.config.backends:SlurmClusterConfig", "toolkit.cluster.slurm:SlurmCluster",
                     "toolkit.cluster.slurm_checks:check_slurm"),
    "allocation": Backend("toolkit.config.backends:SlurmClusterConfig", "toolkit.cluster.allocation:AllocationCluster",
                          "toolkit.cluster.slurm_checks:check_allocation"),
})
"""Cluster backends by ``cluster.type``."""
