"""Structured configs, registered in Hydra's ConfigStore.

YAML under ``conf/`` picks defaults; these dataclasses give every field a type and a docstring.
The entry point converts Hydra's DictConfig to these plain objects once (:func:`from_dictconfig`),
validates them (:func:`toolkit.launch.validation.validate`, every error at once) and writes ``config.yaml``
into the run directory, from which every other process reloads the same objects (:func:`load_run_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import MISSING, DictConfig, OmegaConf

from toolkit.config.backends import (
    CLUSTERS,
    ENGINES,
    VLLM_OWN_ARGS,
    Backend,
    ClusterConfig,
    CpuAllocator,
    GroupConfig,
    ReplicaResources,
    SimEngineConfig,
    SlurmClusterConfig,
    VllmEngineConfig,
)
from toolkit.config.constraints import Choice, bounded, field_errors, matching, nonempty, typed_fields
from toolkit.config.sections import (
    Affinity,
    CloseMode,
    DeltaMode,
    GatewayConfig,
    GroupFilter,
    Move,
    Output,
    QueueOrder,
    ReportConfig,
    RolloutConfig,
    RouterConfig,
    RouterPolicyName,
    StaleAction,
    TailConfig,
    TailPolicyName,
    ToolParser,
    UpdateMode,
    WandbMode,
    WeightsConfig,
    WeightsTransport,
    WorkloadConfig,
    flip_count,
)
from toolkit.core.errors import ConfigError, FieldError, ToolkitError
from toolkit.core.rundir import RunDir, atomic_write

__all__ = [
    "CONF_DIR", "VLLM_OWN_ARGS", "Affinity", "Backend", "Choice", "CloseMode", "ClusterConfig", "Config", "ConfigError",
    "ConfigSchema", "CpuAllocator", "DeltaMode", "GatewayConfig", "GroupConfig", "GroupFilter", "Move", "Output", "QueueOrder", "ReplicaResources",
    "ReportConfig", "RolloutConfig", "RouterConfig", "RouterPolicyName", "SimEngineConfig",
    "SlurmClusterConfig", "StaleAction", "TailConfig", "TailPolicyName", "ToolParser", "UpdateMode", "VllmEngineConfig",
    "WandbMode", "WeightsConfig", "WeightsTransport", "WorkloadConfig", "compose_config", "engine_variants", "field_errors", "flip_count",
    "from_dictconfig", "group_engine", "kv_budget", "kv_events_on", "load_run_config", "moves_carry_kv",
    "register_configs",
    "replica_devices", "replica_nodes", "replica_resources", "replica_shape", "samples_per_prompt",
    "save_run_config",
    "typed_groups", "typing_errors",
]


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """How components start, typed by the ``cluster`` config group (its ``type`` field)."""
    engine: Any = MISSING
    """Engine backend config, chosen by the ``engine`` config group (its ``type`` field)."""
    groups: dict[str, GroupConfig] = nonempty("at least one engine group")
    """Engine groups by name."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """What a session runs: prompts, environment or agent, sampling (the ``workload`` config group)."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """How the router binds, queues and places requests."""
    tail: TailConfig = field(default_factory=TailConfig)
    """Tail routing: which requests go to the fast tail group, and when."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """How the ranks run a step's sessions, write its samples and wait for weights."""
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    """How a trainer streams its weights (``rollout.weights_transport=stream``)."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The ranks' HTTP gateway for agents (``workload.agent``)."""
    report: ReportConfig = field(default_factory=ReportConfig)
    """The step report, its console line and the trackers it feeds."""
    steps: int = bounded(2, ge=1)
    """Rollout steps to run."""
    sessions_per_step: int = bounded(32, ge=1)
    """Sessions (prompts) per step; one Parquet row each."""
    ranks: int = bounded(2, ge=1)
    """MPI rollout ranks."""
    job: str = matching("rollout", r"^[^/]+$", "a non-empty name without '/'")
    """Job name: the router shares replicas fairly between jobs."""
    seed: int = bounded(0, ge=0, lt=2**63)
    """Seeds prompts and the simulator."""
    resume: bool = False
    """Continue the run in ``hydra.run.dir`` at its first step without a step report (a fresh run if
    the directory holds none). The config must equal the stored one except for run settings
    (``toolkit/launch/resume.py``: steps, timeouts, cluster, replica counts...)."""


@dataclass
class ConfigSchema(Config):
    """What Hydra composes against: :class:`Config` with ``groups`` untyped, because OmegaConf cannot
    assign a new mapping to a ``dict[str, GroupConfig]`` node (``+groups.mid={replicas: 1}`` and
    ``+groups.mid.replicas=1`` failed inside OmegaConf). :func:`from_dictconfig` types the groups and
    lists every bad group field."""

    groups: dict[str, Any] = field(default_factory=dict)
    """Engine groups by name (fields of :class:`GroupConfig`)."""


GROUP_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(GroupConfig)}


def typed_groups(raw: Any) -> tuple[dict[str, GroupConfig], list[FieldError]]:
    """``groups`` as :class:`GroupConfig` objects (each from its good fields), and every bad field."""
    if not isinstance(raw, dict):
        return {}, [FieldError("groups", raw, "a mapping of group name to group fields")]
    groups: dict[str, GroupConfig] = {}
    errors = []
    for name, fields in raw.items():
        if fields is None:  # not a removal: that is Hydra's ~groups.<name>
            errors.append(FieldError(f"groups.{name}", None, f"a mapping of group fields (to remove the group: "
                                     f"~groups.{name})"))
            continue
        if not isinstance(fields, dict):
            errors.append(FieldError(f"groups.{name}", fields, f"a mapping of group fields: {', '.join(GROUP_FIELDS)}"))
            continue
        errors += [FieldError(f"groups.{name}.{key}", value, f"not a group field; one of {', '.join(GROUP_FIELDS)}")
                   for key, value in fields.items() if key not in GROUP_FIELDS]
        obj, bad = typed_fields(GroupConfig(), {k: v for k, v in fields.items() if k in GROUP_FIELDS}, f"groups.{name}")
        assert isinstance(obj, GroupConfig)
        errors += bad
        groups[str(name)] = obj
    return groups, errors


def register_configs() -> None:
    """The schemas the YAML in ``conf/`` builds on: the whole config, each backend's (from the
    registries beside the engine and cluster base classes) and the workload's. Once per process: a store
    that holds them already is left as it is (storing converts every schema to OmegaConf again)."""
    cs = ConfigStore.instance()
    if "config_schema.yaml" in cs.repo:
        return
    cs.store(name="config_schema", node=ConfigSchema)
    for group, registry in (("cluster", CLUSTERS), ("engine", ENGINES)):
        for name in registry.names():
            cs.store(group=group, name=f"{name}_schema", node=registry.schema(name))
    cs.store(group="workload", name="workload_schema", node=WorkloadConfig)


def engine_schema(type_name: str) -> type:
    return ENGINES.schema(type_name)


def cluster_schema(type_name: str) -> type:
    return CLUSTERS.schema(type_name)


def from_dictconfig(cfg: DictConfig | dict) -> Config:
    """Turn a composed (or reloaded) config into plain dataclasses, typing ``engine`` and ``cluster``
    by their ``type``."""
    raw = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    raw = OmegaConf.to_container(raw, resolve=True)
    assert isinstance(raw, dict)
    engine_raw = raw.pop("engine", None) or {}
    cluster_raw = raw.pop("cluster", None) or {}
    groups, group_errors = typed_groups(raw.pop("groups", None) or {})
    raw.pop("defaults", None)
    schema = engine_schema(str(engine_raw.get("type", "sim")))
    merged = OmegaConf.merge(OmegaConf.structured(Config), {k: v for k, v in raw.items()})
    merged.engine = OmegaConf.merge(OmegaConf.structured(schema), engine_raw)
    merged.cluster = OmegaConf.merge(OmegaConf.structured(cluster_schema(str(cluster_raw.get("type", "local")))),
                                     cluster_raw)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, Config)
    obj.groups = groups
    setattr(obj, _UNTYPED, group_errors)
    return obj


_UNTYPED = "_untyped_group_fields"


def typing_errors(cfg: Config) -> list[FieldError]:
    """The group fields :func:`from_dictconfig` could not type (each group was built from its others):
    validation lists them with every other error."""
    return list(getattr(cfg, _UNTYPED, ()))


CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_config(overrides: list[str] | None = None) -> Config:
    """The config ``launch`` gets for these overrides (composed from ``conf/``; not yet validated)."""
    register_configs()
    if GlobalHydra.instance().is_initialized():  # inside a Hydra app (``toolkit.plan``'s replay): its loader
        return from_dictconfig(compose(config_name="config", overrides=overrides or []))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return from_dictconfig(compose(config_name="config", overrides=overrides or []))


def group_engine(cfg: Config, group: str) -> Any:
    """The engine config of one group: ``engine`` with the group's overrides applied."""
    return dataclasses.replace(cfg.engine, **cfg.groups[group].engine)


def engine_variants(cfg: Config) -> list[tuple[str, Any, set[str]]]:
    """The engine and every group's version of it (``groups.<g>.engine`` overrides), each with its path and
    the fields it sets: a group's version is checked only on the fields it overrides. A group that names a
    field the engine does not have has no version (the walker reports the field)."""
    names = {f.name for f in dataclasses.fields(cfg.engine)} - {"type"}
    variants: list[tuple[str, Any, set[str]]] = [("engine", cfg.engine, names)]
    for name, group in cfg.groups.items():
        known = {k: v for k, v in group.engine.items() if k in names}  # (the walker reports the others)
        if known:
            variants.append((f"groups.{name}.engine", dataclasses.replace(cfg.engine, **known), set(known)))
    return variants


def moves_carry_kv(cfg: Config) -> bool:
    """A moving request's KV travels with it (``tail.move``): ``kv``, or ``auto`` where every group's
    engine can receive it (its config's ``receives_kv``)."""
    return cfg.tail.move == "kv" or (cfg.tail.move == "auto"
                                     and all(group_engine(cfg, g).receives_kv for g in cfg.groups))


def kv_events_on(cfg: Config) -> bool:
    """Replicas report their engines' KV events to the router: its policy routes on them (``kv_aware``)."""
    return cfg.router.policy == RouterPolicyName.kv_aware


def kv_budget(cfg: Config) -> float | None:
    """``router.kv_budget`` in force: its value, else 0.9 with ``kv_aware`` and none (None) otherwise."""
    if cfg.router.kv_budget is not None:
        return float(cfg.router.kv_budget)
    return 0.9 if kv_events_on(cfg) else None


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
    # Atomic: a resume killed while writing it must not leave a torn file, which would load as defaults.
    atomic_write(path, OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def load_run_config(run_dir: str | Path) -> Config:
    """Reload the validated config that ``launch`` wrote into the run directory."""
    path = RunDir(Path(run_dir)).config
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as exc:  # cut inside a line: no longer YAML at all
        raise ToolkitError(f"{path} is not a whole run config (torn, or not written by launch): it is not "
                           f"YAML ({str(exc).splitlines()[0]})") from exc
    # launch writes every field: one missing means a torn or foreign file, which would load as defaults.
    missing = sorted(f.name for f in dataclasses.fields(Config) if not isinstance(raw, DictConfig) or f.name not in raw)
    if missing:
        raise ToolkitError(f"{path} is not a whole run config (torn, or not written by launch): it lacks "
                           f"{', '.join(missing)}")
    return from_dictconfig(raw)


def curve_enabled(cfg: Config) -> bool:
    """``router.curve``, or by default: on for Slurm clusters, off for ``cluster=local``."""
    if cfg.router.curve is not None:
        return cfg.router.curve
    return cfg.cluster.type != "local"


def samples_per_prompt(cfg: Config) -> int:
    """The workload's GRPO group size (``workload.prompts.samples_per_prompt``; 1 if it has none)."""
    n = cfg.workload.prompts.get("samples_per_prompt", 1) if cfg.workload.prompts else 1
    return n if isinstance(n, int) and n >= 1 else 1
