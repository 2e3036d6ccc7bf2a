"""The one place a config is checked before anything starts: :func:`validate` lists every bad field
with its value and what is allowed (a :class:`~toolkit.core.errors.ConfigError`), never only the first."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import math
import re
from pathlib import Path
from typing import Any

from toolkit.config import (
    CLUSTERS,
    OUTPUTS,
    QUEUES,
    UPDATE_MODES,
    VLLM_OWN_ARGS,
    Config,
    ReplicaResources,
    SimEngineConfig,
    SlurmClusterConfig,
    VllmEngineConfig,
    group_engine,
    replica_shape,
)
from toolkit.core.errors import ConfigError, FieldError
from toolkit.model.tokenizer import tokenizer_problem
from toolkit.router.policy import POLICIES
from toolkit.router.tail import MOVES, TAIL_POLICIES

logger = logging.getLogger(__name__)

# Memory the way sbatch's --mem takes it (megabytes without a suffix).
_MEM_RE = r"^[0-9]+[KMGT]?$"


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


def _check_length_hint(spec: dict[str, Any], errors: list[FieldError]) -> None:
    """A predictor is built once per rank: build it here too, so a bad one fails at setup."""
    if not spec:
        return
    before = len(errors)
    _check_target("workload.length_hint", spec, errors)
    if len(errors) > before:
        return
    from hydra.utils import instantiate

    from toolkit.rollout.hints import LengthHint

    try:
        hint = instantiate(spec)
    except Exception as exc:  # Hydra wraps what the constructor raised
        cause = exc.__cause__ or exc
        if isinstance(cause, ConfigError):
            errors.extend(cause.errors)
        else:  # the user's constructor: say what it said
            errors.append(FieldError("workload.length_hint", spec.get("_target_"), f"a predictor it can build ({cause})"))
        return
    if not isinstance(hint, LengthHint):
        errors.append(FieldError("workload.length_hint._target_", spec.get("_target_"),
                                 "a subclass of toolkit.rollout.hints.LengthHint"))
    elif inspect.iscoroutinefunction(hint.expected_tokens):
        errors.append(FieldError("workload.length_hint._target_", spec.get("_target_"),
                                 "a LengthHint whose expected_tokens is a plain def (it is asked before every "
                                 "turn, in the rank's event loop), not async def"))


def _check_workload_sources(cfg: Config, errors: list[FieldError]) -> None:
    """The tokenizer spec, and the prompt source's own argument checks (files, keys) via ``check_spec``."""
    # An agent workload's tokenizer is a model directory with a chat template (validate_agent checks it).
    why = None if cfg.workload.agent else tokenizer_problem(cfg.workload.tokenizer)
    if why is not None:
        errors.append(FieldError("workload.tokenizer", cfg.workload.tokenizer, why))
    target = cfg.workload.prompts.get("_target_")
    module, _, name = str(target).rpartition(".")
    try:
        check = getattr(getattr(importlib.import_module(module), name), "check_spec", None)
    except (ImportError, AttributeError, ValueError):
        return  # already reported by _check_target
    if callable(check):
        for key, value, allowed in check(dict(cfg.workload.prompts)):
            errors.append(FieldError(f"workload.prompts.{key}", value, allowed))


def validate(cfg: Config) -> None:
    """Check everything that can be checked before anything starts; raise one ConfigError listing all."""
    errors: list[FieldError] = []

    def need(ok: bool, name: str, value: object, allowed: str) -> None:
        if not ok:
            errors.append(FieldError(name, value, allowed))

    need(cfg.cluster.type in CLUSTERS.names(), "cluster.type", cfg.cluster.type, f"one of {CLUSTERS.names()}")
    need(cfg.cluster.ready_timeout_s > 0, "cluster.ready_timeout_s", cfg.cluster.ready_timeout_s, "> 0")
    # Renewed every lease_s / 6: below a second the shared file system would do little else.
    need(cfg.cluster.lease_s >= 1, "cluster.lease_s", cfg.cluster.lease_s, ">= 1 (seconds)")
    need(cfg.cluster.signal_grace_s >= 0, "cluster.signal_grace_s", cfg.cluster.signal_grace_s, ">= 0 (seconds)")
    _validate_placement(cfg, errors)
    if isinstance(cfg.cluster, SlurmClusterConfig):
        _validate_slurm(cfg, errors)
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
    no_replica = cfg.router.no_replica_timeout_s
    need(no_replica is None or no_replica > 0, "router.no_replica_timeout_s", no_replica, "> 0 or null")

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
    tc = cfg.tail
    need(tc.policy in TAIL_POLICIES, "tail.policy", tc.policy, f"one of {list(TAIL_POLICIES)}")
    need(0 < tc.long_quantile < 1, "tail.long_quantile", tc.long_quantile, "a fraction in (0, 1)")
    need(tc.long_tokens is None or tc.long_tokens >= 1, "tail.long_tokens", tc.long_tokens, "an integer >= 1, or null")
    need(tc.long_min_finished >= 1, "tail.long_min_finished", tc.long_min_finished, "an integer >= 1")
    need(tc.move in MOVES, "tail.move", tc.move, f"one of {list(MOVES)}")
    if tc.move == "kv":
        # Only the sim models a KV link; the vllm backend has no KV connector wired to receive one.
        others = {name: group_engine(cfg, name).type for name in cfg.groups if group_engine(cfg, name).type != "sim"}
        need(not others, "tail.move", tc.move, f"'recompute' with engines of another type than sim ({others}): "
             "they cannot receive a request's KV (no KV connector is wired)")
    need(tc.trade_margin is None or tc.trade_margin >= 0, "tail.trade_margin", tc.trade_margin,
         "an integer >= 0, or null")
    if threshold is not None:
        need(0 < threshold <= 1, "tail.threshold", threshold, "a fraction in (0, 1], or null for no flip")
    if tc.active:
        if cfg.tail.group not in cfg.groups:
            errors.append(FieldError("tail.group", cfg.tail.group, f"one of the defined groups {sorted(cfg.groups)}"))
        elif cfg.groups[cfg.tail.group].replicas < 1:
            errors.append(FieldError(f"groups.{cfg.tail.group}.replicas", cfg.groups[cfg.tail.group].replicas,
                                     "the tail group needs at least one replica"))
        need(len(set(cfg.groups) - {cfg.tail.group}) >= 1, "groups", sorted(cfg.groups),
             "a group besides the tail group, to serve the step before the flip")

    _validate_report(cfg, errors)

    mcr = cfg.rollout.max_concurrent_rollouts
    # Each rank runs at least one session at a time: a cap below the ranks would not hold.
    need(mcr is None or mcr >= max(1, cfg.ranks), "rollout.max_concurrent_rollouts", mcr,
         f"an integer >= ranks ({cfg.ranks}), or null")
    need(cfg.rollout.output in OUTPUTS, "rollout.output", cfg.rollout.output, f"one of {list(OUTPUTS)}")
    need(not cfg.rollout.decode_responses or cfg.workload.tokenizer is not None, "rollout.decode_responses",
         cfg.rollout.decode_responses, "needs workload.tokenizer (a tokenizer.json path or a `_target_`), or false")
    need(cfg.rollout.request_timeout_s > 0, "rollout.request_timeout_s", cfg.rollout.request_timeout_s, "> 0")
    mff = cfg.rollout.max_failed_fraction
    need(mff is None or 0 <= mff <= 1, "rollout.max_failed_fraction", mff, "a fraction in [0, 1], or null")
    need(cfg.rollout.update_mode in UPDATE_MODES, "rollout.update_mode", cfg.rollout.update_mode,
         f"one of {list(UPDATE_MODES)}")
    k = cfg.rollout.max_staleness
    need(k is None or k >= 0, "rollout.max_staleness", k, "an integer >= 0 (0 = on-policy), or null (never wait)")
    need(k is None or bool(cfg.rollout.weights_dir), "rollout.max_staleness", k,
         "needs rollout.weights_dir (where the trainer publishes the weights to wait for), or null")
    need(cfg.rollout.weights_timeout_s > 0, "rollout.weights_timeout_s", cfg.rollout.weights_timeout_s, "> 0")
    need(cfg.rollout.load_timeout_s > 0, "rollout.load_timeout_s", cfg.rollout.load_timeout_s, "> 0")
    need(cfg.rollout.weights_poll_s > 0, "rollout.weights_poll_s", cfg.rollout.weights_poll_s, "> 0")
    ets = cfg.workload.env_timeout_s
    need(ets is None or ets > 0, "workload.env_timeout_s", ets, "> 0, or null")
    if cfg.workload.agent:
        from toolkit.gateway.config import validate_agent

        validate_agent(cfg, errors)

    need(cfg.workload.max_tokens >= 1, "workload.max_tokens", cfg.workload.max_tokens, "an integer >= 1")
    need(cfg.workload.temperature >= 0, "workload.temperature", cfg.workload.temperature, ">= 0")
    need(0 < cfg.workload.top_p <= 1, "workload.top_p", cfg.workload.top_p, "in (0, 1]")
    if not cfg.workload.agent:
        _check_target("workload.env", cfg.workload.env, errors)
    _check_target("workload.prompts", cfg.workload.prompts, errors)
    _check_workload_sources(cfg, errors)
    if cfg.workload.agent and cfg.workload.length_hint:
        errors.append(FieldError("workload.length_hint", cfg.workload.length_hint.get("_target_"),
                                 "empty with workload.agent (an agent sends its own hint: the request's "
                                 "expected_tokens field)"))
    else:
        _check_length_hint(cfg.workload.length_hint, errors)
        _warn_unread_hints(cfg)

    if errors:
        raise ConfigError(errors)


def _warn_unread_hints(cfg: Config) -> None:
    """A predictor nothing reads is no error (a baseline arm keeps the hinted workload as it is), but it
    costs every turn a call, so say so once."""
    policy = TAIL_POLICIES.get(cfg.tail.policy)
    if cfg.workload.length_hint and policy is not None and not policy.reads_hints:
        logger.warning("workload.length_hint (%s) is set but tail.policy=%s places no turn by its hint: the ranks "
                       "ask it before every turn for nothing; tail.policy=%s read hints",
                       cfg.workload.length_hint.get("_target_"), cfg.tail.policy,
                       " or ".join(name for name, p in TAIL_POLICIES.items() if p.reads_hints))


def _validate_placement(cfg: Config, errors: list[FieldError]) -> None:
    """``cluster.gpus_per_node`` and each group's tensor x pipeline parallel size decide nodes per replica."""
    per_node = cfg.cluster.gpus_per_node
    if per_node < 0:
        errors.append(FieldError("cluster.gpus_per_node", per_node, "an integer >= 0"))
        return
    for group in cfg.groups:
        if set(cfg.groups[group].engine) - {f.name for f in dataclasses.fields(cfg.engine)}:
            continue  # unknown engine keys are reported on their own
        e = group_engine(cfg, group)
        tp, pp = getattr(e, "tensor_parallel_size", 1), getattr(e, "pipeline_parallel_size", 1)
        if tp < 1 or pp < 1:
            continue  # reported with the engine's fields
        devices = tp * pp
        if per_node and devices > per_node and devices % per_node:
            errors.append(FieldError(
                f"groups.{group}.engine", f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {devices}",
                f"a multiple of cluster.gpus_per_node = {per_node} (a replica wider than a node spans whole "
                f"nodes: {devices // per_node} or {devices // per_node + 1} nodes of {per_node}), or at most {per_node}"))
            continue
        shape = replica_shape(cfg, group)
        c = cfg.cluster
        if shape is None or not isinstance(c, SlurmClusterConfig) or not isinstance(e, VllmEngineConfig):
            continue
        over = c.group_resources.get(group, {})
        for key, derived in (("gpus", shape[0]), ("nodes", shape[1])):
            if key in over and over[key] != derived:
                errors.append(FieldError(
                    f"cluster.group_resources.{group}.{key}", over[key],
                    f"{derived} (or unset): {devices} devices on nodes of cluster.gpus_per_node = {per_node} "
                    f"are {shape[1]} node(s) of {shape[0]}"))


def _validate_slurm(cfg: Config, errors: list[FieldError]) -> None:
    c = cfg.cluster
    assert isinstance(c, SlurmClusterConfig)
    if c.type not in ("slurm", "allocation"):
        errors.append(FieldError("cluster.type", c.type, "slurm or allocation for these fields"))
    for name in ("router_cpus", "rank_cpus"):
        if getattr(c, name) < 1:
            errors.append(FieldError(f"cluster.{name}", getattr(c, name), "an integer >= 1"))
    for name in ("router_mem", "rank_mem"):
        if not re.match(_MEM_RE, str(getattr(c, name))):
            errors.append(FieldError(f"cluster.{name}", getattr(c, name), "sbatch memory, e.g. 512M or 4G"))
    if c.ranks_per_node is not None and c.ranks_per_node < 1:
        errors.append(FieldError("cluster.ranks_per_node", c.ranks_per_node, "an integer >= 1, or null"))
    if c.poll_s <= 0:
        errors.append(FieldError("cluster.poll_s", c.poll_s, "> 0"))
    if c.job_timeout_min < 1:
        errors.append(FieldError("cluster.job_timeout_min", c.job_timeout_min, "an integer >= 1 (minutes)"))
    elif c.type == "allocation" and (c.signal_grace_s >= c.job_timeout_min * 60 or c.signal_grace_s > 65535):
        # The allocation's --signal=B:USR1@N would come at the job's start (an endless requeue), or sbatch
        # refuses N above 65535. (With cluster=slurm the time limit is the components' jobs', not launch's.)
        errors.append(FieldError("cluster.signal_grace_s", c.signal_grace_s,
                                 f"below cluster.job_timeout_min = {c.job_timeout_min} min "
                                 f"({c.job_timeout_min * 60}s) and at most 65535"))
    for i, line in enumerate(c.extra_sbatch):
        if not str(line).startswith("-"):
            errors.append(FieldError(f"cluster.extra_sbatch[{i}]", line, "an sbatch option such as --reservation=rl"))
    if c.cache_dir is not None and not Path(c.cache_dir).is_absolute():
        errors.append(FieldError("cluster.cache_dir", c.cache_dir, "an absolute path on a shared file system, or null"))
    res_fields = {f.name for f in dataclasses.fields(ReplicaResources)}
    for group, over in c.group_resources.items():
        if group not in cfg.groups:
            errors.append(FieldError(f"cluster.group_resources.{group}", over, f"one of the groups {sorted(cfg.groups)}"))
        for key in over:
            if key not in res_fields:
                errors.append(FieldError(f"cluster.group_resources.{group}.{key}", over[key],
                                         f"one of {sorted(res_fields)}"))
    checks = {"gpus": (lambda v: v >= 0, "an integer >= 0"), "nodes": (lambda v: v >= 1, "an integer >= 1"),
              "cpus": (lambda v: v >= 1, "an integer >= 1"),
              "mem": (lambda v: re.match(_MEM_RE, str(v)) is not None, "sbatch memory, e.g. 512M or 4G")}
    sources = [("cluster.replica", dataclasses.asdict(c.replica))]
    sources += [(f"cluster.group_resources.{g}", over) for g, over in c.group_resources.items()]
    for prefix, values in sources:
        for key, (ok, allowed) in checks.items():
            if key in values and not ok(values[key]):
                errors.append(FieldError(f"{prefix}.{key}", values[key], allowed))
    if c.type == "allocation":
        # One allocation has one partition, and its steps end with it.
        for prefix, values in sources:
            if values.get("partition") is not None:
                errors.append(FieldError(f"{prefix}.partition", values["partition"],
                                         "null with cluster=allocation (a group's own partition needs cluster=slurm)"))
    if c.type == "allocation" and c.gpus_per_node:
        for group in cfg.groups:
            gpus = c.group_resources.get(group, {}).get("gpus", c.replica.gpus)
            if gpus > c.gpus_per_node:
                errors.append(FieldError(f"groups.{group} gpus", gpus,
                                         f"at most cluster.gpus_per_node = {c.gpus_per_node}"))


def _engine_variants(cfg: Config) -> list[tuple[str, Any, set[str]]]:
    """The engine and every group's version of it (``groups.<g>.engine`` overrides), each with the
    fields it sets: a group is checked only on the fields it overrides."""
    names = {f.name for f in dataclasses.fields(cfg.engine)}
    variants: list[tuple[str, Any, set[str]]] = [("engine", cfg.engine, names)]
    for gname, group in cfg.groups.items():
        if group.engine and set(group.engine) <= names:  # unknown keys are reported by validate()
            variants.append((f"groups.{gname}.engine", group_engine(cfg, gname), set(group.engine)))
    return variants


def _vllm_checks(e: VllmEngineConfig) -> list[tuple[str, Any, bool, str]]:
    return [
        ("model", e.model, bool(e.model), "a model directory, or tiny (the built-in test model)"),
        ("cache_dir", e.cache_dir, bool(e.cache_dir), "a directory"),
        ("max_model_len", e.max_model_len, e.max_model_len >= 1, "an integer >= 1"),
        ("vocab_size", e.vocab_size, e.vocab_size >= 1, "an integer >= 1"),
        ("tensor_parallel_size", e.tensor_parallel_size, e.tensor_parallel_size >= 1, "an integer >= 1"),
        ("pipeline_parallel_size", e.pipeline_parallel_size, e.pipeline_parallel_size >= 1, "an integer >= 1"),
        ("kv_cache_gib", e.kv_cache_gib, e.kv_cache_gib is None or e.kv_cache_gib > 0, "> 0, or null"),
        ("max_restarts", e.max_restarts, e.max_restarts >= 0, "an integer >= 0"),
        ("cpu_engine_nice", e.cpu_engine_nice, 0 <= e.cpu_engine_nice <= 19, "an integer in [0, 19]"),
        ("adapter_poll_s", e.adapter_poll_s, e.adapter_poll_s > 0, "> 0"),
        ("adapter_wait_s", e.adapter_wait_s, e.adapter_wait_s >= 0, ">= 0"),
        ("adapter_margin_s", e.adapter_margin_s, e.adapter_margin_s >= 0, ">= 0"),
    ]


def _sim_checks(e: SimEngineConfig) -> list[tuple[str, Any, bool, str]]:
    positive = ("time_scale", "weight_bytes", "hbm_bandwidth", "prefill_tokens_per_s", "output_len_median")
    counts = ("max_num_seqs", "max_model_len", "vocab_size", "block_size", "tensor_parallel_size")
    return [
        *((name, getattr(e, name), getattr(e, name) > 0, "> 0") for name in positive),
        *((name, getattr(e, name), getattr(e, name) >= 1, "an integer >= 1") for name in counts),
        ("tp_efficiency", e.tp_efficiency, 0 < e.tp_efficiency <= 1, "in (0, 1]"),
        ("output_len_sigma", e.output_len_sigma, e.output_len_sigma >= 0 and math.isfinite(e.output_len_sigma),
         ">= 0"),
        ("output_len_session_share", e.output_len_session_share, 0 <= e.output_len_session_share <= 1,
         "in [0, 1]"),
        ("output_len_prompt_share", e.output_len_prompt_share,
         0 <= e.output_len_prompt_share <= 1 - e.output_len_session_share,
         f"in [0, 1 - output_len_session_share = {1 - e.output_len_session_share:g}]"),
        ("tokenizer", e.tokenizer, tokenizer_problem(e.tokenizer) is None, f"{tokenizer_problem(e.tokenizer)}"),
    ]


def _validate_engine(cfg: Config, errors: list[FieldError]) -> None:
    """The engine and every group's overrides of it, all errors at once."""
    if isinstance(cfg.engine, VllmEngineConfig):
        checks: Any = _vllm_checks
    elif isinstance(cfg.engine, SimEngineConfig):
        checks = _sim_checks
    else:
        return
    for prefix, e, mine in _engine_variants(cfg):
        for name, value, ok, allowed in checks(e):
            if not ok and name in mine:
                errors.append(FieldError(f"{prefix}.{name}", value, allowed))
        if isinstance(e, VllmEngineConfig):
            for key in e.args if "args" in mine else ():
                if key in VLLM_OWN_ARGS:
                    errors.append(FieldError(f"{prefix}.args.{key}", e.args[key],
                                             "not an engine.args key: use engine.model, engine.max_model_len, "
                                             "engine.tensor_parallel_size, engine.pipeline_parallel_size or "
                                             "engine.kv_cache_gib (disable_log_stats is the backend's: it keeps its "
                                             "own stat logger; nnodes, node_rank, master_addr and master_port come "
                                             "from the placement: cluster.gpus_per_node)"))


def _validate_report(cfg: Config, errors: list[FieldError]) -> None:
    """A positive log interval; every tracker known, its library installed (named for pip), a W&B mode."""
    import importlib.util

    if not cfg.report.log_interval_s > 0:
        errors.append(FieldError("report.log_interval_s", cfg.report.log_interval_s, "> 0 (seconds)"))

    from toolkit.report.trackers import PACKAGES

    for i, name in enumerate(cfg.report.trackers):
        if name not in PACKAGES:
            errors.append(FieldError(f"report.trackers[{i}]", name, f"one of {sorted(PACKAGES)}"))
            continue
        module, pip = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            errors.append(FieldError(f"report.trackers[{i}]", name, f"its library is not installed: pip install {pip}"))
    if len(set(cfg.report.trackers)) != len(cfg.report.trackers):
        errors.append(FieldError("report.trackers", list(cfg.report.trackers), "each tracker once"))
    mode = cfg.report.wandb_mode
    if mode not in (None, "online", "offline", "disabled"):
        errors.append(FieldError("report.wandb_mode", mode, "online, offline, disabled, or null (WANDB_MODE)"))

