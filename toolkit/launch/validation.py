"""The one place a config is checked before anything starts: :func:`validate` lists every bad field
with its value and what is allowed (a :class:`~toolkit.core.errors.ConfigError`), never only the first.

Each field's own constraint (bounds, patterns, closed choices) is declared where the field is and
checked by :func:`toolkit.config.field_errors`; each backend's own checks sit beside the backend, named
by its registry entry (``check``). Here are the rules that span fields, and the checks that need the
environment (imports, files, installed libraries)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable
from typing import Any

from hydra.utils import instantiate

from toolkit.config import (
    CLUSTERS,
    ENGINES,
    CloseMode,
    Config,
    GroupFilter,
    ReplicaResources,
    SimEngineConfig,
    SlurmClusterConfig,
    VllmEngineConfig,
    WeightsTransport,
    engine_variants,
    field_errors,
    group_engine,
    replica_resources,
    samples_per_prompt,
    typing_errors,
)
from toolkit.core.errors import ConfigError, FieldError
from toolkit.core.registry import Registry
from toolkit.gateway.config import validate_agent
from toolkit.model.tokenizer import tokenizer_problem
from toolkit.report import trackers as report_trackers
from toolkit.rollout.hints import LengthHint
from toolkit.router.tail import TAIL_POLICIES

logger = logging.getLogger(__name__)

RESOURCE_FIELDS = {f.name for f in dataclasses.fields(ReplicaResources)}

Rule = Callable[[Config], list[FieldError]]


def validate(cfg: Config) -> None:
    """Check everything that can be checked before anything starts; raise one ConfigError listing all."""
    errors = typing_errors(cfg) + field_errors(cfg)
    for rule in RULES:
        errors += rule(cfg)
    if not (cfg.workload.agent and cfg.workload.length_hint):
        _warn_unread_hints(cfg)
    if errors:
        raise ConfigError(errors)


# Backends: the registered one for each ``type``, and its own checks.


def _backend_errors(kind: str, reg: Registry, obj: Any) -> list[FieldError]:
    """``<kind>.type`` names a registered backend whose config class ``obj`` is."""
    if obj.type not in reg.names():
        return [FieldError(f"{kind}.type", obj.type, f"one of {reg.names()}")]
    if type(obj) is not reg.schema(obj.type):
        fits = [name for name in reg.names() if reg.schema(name) is type(obj)]
        return [FieldError(f"{kind}.type", obj.type, f"{' or '.join(fits)} for these fields")]
    return []


def backend_types(cfg: Config) -> list[FieldError]:
    return _backend_errors("cluster", CLUSTERS, cfg.cluster) + _backend_errors("engine", ENGINES, cfg.engine)


def backend_checks(cfg: Config) -> list[FieldError]:
    """The cluster backend's checks of the whole config; the engine backend's, of the engine and of every
    group's version of it."""
    errors: list[FieldError] = []
    if not _backend_errors("cluster", CLUSTERS, cfg.cluster) and (check := CLUSTERS.check(cfg.cluster.type)):
        errors += check(cfg)
    if not _backend_errors("engine", ENGINES, cfg.engine) and (check := ENGINES.check(cfg.engine.type)):
        for prefix, engine, fields in engine_variants(cfg):
            errors += check(engine, prefix, fields)
    return errors


# Rules that span fields.


def replica_placement(cfg: Config) -> list[FieldError]:
    """A replica wider than a node (tensor x pipeline parallel size over ``cluster.gpus_per_node``) spans
    whole nodes; on Slurm, a group's explicit GPUs and nodes agree with that shape."""
    per_node = cfg.cluster.gpus_per_node
    if not isinstance(per_node, int) or per_node < 0:
        return []  # the field's own error
    engine_fields = {f.name for f in dataclasses.fields(cfg.engine)}
    errors = []
    for group in cfg.groups:
        if set(cfg.groups[group].engine) - engine_fields:
            continue  # unknown engine keys are reported on their own
        e = group_engine(cfg, group)
        tp, pp = getattr(e, "tensor_parallel_size", 1), getattr(e, "pipeline_parallel_size", 1)
        if not (isinstance(tp, int) and isinstance(pp, int)) or tp < 1 or pp < 1:
            continue  # reported with the engine's fields
        devices = tp * pp
        if per_node and devices > per_node and devices % per_node:
            errors.append(FieldError(
                f"groups.{group}.engine", f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {devices}",
                f"a multiple of cluster.gpus_per_node = {per_node} (a replica wider than a node spans whole "
                f"nodes: {devices // per_node} or {devices // per_node + 1} nodes of {per_node}), or at most {per_node}"))
            continue
        c = cfg.cluster
        if not isinstance(c, SlurmClusterConfig) or set(over := c.group_resources.get(group, {})) - RESOURCE_FIELDS:
            continue  # unknown resource keys are reported on their own
        derived = replica_resources(cfg, group)  # the group's own values, but where the shape decides
        for key in ("gpus", "nodes"):
            if key in over and over[key] != getattr(derived, key):
                errors.append(FieldError(
                    f"cluster.group_resources.{group}.{key}", over[key],
                    f"{getattr(derived, key)} (or unset): {devices} devices on nodes of cluster.gpus_per_node = "
                    f"{per_node} are {derived.nodes} node(s) of {derived.gpus}"))
        if not per_node and isinstance(e, VllmEngineConfig) and derived.gpus > 0 and \
                derived.gpus * derived.nodes != devices:  # (0 GPUs: vLLM's CPU build)
            want = devices // derived.nodes if devices % derived.nodes == 0 else devices
            errors.append(FieldError(
                f"cluster.group_resources.{group}.gpus", derived.gpus,
                f"{want} over {derived.nodes} node(s){'' if 'gpus' in over else ' (it has cluster.replica.gpus: set '}"
                f"{'' if 'gpus' in over else f'+cluster.group_resources.{group}.gpus={want})'}: the replicas use "
                f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {devices} GPUs (or set "
                f"cluster.gpus_per_node to place them)"))
        elif isinstance(e, SimEngineConfig) and derived.gpus > 0:
            logger.warning("group %s runs the sim engine on %d GPU(s) a replica: the sim uses none (engine=vllm "
                           "runs a model)", group, derived.gpus)
    return errors


def tail_groups(cfg: Config) -> list[FieldError]:
    """Tail routing needs its group (with a replica: the group's own bound) and another group for the
    step before the flip."""
    tc = cfg.tail
    if not tc.active:
        return []
    errors = []
    if tc.group not in cfg.groups:
        errors.append(FieldError("tail.group", tc.group, f"one of the defined groups {sorted(cfg.groups)}"))
    if not set(cfg.groups) - {tc.group}:
        errors.append(FieldError("groups", sorted(cfg.groups),
                                 "a group besides the tail group, to serve the step before the flip"))
    return errors


def kv_moves(cfg: Config) -> list[FieldError]:
    """``tail.move=kv`` needs engines that receive a request's KV (their config's ``receives_kv``)."""
    if cfg.tail.move != "kv":
        return []
    others = {name: group_engine(cfg, name).type for name in cfg.groups if not group_engine(cfg, name).receives_kv}
    if not others:
        return []
    return [FieldError("tail.move", cfg.tail.move, f"'recompute' with engines that cannot receive a request's "
                       f"KV ({others}: no KV connector is wired)")]


def affinity(cfg: Config) -> list[FieldError]:
    """``router.affinity=wait`` waits for a session's own replica: ``consistent_hash`` gives it one, and
    ``kv_aware`` the one that holds its prefix."""
    if cfg.router.affinity == "spill" or cfg.router.policy in ("consistent_hash", "kv_aware"):
        return []
    return [FieldError("router.affinity", cfg.router.affinity,
                       f"'spill' with router.policy={cfg.router.policy} (only consistent_hash and kv_aware keep a "
                       f"session's replica to wait for)")]


def concurrency_cap(cfg: Config) -> list[FieldError]:
    # Each rank runs at least one session at a time: a cap below the ranks would not hold.
    mcr = cfg.rollout.max_concurrent_rollouts
    if mcr is None or mcr >= max(1, cfg.ranks):
        return []
    return [FieldError("rollout.max_concurrent_rollouts", mcr, f"an integer >= ranks ({cfg.ranks}), or null")]


def decoding(cfg: Config) -> list[FieldError]:
    if not cfg.rollout.decode_responses or cfg.workload.tokenizer is not None:
        return []
    return [FieldError("rollout.decode_responses", cfg.rollout.decode_responses,
                       "needs workload.tokenizer (a tokenizer.json path or a `_target_`), or false")]


def staleness(cfg: Config) -> list[FieldError]:
    k = cfg.rollout.max_staleness
    if k is None or cfg.rollout.handshake or cfg.rollout.close == CloseMode.count:
        return []  # with close=count and no weights, k bounds the step boundaries a session is carried across
    return [FieldError("rollout.max_staleness", k,
                       "needs rollout.weights_dir (where the trainer publishes the weights to wait for), or "
                       "rollout.weights_transport=stream, or null")]


def streamed_weights(cfg: Config) -> list[FieldError]:
    """``rollout.weights_transport=stream``: what the engines and the rest of the config must allow."""
    r = cfg.rollout
    if r.weights_transport != WeightsTransport.stream:
        return []
    errors = []
    if r.weights_dir:
        errors.append(FieldError("rollout.weights_dir", r.weights_dir,
                                 "null with rollout.weights_transport=stream (the trainer streams the weights "
                                 "through toolkit.weights.Streamer), or weights_transport=checkpoint"))
    for where, ecfg, _ in engine_variants(cfg):
        if ecfg.type not in ("sim", "vllm"):
            errors.append(FieldError(f"{where}.type", ecfg.type, "sim or vllm with rollout.weights_transport=stream"))
        elif ecfg.type == "vllm" and int(ecfg.args.get("data_parallel_size", 1) or 1) > 1:
            errors.append(FieldError(f"{where}.args.data_parallel_size", ecfg.args["data_parallel_size"],
                                     "1 with rollout.weights_transport=stream (a replica of several engine cores "
                                     "takes no streamed update; run them as replicas of a group), or "
                                     "weights_transport=checkpoint"))
    return errors


def partial_steps(cfg: Config) -> list[FieldError]:
    """``rollout.close`` and what only ``close=count`` reads (docs/partial.md)."""
    r = cfg.rollout
    if r.close != CloseMode.count:
        return [FieldError(f"rollout.{name}", value, f"{allowed} (it applies to rollout.close=count only)")
                for name, value, allowed, unset in (
                    ("over_sample", r.over_sample, "0.0", r.over_sample == 0),
                    ("filter_groups", r.filter_groups, "none", r.filter_groups == GroupFilter.none),
                    ("max_group_starts_per_step", r.max_group_starts_per_step, "null",
                     r.max_group_starts_per_step is None))
                if not unset]
    errors = []
    if r.max_staleness == 0 and r.handshake:
        errors.append(FieldError("rollout.max_staleness", 0,
                                 ">= 1 with rollout.close=count, or close=all: a session carried into the "
                                 "next step ran on older weights, so it cannot be on-policy"))
    group = samples_per_prompt(cfg)
    if cfg.sessions_per_step // group < cfg.ranks:
        errors.append(FieldError("sessions_per_step", cfg.sessions_per_step,
                                 f">= ranks ({cfg.ranks}) groups of samples_per_prompt ({group}) with "
                                 "rollout.close=count: every rank closes its step on its own share"))
    if cfg.sessions_per_step % group:
        errors.append(FieldError("sessions_per_step", cfg.sessions_per_step,
                                 f"a multiple of workload.prompts.samples_per_prompt ({group}) with "
                                 "rollout.close=count: a step closes on whole groups"))
    if r.filter_groups == GroupFilter.zero_variance and group < 2:
        errors.append(FieldError("rollout.filter_groups", r.filter_groups,
                                 "none with samples_per_prompt = 1 (a group of one always has zero variance), "
                                 "or set workload.prompts.samples_per_prompt >= 2"))
    return errors


def agent_workload(cfg: Config) -> list[FieldError]:
    """An agent workload: its own checks (``toolkit/gateway/config.py``), and no length predictor."""
    if not cfg.workload.agent:
        return []
    errors = validate_agent(cfg)
    if cfg.workload.length_hint:
        errors.append(FieldError("workload.length_hint", cfg.workload.length_hint.get("_target_"),
                                 "empty with workload.agent (an agent sends its own hint: the request's "
                                 "expected_tokens field)"))
    return errors


# Checks that need the environment: imports, files, installed libraries.


def _target_errors(path: str, spec: dict[str, Any]) -> list[FieldError]:
    target = spec.get("_target_")
    if not target or not isinstance(target, str) or "." not in target:
        return [FieldError(f"{path}._target_", target, "a dotted path to a class, e.g. pkg.module.Class")]
    module, _, name = target.rpartition(".")
    try:
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        return [FieldError(f"{path}._target_", target, f"an importable class ({exc})")]
    return []


def workload_sources(cfg: Config) -> list[FieldError]:
    """The environment's and prompt source's classes, the tokenizer spec, and their own argument checks
    (files, keys, bounds) via their ``check_spec``, if they have one."""
    w = cfg.workload
    errors = [] if w.agent else _target_errors("workload.env", w.env)
    errors += _target_errors("workload.prompts", w.prompts)
    # An agent workload's tokenizer is a model directory with a chat template (validate_agent checks it).
    why = None if w.agent else tokenizer_problem(w.tokenizer)
    if why is not None:
        errors.append(FieldError("workload.tokenizer", w.tokenizer, why))
    for path, spec in (("workload.prompts", w.prompts), *(() if w.agent else (("workload.env", w.env),))):
        module, _, name = str(spec.get("_target_")).rpartition(".")
        try:
            check = getattr(getattr(importlib.import_module(module), name), "check_spec", None)
        except (ImportError, AttributeError, ValueError):
            continue  # already reported by _target_errors
        if callable(check):
            errors += [FieldError(f"{path}.{key}", value, allowed) for key, value, allowed in check(dict(spec))]
    return errors


def length_hint(cfg: Config) -> list[FieldError]:
    """A predictor is built once per rank: build it here too, so a bad one fails at setup."""
    spec = cfg.workload.length_hint
    if not spec or cfg.workload.agent:
        return []  # with an agent: agent_workload's error
    errors = _target_errors("workload.length_hint", spec)
    if errors:
        return errors

    try:
        hint = instantiate(spec)
    except Exception as exc:  # Hydra wraps what the constructor raised
        cause = exc.__cause__ or exc
        if isinstance(cause, ConfigError):
            return list(cause.errors)
        # the user's constructor: say what it said
        return [FieldError("workload.length_hint", spec.get("_target_"), f"a predictor it can build ({cause})")]
    if not isinstance(hint, LengthHint):
        return [FieldError("workload.length_hint._target_", spec.get("_target_"),
                           "a subclass of toolkit.rollout.hints.LengthHint")]
    if inspect.iscoroutinefunction(hint.expected_tokens):
        return [FieldError("workload.length_hint._target_", spec.get("_target_"),
                           "a LengthHint whose expected_tokens is a plain def (it is asked before every "
                           "turn, in the rank's event loop), not async def")]
    return []


def trackers(cfg: Config) -> list[FieldError]:
    """Every tracker known, once, its library installed (named for pip)."""
    errors = []
    for i, name in enumerate(cfg.report.trackers):
        packages = report_trackers.PACKAGES
        if name not in packages:
            errors.append(FieldError(f"report.trackers[{i}]", name, f"one of {sorted(packages)}"))
        elif importlib.util.find_spec(packages[name][0]) is None:
            errors.append(FieldError(f"report.trackers[{i}]", name,
                                     f"its library is not installed: pip install {packages[name][1]}"))
    if len(set(cfg.report.trackers)) != len(cfg.report.trackers):
        errors.append(FieldError("report.trackers", list(cfg.report.trackers), "each tracker once"))
    return errors


RULES: tuple[Rule, ...] = (
    backend_types, backend_checks, replica_placement, tail_groups, kv_moves, affinity, concurrency_cap, decoding,
    staleness,
    streamed_weights,
    partial_steps,
    agent_workload, workload_sources, length_hint, trackers,
)
"""What :func:`validate` checks after each field's own constraint, in this order."""


def _warn_unread_hints(cfg: Config) -> None:
    """A predictor nothing reads is no error (a baseline arm keeps the hinted workload as it is), but it
    costs every turn a call, so say so once."""
    policy = TAIL_POLICIES.get(cfg.tail.policy)
    if cfg.workload.length_hint and policy is not None and not policy.reads_hints:
        logger.warning("workload.length_hint (%s) is set but tail.policy=%s places no turn by its hint: the ranks "
                       "ask it before every turn for nothing; tail.policy=%s read hints",
                       cfg.workload.length_hint.get("_target_"), cfg.tail.policy,
                       " or ".join(name for name, p in TAIL_POLICIES.items() if p.reads_hints))
