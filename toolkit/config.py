"""Structured configs, registered in Hydra's ConfigStore, and the one place they are validated.

YAML under ``conf/`` picks defaults; these dataclasses give every field a type and a docstring.
The entry point converts Hydra's DictConfig to these plain objects once (:func:`from_dictconfig`),
validates them (:func:`validate`) and writes ``config.yaml`` into the run directory, from which
every other process reloads the same objects (:func:`load_run_config`).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from toolkit.errors import ConfigError, FieldError

POLICIES = ("consistent_hash", "least_loaded", "power_of_two", "round_robin")
QUEUES = ("fair", "fifo")
CLUSTERS = ("local",)
OUTPUTS = ("gather",)


@dataclass
class ClusterConfig:
    type: str = "local"
    """Cluster backend: ``local`` (submitit LocalExecutor + mpiexec)."""
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
    fault_crash_token: int | None = None
    """Test hook: the replica process dies (exit 70) when it schedules a prompt holding this token id."""
    fault_hang_token: int | None = None
    """Test hook: the engine stops generating (heartbeats go on) once it schedules a prompt holding it."""


ENGINE_TYPES: dict[str, type] = {"sim": SimEngineConfig}


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
    host: str = "127.0.0.1"
    """Address the router binds its two sockets on (ports are picked free)."""
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


@dataclass
class TailConfig:
    threshold: float | None = None
    """Fraction of a step's sessions done at which the rest of the step flips to ``group``; null = off."""
    group: str = "tail"
    """The fast group that serves a step after its flip."""
    migrate_inflight: bool = False
    """At the flip, abort the step's requests running outside the tail group and continue them on
    it from where they stopped (prompt + tokens so far, remaining budget), keeping tokens and logprobs."""


@dataclass
class RolloutConfig:
    max_concurrent_rollouts: int | None = None
    """Cap on a step's sessions in flight across all ranks; null = all at once."""
    output: str = "gather"
    """``gather``: rank 0 writes one Parquet file per step."""
    request_timeout_s: float = 600.0
    """Deadline of each generation request, counted from its submission."""


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


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    engine: Any = MISSING
    """Engine backend config, chosen by the ``engine`` config group (its ``type`` field)."""
    groups: dict[str, GroupConfig] = field(default_factory=dict)
    """Engine groups by name."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    tail: TailConfig = field(default_factory=TailConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
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


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(group="cluster", name="local_schema", node=ClusterConfig)
    cs.store(group="engine", name="sim_schema", node=SimEngineConfig)
    cs.store(group="workload", name="workload_schema", node=WorkloadConfig)


def engine_schema(type_name: str) -> type:
    try:
        return ENGINE_TYPES[type_name]
    except KeyError:
        raise ConfigError(
            [FieldError("engine.type", type_name, f"one of {sorted(ENGINE_TYPES)}")]
        ) from None


def from_dictconfig(cfg: DictConfig | dict) -> Config:
    """Turn a composed (or reloaded) config into plain dataclasses, typing ``engine`` by its ``type``."""
    raw = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    raw = OmegaConf.to_container(raw, resolve=True)
    assert isinstance(raw, dict)
    engine_raw = raw.pop("engine", None) or {}
    raw.pop("defaults", None)
    schema = engine_schema(str(engine_raw.get("type", "sim")))
    merged = OmegaConf.merge(OmegaConf.structured(Config), {k: v for k, v in raw.items()})
    merged.engine = OmegaConf.merge(OmegaConf.structured(schema), engine_raw)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, Config)
    return obj


def group_engine(cfg: Config, group: str) -> Any:
    """The engine config of one group: ``engine`` with the group's overrides applied."""
    return dataclasses.replace(cfg.engine, **cfg.groups[group].engine)


def _check_target(path: str, spec: dict[str, Any], errors: list[FieldError]) -> None:
    target = spec.get("_target_")
    if not target or not isinstance(target, str) or "." not in target:
        errors.append(FieldError(f"{path}._target_", target, "a dotted path to a class, e.g. pkg.module.Class"))
        return
    module, _, name = target.rpartition(".")
    try:
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        errors.append(FieldError(f"{path}._target_", target, f"an importable class ({exc})"))


def validate(cfg: Config) -> None:
    """Check everything that can be checked before anything starts; raise one ConfigError listing all."""
    errors: list[FieldError] = []

    def need(ok: bool, name: str, value: object, allowed: str) -> None:
        if not ok:
            errors.append(FieldError(name, value, allowed))

    need(cfg.cluster.type in CLUSTERS, "cluster.type", cfg.cluster.type, f"one of {list(CLUSTERS)}")
    need(cfg.cluster.ready_timeout_s > 0, "cluster.ready_timeout_s", cfg.cluster.ready_timeout_s, "> 0")
    need(cfg.steps >= 1, "steps", cfg.steps, "an integer >= 1")
    need(cfg.sessions_per_step >= 1, "sessions_per_step", cfg.sessions_per_step, "an integer >= 1")
    need(cfg.ranks >= 1, "ranks", cfg.ranks, "an integer >= 1")
    need(bool(cfg.job) and "/" not in cfg.job, "job", cfg.job, "a non-empty name without '/'")

    need(cfg.router.policy in POLICIES, "router.policy", cfg.router.policy, f"one of {list(POLICIES)}")
    need(cfg.router.load_factor >= 1.0, "router.load_factor", cfg.router.load_factor, ">= 1.0")
    need(cfg.router.heartbeat_s > 0, "router.heartbeat_s", cfg.router.heartbeat_s, "> 0")
    need(cfg.router.missed_heartbeats >= 1, "router.missed_heartbeats", cfg.router.missed_heartbeats, ">= 1")
    need(cfg.router.max_engine_deaths >= 1, "router.max_engine_deaths", cfg.router.max_engine_deaths, ">= 1")
    need(cfg.router.suspects_per_replica >= 1, "router.suspects_per_replica", cfg.router.suspects_per_replica,
         "an integer >= 1")
    need(cfg.router.stall_timeout_s > 0, "router.stall_timeout_s", cfg.router.stall_timeout_s, "> 0")
    need(cfg.router.queue in QUEUES, "router.queue", cfg.router.queue, f"one of {list(QUEUES)}")

    need(bool(cfg.groups), "groups", dict(cfg.groups), "at least one engine group")
    engine_fields = {f.name for f in dataclasses.fields(cfg.engine)} - {"type"}
    for name, group in cfg.groups.items():
        need(group.replicas >= 1, f"groups.{name}.replicas", group.replicas, "an integer >= 1")
        need(group.max_inflight >= 1, f"groups.{name}.max_inflight", group.max_inflight, "an integer >= 1")
        for key in group.engine:
            need(key in engine_fields, f"groups.{name}.engine.{key}", group.engine[key],
                 f"a field of engine '{cfg.engine.type}': {sorted(engine_fields)}")
    _validate_engine(cfg, errors)

    threshold = cfg.tail.threshold
    if threshold is not None:
        need(0 < threshold <= 1, "tail.threshold", threshold, "a fraction in (0, 1], or null to turn tail routing off")
        if cfg.tail.group not in cfg.groups:
            errors.append(FieldError("tail.group", cfg.tail.group, f"one of the defined groups {sorted(cfg.groups)}"))
        elif cfg.groups[cfg.tail.group].replicas < 1:
            errors.append(FieldError(f"groups.{cfg.tail.group}.replicas", cfg.groups[cfg.tail.group].replicas,
                                     "the tail group needs at least one replica"))
        need(len(set(cfg.groups) - {cfg.tail.group}) >= 1, "groups", sorted(cfg.groups),
             "a group besides the tail group, to serve the step before the flip")

    mcr = cfg.rollout.max_concurrent_rollouts
    need(mcr is None or mcr >= 1, "rollout.max_concurrent_rollouts", mcr, "an integer >= 1, or null")
    need(cfg.rollout.output in OUTPUTS, "rollout.output", cfg.rollout.output, f"one of {list(OUTPUTS)}")
    need(cfg.rollout.request_timeout_s > 0, "rollout.request_timeout_s", cfg.rollout.request_timeout_s, "> 0")

    need(cfg.workload.max_tokens >= 1, "workload.max_tokens", cfg.workload.max_tokens, "an integer >= 1")
    need(cfg.workload.temperature >= 0, "workload.temperature", cfg.workload.temperature, ">= 0")
    need(0 < cfg.workload.top_p <= 1, "workload.top_p", cfg.workload.top_p, "in (0, 1]")
    _check_target("workload.env", cfg.workload.env, errors)
    _check_target("workload.prompts", cfg.workload.prompts, errors)

    if errors:
        raise ConfigError(errors)


def _validate_engine(cfg: Config, errors: list[FieldError]) -> None:
    if not isinstance(cfg.engine, SimEngineConfig):
        return
    e = cfg.engine
    positive = ("time_scale", "weight_bytes", "hbm_bandwidth", "prefill_tokens_per_s", "output_len_median")
    for name in positive:
        if not getattr(e, name) > 0:
            errors.append(FieldError(f"engine.{name}", getattr(e, name), "> 0"))
    for name in ("max_num_seqs", "max_model_len", "vocab_size", "block_size", "tensor_parallel_size"):
        if not getattr(e, name) >= 1:
            errors.append(FieldError(f"engine.{name}", getattr(e, name), "an integer >= 1"))
    if not 0 < e.tp_efficiency <= 1:
        errors.append(FieldError("engine.tp_efficiency", e.tp_efficiency, "in (0, 1]"))
    if e.output_len_sigma < 0 or not math.isfinite(e.output_len_sigma):
        errors.append(FieldError("engine.output_len_sigma", e.output_len_sigma, ">= 0"))


def save_run_config(cfg: Config, path: Path) -> None:
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def load_run_config(run_dir: str | Path) -> Config:
    """Reload the validated config that ``launch`` wrote into the run directory."""
    return from_dictconfig(OmegaConf.load(Path(run_dir) / "config.yaml"))
