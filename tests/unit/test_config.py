from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from hydra.errors import MissingConfigException

import toolkit.config
from toolkit.config import CONF_DIR as CONF
from toolkit.config import ConfigError, backends, compose_config, constraints, sections
from toolkit.launch.composition import check_overrides, precheck
from toolkit.launch.validation import validate


def all_group_options() -> list[str]:
    opts = []
    for group_dir in sorted(p for p in CONF.iterdir() if p.is_dir()):
        for yml in sorted(group_dir.glob("*.yaml")):
            opts.append(f"{group_dir.name}={yml.stem}")
    return opts


@pytest.mark.parametrize("override", all_group_options())
def test_every_yaml_composes_and_validates(override: str) -> None:
    cfg = compose_config([override])
    validate(cfg)


def test_default_config_shape() -> None:
    cfg = compose_config()
    assert cfg.groups["throughput"].replicas == 2
    assert cfg.groups["tail"].replicas == 1
    assert cfg.engine.type == "sim"
    assert cfg.ranks == 2
    assert cfg.workload.env["_target_"] == "toolkit.rollout.envs.ToolCallEnv"
    # Interpolations are resolved once at the entry point.
    assert cfg.workload.prompts["vocab_size"] == cfg.engine.vocab_size


def test_all_errors_reported_at_once() -> None:
    # A bad choice fails at composition; the overrides are checked together with validation's errors.
    with pytest.raises(ConfigError) as info:
        check_overrides(["tail.threshold=1.5", "groups.throughput.replicas=0", "router.policy=random", "steps=0",
                         "rollout.max_concurrent_rollouts=0", "+groups.throughput.engine.not_a_field=3"])
    text = str(info.value)
    fields = {e.field for e in info.value.errors}
    assert {"tail.threshold", "groups.throughput.replicas", "router.policy", "steps",
            "rollout.max_concurrent_rollouts", "groups.throughput.engine.not_a_field"} <= fields
    assert "tail.threshold = 1.5: a fraction in (0, 1], or null for no flip" in text
    assert "groups.throughput.replicas = 0: an integer >= 1" in text
    assert "router.policy = 'random': one of ['consistent_hash', 'least_loaded', 'power_of_two', 'round_robin', 'kv_aware']" in text
    # A config built in code is checked by validate alone, choices included.
    cfg = compose_config(["tail.threshold=1.5"])
    cfg.router = dataclasses.replace(cfg.router, policy="random")
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert {e.field: e.value for e in info.value.errors} == {"tail.threshold": 1.5, "router.policy": "random"}
    assert "least_loaded" in str(info.value)


def test_a_bad_choice_names_the_options_at_composition() -> None:
    with pytest.raises(ConfigError) as info:
        check_overrides(["tail.policy=nope", "router.policy=nope", "engine=nope", "report.wandb_mode=maybe"])
    assert {e.field: e.allowed for e in info.value.errors} == {
        "tail.policy": "one of ['count', 'age', 'predict']",
        "router.policy": "one of ['consistent_hash', 'least_loaded', 'power_of_two', 'round_robin', 'kv_aware']",
        "engine": "one of ['sim', 'vllm']",
        "report.wandb_mode": "one of ['online', 'offline', 'disabled']",
    }
    # A field of a group's choice is composed after that choice, wherever it stands on the line.
    with pytest.raises(ConfigError) as info:
        check_overrides(["engine.kv_cache_gib=-1", "engine=vllm", "rollout.output=nfs"])
    assert {e.field: e.value for e in info.value.errors} == {"rollout.output": "nfs", "engine.kv_cache_gib": -1.0}


def test_choices_are_the_registries_names_and_stay_strings(tmp_path: Path) -> None:
    from toolkit.gateway.toolcalls import PARSERS
    from toolkit.router.policy import POLICIES
    from toolkit.router.tail import TAIL_POLICIES

    # Every name a config may hold has its implementation, keyed by the enum member itself.
    assert list(POLICIES) == list(sections.RouterPolicyName)
    assert list(TAIL_POLICIES) == list(sections.TailPolicyName)
    assert all(TAIL_POLICIES[name].name is name for name in sections.TailPolicyName)
    assert POLICIES["least_loaded"] is POLICIES[sections.RouterPolicyName.least_loaded]
    assert sections.ToolParser.values() == sorted(PARSERS)
    cfg = compose_config(["tail.policy=predict", "rollout.output=shards"])
    assert cfg.tail.policy is sections.TailPolicyName.predict and cfg.tail.policy == "predict"
    assert f"{cfg.tail.policy}" == str(cfg.tail.policy) == "predict" and repr(cfg.tail.policy) == "'predict'"
    toolkit.config.save_run_config(cfg, tmp_path / "config.yaml")
    assert "  policy: predict\n" in (tmp_path / "config.yaml").read_text()
    assert toolkit.config.load_run_config(tmp_path) == cfg


def test_bounds_are_declared_with_the_field_and_worded_from_it() -> None:
    @dataclasses.dataclass
    class Demo:
        count: int = constraints.bounded(1, ge=1)
        share: float = constraints.bounded(0.5, ge=0, le=1)
        nice: int = constraints.bounded(10, ge=0, le=19)
        wait_s: float | None = constraints.bounded(None, gt=0, note="(seconds)", null="(forever)")
        grace_s: float = constraints.bounded(1.0, ge=0, finite=True)
        mem: str = constraints.matching("1G", r"^[0-9]+[KMGT]?$", "sbatch memory")
        policy: sections.QueueOrder | None = None

    assert constraints.field_errors(Demo()) == []
    bad = Demo(count=0, share=1.5, nice=20, wait_s=0, grace_s=float("inf"), mem="lots", policy="lifo")
    assert [str(e) for e in constraints.field_errors(bad, "demo")] == [
        "demo.count = 0: an integer >= 1",
        "demo.share = 1.5: a fraction in [0, 1]",
        "demo.nice = 20: an integer in [0, 19]",
        "demo.wait_s = 0: finite, > 0 (seconds), or null (forever)",
        "demo.grace_s = inf: finite, >= 0",
        "demo.mem = 'lots': sbatch memory",
        "demo.policy = 'lifo': one of ['fair', 'fifo'], or null",
    ]


def test_every_backend_check_is_found_through_its_registry() -> None:
    from toolkit.config.backends import CLUSTERS, ENGINES

    assert all(callable(ENGINES.check(name)) for name in ENGINES.names())
    assert all(callable(CLUSTERS.check(name)) for name in CLUSTERS.names())
    with pytest.raises(ConfigError) as info:  # found at setup, not once the fleet is up
        validate(compose_config(["cluster.mpiexec=/opt/nowhere/bin/mpiexec"]))
    assert "cluster.mpiexec = '/opt/nowhere/bin/mpiexec': an executable mpiexec" in str(info.value)
    cfg = compose_config(["engine.output_len_session_share=0.5", "+groups.tail.engine.output_len_prompt_share=0.75"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert [str(e) for e in info.value.errors] == [
        "groups.tail.engine.output_len_prompt_share = 0.75: in [0, 1 - output_len_session_share = 0.5]"]


def test_a_concurrency_cap_below_the_ranks_is_refused() -> None:
    # Every rank runs at least one session at a time: a cap of 2 over 4 ranks would let 4 run.
    with pytest.raises(ConfigError, match=r"rollout.max_concurrent_rollouts = 2: an integer >= ranks \(4\)"):
        validate(compose_config(["ranks=4", "rollout.max_concurrent_rollouts=2"]))
    validate(compose_config(["ranks=4", "rollout.max_concurrent_rollouts=4"]))


def test_no_replica_timeout_is_positive_or_null() -> None:
    assert compose_config([]).router.no_replica_timeout_s == 300.0
    validate(compose_config(["router.no_replica_timeout_s=null"]))  # wait forever
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["router.no_replica_timeout_s=0", "router.heartbeat_s=-1"]))
    errors = {e.field: e.value for e in info.value.errors}
    assert errors == {"router.no_replica_timeout_s": 0, "router.heartbeat_s": -1}
    assert "> 0, or null" in str(info.value)


def test_lease_and_grace_are_checked() -> None:
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["cluster.lease_s=0.5", "cluster.signal_grace_s=-1"]))
    assert {e.field: e.value for e in info.value.errors} == {"cluster.lease_s": 0.5, "cluster.signal_grace_s": -1}


def test_a_groups_sim_engine_overrides_are_checked_like_the_engine() -> None:
    cfg = compose_config(["groups.tail.engine.tensor_parallel_size=0", "+groups.tail.engine.tp_efficiency=1.5",
                          "engine.time_scale=0"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    errors = {e.field: e.value for e in info.value.errors}
    assert errors == {"groups.tail.engine.tensor_parallel_size": 0, "groups.tail.engine.tp_efficiency": 1.5,
                      "engine.time_scale": 0}  # the group's other fields come from engine: not reported twice


def test_tail_group_missing_and_without_other_group() -> None:
    cfg = compose_config(["tail.threshold=0.9", "tail.group=fast"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert any(e.field == "tail.group" and e.value == "fast" for e in info.value.errors)

    cfg = compose_config(["groups=single", "tail.threshold=0.9", "tail.group=throughput"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert any(e.field == "groups" and "besides the tail group" in e.allowed for e in info.value.errors)


def test_bad_env_target() -> None:
    cfg = compose_config(["workload.env._target_=toolkit.rollout.envs.NoSuchEnv"])
    with pytest.raises(ConfigError, match="workload.env._target_"):
        validate(cfg)


def test_unknown_group_option_names_the_options() -> None:
    with pytest.raises(MissingConfigException) as info:
        compose_config(["groups=nonexistent"])
    assert "default" in str(info.value) and "single" in str(info.value)


def test_a_group_is_added_from_the_command_line() -> None:
    cfg = compose_config(["+groups.mid={replicas:1,max_inflight:32}"])
    assert (cfg.groups["mid"].replicas, cfg.groups["mid"].max_inflight) == (1, 32)
    assert set(cfg.groups) == {"throughput", "tail", "mid"}
    cfg = compose_config(["+groups.mid.replicas=3", "+groups.mid.engine.max_model_len=512", "groups.tail.replicas=2"])
    assert (cfg.groups["mid"].replicas, cfg.groups["mid"].max_inflight) == (3, 64)  # the rest: GroupConfig's defaults
    assert cfg.groups["mid"].engine == {"max_model_len": 512} and cfg.groups["tail"].replicas == 2
    validate(cfg)


def test_bad_group_fields_are_listed_together() -> None:
    """With every other error: a group field of the wrong type does not stop the checks of the rest."""
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["+groups.mid.replicaz=1", "+groups.x.max_inflight=abc", "+groups.y=3", "steps=0",
                                 "groups.tail=null"]))
    assert {"groups.mid.replicaz", "groups.x.max_inflight", "groups.y", "groups.tail", "steps"} <= {
        e.field for e in info.value.errors}
    text = str(info.value)
    assert "one of replicas, max_inflight, labels, engine" in text and "must be int" in text
    assert "to remove the group: ~groups.tail" in text


def cli_errors(argv: list[str]) -> str:
    """What ``python -m toolkit.launch ARGV`` prints after ``error:`` and exits 2 on, before Hydra starts
    anything (its command line is checked first: ``precheck``; the printing and the exit code:
    tests/integration/test_config.py)."""
    with pytest.raises(ConfigError) as info:
        precheck(argv)
    return str(info.value)


def test_cli_names_a_bad_added_group_field(tmp_path: Path) -> None:
    run = tmp_path / "run"
    text = cli_errors([f"hydra.run.dir={run}", "+groups.mid.replicaz=1", "+groups.mid.max_inflight=0"])
    assert "groups.mid.replicaz = 1: not a group field" in text
    assert not run.exists()


def test_cli_lists_every_override_that_does_not_compose(tmp_path: Path) -> None:
    run = tmp_path / "run"
    text = cli_errors([f"hydra.run.dir={run}", "steps=abc", "not_a_field=3", "engine=nope", "tail.threshold=0.8,0.9",
                       "+groups.mid.replicaz=1"])
    assert "invalid configuration (5 error(s))" in text
    assert "steps = 'abc'" in text and "Integer" in text
    assert "not_a_field = '3': 'not_a_field' is not a field of the config; its fields: cluster, engine," in text
    assert "engine = 'nope': one of ['sim', 'vllm']" in text
    assert "tail.threshold = '0.8,0.9'" in text and "-m (--multirun)" in text
    assert "groups.mid.replicaz = 1: not a group field" in text
    assert not run.exists()
    # In a sweep every value is checked.
    assert "steps = 'x'" in cli_errors(["-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", "steps=1,x"])
    # ...and every point validated before the first runs: a value that composes but is out of range,
    # and values that are wrong only together.
    text = cli_errors(["-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", "tail.threshold=0.9,1.5", "ranks=1,4",
                       "rollout.max_concurrent_rollouts=2,8"])
    assert "invalid configuration (2 error(s))" in text
    assert "tail.threshold (sweep point tail.threshold=1.5 ranks=1 rollout.max_concurrent_rollouts=2 and 3 more) = 1.5" in text
    assert ("rollout.max_concurrent_rollouts (sweep point tail.threshold=0.9 ranks=4 rollout.max_concurrent_rollouts=2 "
            "and 1 more) = 2") in text
    assert not (tmp_path / "sweep").exists()
    # A point whose values compose alone but not together (a key of one cluster's schema) is listed too.
    text = cli_errors(["-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", "cluster=slurm,local", "cluster.partition=gpu",
                       "seed=1,2,3"])
    assert ("overrides (sweep point cluster=local seed=1 and 2 more) = '': they do not compose: Could not "
            "override 'cluster.partition'") in text
    assert not (tmp_path / "sweep").exists()


def test_agent_workload_errors_are_reported_at_once(tmp_path: Path) -> None:
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        with pytest.raises(ConfigError) as err:  # the bad tool parser at composition, the rest by validation
            check_overrides(["workload=agent", "workload.agent._target_=no_such_pkg.solve",
                             f"workload.tokenizer={tmp_path}", "gateway.tool_parser=mistral",
                             f"gateway.port={port}", "rollout.max_failed_fraction=2", "workload.env_timeout_s=0"])
    finally:
        busy.close()
    fields = {e.field: e for e in err.value.errors}
    assert set(fields) == {"workload.agent._target_", "workload.tokenizer", "gateway.tool_parser", "gateway.port",
                           "rollout.max_failed_fraction", "workload.env_timeout_s"}
    assert "no_such_pkg" in str(fields["workload.agent._target_"].allowed)
    assert "tokenizer_config.json" in fields["workload.tokenizer"].allowed
    assert "one of ['hermes', 'none']" in fields["gateway.tool_parser"].allowed
    assert f"in use: [{port}" in fields["gateway.port"].allowed  # the next port may be taken too
    # A model directory without a chat template is refused too, naming what is missing.
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    cfg = compose_config(["workload=agent", f"workload.tokenizer={tmp_path}"])
    with pytest.raises(ConfigError, match="has no chat_template"):
        validate(cfg)


@pytest.mark.parametrize("module", [backends, sections, toolkit.config], ids=lambda m: m.__name__)
def test_every_config_field_has_a_docstring_under_it(module: object) -> None:
    classes = [c for c in vars(module).values()
               if inspect.isclass(c) and dataclasses.is_dataclass(c) and c.__module__ == module.__name__]
    assert classes
    missing = []
    for cls in classes:
        lines = inspect.getsource(cls).splitlines()
        for f in dataclasses.fields(cls):
            at = [i for i, line in enumerate(lines) if line.startswith(f"    {f.name}:")]
            if at and not lines[at[0] + 1].strip().startswith('"""'):  # no line: inherited, checked in its class
                missing.append(f"{cls.__name__}.{f.name}")
    assert not missing


def test_partial_steps_are_checked_at_setup_naming_every_bad_field() -> None:
    # What only close=count reads, set with close=all.
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["rollout.over_sample=0.25", "rollout.filter_groups=zero_variance",
                                 "rollout.max_group_starts_per_step=8"]))
    assert {e.field for e in info.value.errors} == {
        "rollout.over_sample", "rollout.filter_groups", "rollout.max_group_starts_per_step"}
    assert "applies to rollout.close=count only" in str(info.value)
    # close=count: on-policy with carried sessions, partial groups, a filter on groups of one, too few groups.
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["rollout.close=count", "rollout.weights_dir=/w", "rollout.max_staleness=0",
                                 "sessions_per_step=10", "+workload.prompts.samples_per_prompt=4",
                                 "rollout.filter_groups=zero_variance"]))
    errors = {e.field: e.allowed for e in info.value.errors}
    assert set(errors) == {"rollout.max_staleness", "sessions_per_step"}
    assert "cannot be on-policy" in errors["rollout.max_staleness"]
    assert "multiple of workload.prompts.samples_per_prompt (4)" in errors["sessions_per_step"]
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["rollout.close=count", "rollout.filter_groups=zero_variance", "sessions_per_step=1"]))
    assert {e.field for e in info.value.errors} == {"rollout.filter_groups", "sessions_per_step"}
    # Bounded carrying without weights, and a bad choice named with its options.
    validate(compose_config(["rollout.close=count", "rollout.max_staleness=1", "rollout.over_sample=0.5"]))
    with pytest.raises(ConfigError) as info:
        check_overrides(["rollout.close=some", "rollout.stale=keep", "rollout.over_sample=-1"])
    assert {("rollout.close", "one of ['all', 'count']"), ("rollout.stale", "one of ['drop', 'restart']")} <= {
        (e.field, e.allowed) for e in info.value.errors}
    assert "in [0, 4]" in [e.allowed for e in info.value.errors if e.field == "rollout.over_sample"]


def test_affinity_wait_needs_a_policy_that_keeps_a_sessions_replica() -> None:
    with pytest.raises(ConfigError, match=r"router.affinity = 'wait': 'spill' with router.policy=least_loaded"):
        validate(compose_config(["router.affinity=wait", "router.policy=least_loaded"]))
    validate(compose_config(["router.affinity=wait"]))


def test_streamed_weights_are_checked_at_setup_naming_every_bad_field() -> None:
    # With a checkpoint directory too, on a replica of two engine cores, and bad choices: every one named.
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["model=tiny", "groups=single", "rollout.weights_transport=stream",
                                 "rollout.weights_dir=/w", "++engine.args.data_parallel_size=2"]))
    errors = {e.field: e.allowed for e in info.value.errors}
    assert set(errors) == {"rollout.weights_dir", "engine.args.data_parallel_size"}
    assert "weights_transport=checkpoint" in errors["rollout.weights_dir"]
    assert "several engine cores" in errors["engine.args.data_parallel_size"]
    # Tensor parallel replicas stream: every worker is a rank of the chain.
    validate(compose_config(["model=tiny", "groups=single", "rollout.weights_transport=stream",
                             "engine.tensor_parallel_size=2"]))
    with pytest.raises(ConfigError) as info:
        check_overrides(["rollout.weights_transport=nfs", "weights.delta=sometimes", "weights.bucket_mb=0"])
    assert {("rollout.weights_transport", "one of ['checkpoint', 'stream']"), ("weights.delta", "one of ['off', 'auto']")} \
        <= {(e.field, e.allowed) for e in info.value.errors}
    assert "weights.bucket_mb" in {e.field for e in info.value.errors}
    # A streamed run may bound its staleness without a checkpoint directory.
    validate(compose_config(["rollout.weights_transport=stream", "rollout.max_staleness=0"]))


def test_numbers_a_run_divides_by_or_waits_on_are_bounded_and_finite() -> None:
    """Each was accepted and then hung or crashed the run once the fleet was up (a heartbeat task dead
    of a ZeroDivisionError, a router restarted for ever on math.ceil(inf), a rank failing its prompts)."""
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["engine.kv_cache_tokens=0", "engine.kv_link_bytes_per_s=0", "engine.step_overhead_s=-1",
                                 "engine.kv_bytes_per_token=-5", "router.load_factor=inf", "workload.temperature=inf",
                                 "seed=-1", "workload.prompts.min_len=500", "workload.env.max_turns=0"]))
    assert {e.field for e in info.value.errors} == {
        "seed", "engine.kv_bytes_per_token", "engine.kv_link_bytes_per_s", "engine.step_overhead_s",
        "engine.kv_cache_tokens", "workload.temperature", "router.load_factor", "workload.prompts.min_len",
        "workload.prompts.seed", "workload.env.max_turns"}
    assert "router.load_factor = inf: finite, >= 1.0" in str(info.value)


def test_a_groups_overrides_are_checked_as_the_fields_they_replace() -> None:
    """Their types too (a string reached the replica, which died at start); and a field the engine does not
    have hides none of the others' checks."""
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["+groups.tail.engine.kv_cache_tokens=abc", "+groups.tail.engine.bogus=1",
                                 "+groups.tail.engine.output_len_session_share=0.5",
                                 "+groups.tail.engine.output_len_prompt_share=0.8"]))
    assert {e.field: e.allowed for e in info.value.errors}.keys() == {
        "groups.tail.engine.kv_cache_tokens", "groups.tail.engine.bogus", "groups.tail.engine.output_len_prompt_share"}
    assert "groups.tail.engine.kv_cache_tokens = 'abc': must be int" in str(info.value)
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["cluster=slurm", "+cluster.group_resources.tail.requeue=maybe"]))
    assert "cluster.group_resources.tail.requeue = 'maybe': must be bool" in str(info.value)


def test_a_group_choice_that_is_no_name_is_listed_not_raised(tmp_path: Path) -> None:
    text = cli_errors([f"hydra.run.dir={tmp_path / 'run'}", "engine=3", "steps=0"])
    assert "engine = '3'" in text and "steps = 0" in text and not (tmp_path / "run").exists()


def test_a_sweep_over_a_field_of_a_group_chosen_beside_it_is_checked_with_that_group() -> None:
    """Each swept value is composed with the rest of the command line (as Hydra runs it), not alone:
    ``cluster.partition`` exists only with ``cluster=slurm``."""
    check_overrides(["cluster=slurm", "cluster.partition=debug,multi"], multirun=True)
    check_overrides(["engine=vllm", "engine.kv_cache_gib=1,2"], multirun=True)
    with pytest.raises(ConfigError) as info:
        check_overrides(["cluster=slurm", "cluster.partition=debug,multi", "steps=1,x"], multirun=True)
    assert "steps = 'x'" in str(info.value) and "partition" not in str(info.value)


def test_hydras_other_sweep_forms_are_checked_as_hydra_runs_them(tmp_path: Path) -> None:
    """``glob(...)`` over a config group's options (the check crashed: its expansion needs Hydra's loader),
    and ``hydra.mode=MULTIRUN`` as ``-m``."""
    precheck(["-m", "workload=glob(single*)", "steps=1"])
    precheck(["hydra.mode=MULTIRUN", "tail.threshold=0.8,0.9"])
    text = cli_errors(["-m", "workload=glob(*)", "steps=0"])
    assert "steps (sweep point workload=agent and 3 more) = 0" in text
    assert "a glob must match an option" in cli_errors(["-m", "workload=glob(nothing*)"])


def test_a_misspelt_field_is_named_with_the_sections_fields_and_the_closest() -> None:
    """A typed section takes no new key, '+' or not: the message lists its fields, the closest first."""
    with pytest.raises(ConfigError) as info:
        check_overrides(["cluster=slurm", "cluster.partiton=gpu"])
    text = str(info.value)
    assert "'partiton' is not a field of cluster (did you mean partition?)" in text and "account," in text
    assert "'+'" not in text
