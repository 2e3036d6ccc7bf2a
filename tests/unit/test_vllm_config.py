"""The ``vllm`` backend's config, presets and file-system checks: no vLLM needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.config import ENGINES, ConfigError, CpuAllocator, VllmEngineConfig, compose_config, group_engine
from toolkit.engine.vllm import VllmEngine
from toolkit.engine.vllm_lora import adapter_present
from toolkit.engine.vllm_setup import AllocatorMissing, allocator_preload, cpu_thread_binding
from toolkit.launch.composition import check_overrides
from toolkit.launch.validation import validate


def test_model_tiny_picks_vllm_and_fits_the_rollout_into_the_model() -> None:
    cfg = compose_config(["engine=vllm", "model=tiny"])
    validate(cfg)
    e = cfg.engine
    assert isinstance(e, VllmEngineConfig) and ENGINES.backends[e.type].impl == "toolkit.engine.vllm:VllmEngine"
    assert (e.model, e.vocab_size, e.max_model_len) == ("tiny", 512, 1024)
    assert e.args["enforce_eager"] is True and e.kv_cache_gib == 0.125
    # Workload interpolations follow the engine; a whole session fits max_model_len.
    assert cfg.workload.prompts["vocab_size"] == cfg.workload.env["vocab_size"] == 512
    turns, obs = cfg.workload.env["max_turns"], cfg.workload.env["observation_tokens"]
    assert cfg.workload.prompts["max_len"] + turns * cfg.workload.max_tokens + (turns - 1) * obs <= e.max_model_len
    # model=tiny alone implies engine=vllm; the tail group keeps its tensor parallel override.
    assert compose_config(["model=tiny"]).engine == e
    assert group_engine(cfg, "tail").tensor_parallel_size == 2


def test_engine_args_pass_through_but_own_fields_stay_fields() -> None:
    cfg = compose_config(["model=tiny", "++engine.args.max_num_seqs=8", "++engine.args.seed=3"])
    validate(cfg)
    args = VllmEngine(cfg.engine).engine_args()
    assert args["max_num_seqs"] == 8 and args["seed"] == 3 and args["model"] == "tiny"
    assert args["kv_cache_memory_bytes"] == (1 << 30) // 8 and args["disable_log_stats"] is True
    assert args["max_model_len"] == 1024 and args["tensor_parallel_size"] == 1


def test_every_bad_vllm_field_is_reported_at_once() -> None:
    cfg = compose_config(["model=tiny", "engine.model=", "engine.max_model_len=0", "engine.kv_cache_gib=-1",
                          "engine.max_restarts=-1", "engine.adapter_poll_s=0", "++engine.args.max_model_len=9",
                          "groups.tail.engine.tensor_parallel_size=0"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    fields = {e.field for e in info.value.errors}
    assert {"engine.model", "engine.max_model_len", "engine.kv_cache_gib", "engine.max_restarts",
            "engine.adapter_poll_s", "engine.args.max_model_len",
            "groups.tail.engine.tensor_parallel_size"} <= fields
    assert "engine.max_model_len" in str(info.value)  # the message names the field to use instead


def test_a_model_directory_or_cache_dir_that_cannot_be_used_fails_at_setup(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    cfg = compose_config(["model=tiny", f"engine.cache_dir={afile}/cache",
                          f"++groups.tail.engine.model={tmp_path}/no-such-model"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    bad = {e.field: e.allowed for e in info.value.errors}
    assert f"{afile} is not a directory" in bad["engine.cache_dir"]
    assert "no such directory" in bad["groups.tail.engine.model"]
    (tmp_path / "model").mkdir()
    validate(compose_config(["model=tiny", f"engine.cache_dir={tmp_path}/new/cache",  # made on first use
                             f"++groups.tail.engine.model={tmp_path}/model", f"++groups.tail.engine.cache_dir={tmp_path}"]))


def test_cpu_thread_binding_splits_the_cpus_between_workers() -> None:
    assert cpu_thread_binding(1, [0, 1]) is None
    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    assert cpu_thread_binding(4, [0, 1]) is None  # vLLM then says what is wrong


def test_the_cpu_allocator_is_tcmalloc_where_the_node_has_it_and_a_users_own_stays() -> None:
    libs = {"tcmalloc_minimal": "libtcmalloc_minimal.so.4", "tcmalloc": "libtcmalloc.so.4"}
    has, only_full, none = libs.get, {"tcmalloc": "libtcmalloc.so.4"}.get, {}.get
    auto, tc, system = CpuAllocator.auto, CpuAllocator.tcmalloc, CpuAllocator.system
    assert compose_config(["model=tiny"]).engine.cpu_allocator == auto
    assert allocator_preload(auto, "", has) == allocator_preload(tc, "", has) == "libtcmalloc_minimal.so.4"
    assert allocator_preload(auto, "", only_full) == "libtcmalloc.so.4"
    assert allocator_preload(auto, "/t/libgomp.so", has) == "libtcmalloc_minimal.so.4:/t/libgomp.so"
    # Already there (an engine restarted in the same replica, or the user's): unchanged, not twice.
    assert allocator_preload(auto, "libtcmalloc_minimal.so.4", has) == "libtcmalloc_minimal.so.4"
    assert allocator_preload(auto, "/x/libjemalloc.so.2", has) == "/x/libjemalloc.so.2"
    assert allocator_preload(system, "/t/libgomp.so", has) == "/t/libgomp.so"
    assert allocator_preload(auto, "", none) == ""  # with a warning in the replica's log
    with pytest.raises(AllocatorMissing, match="libtcmalloc-minimal4.*auto or system"):
        allocator_preload(tc, "", none)
    with pytest.raises(AllocatorMissing, match="libjemalloc"):
        allocator_preload(tc, "/x/libjemalloc.so.2", has)
    with pytest.raises(ConfigError) as info:
        check_overrides(["model=tiny", "engine.cpu_allocator=jemalloc"])
    assert {e.field: e.allowed for e in info.value.errors} == {
        "engine.cpu_allocator": "one of ['auto', 'tcmalloc', 'system']"}


def test_adapter_present_lists_the_directory_on_a_miss(tmp_path: Path) -> None:
    adapter = tmp_path / "adapters" / "a1"
    assert not adapter_present(str(adapter))  # neither the directory nor its parent listing fails
    adapter.mkdir(parents=True)
    assert not adapter_present(str(adapter))
    (adapter / "adapter_config.json").write_text("{}")
    assert adapter_present(str(adapter)) and adapter_present(str(adapter) + "/")


def test_a_request_aborted_while_its_adapter_loads_does_not_run(tmp_path: Path) -> None:
    """An Abort that comes while the adapter is looked for or loaded (``add_lora``): the request ends
    cancelled instead of running to its end once the adapter is in."""
    import asyncio

    from toolkit.config import compose_config
    from toolkit.core.protocol import Generate, Result
    from toolkit.engine.vllm_lora import Adapters

    adapter = tmp_path / "a1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    adapters = Adapters(compose_config(["engine=vllm"]).engine, lambda *args: args)

    class Engine:  # vLLM's AsyncLLM as Adapters uses it: the abort comes while it loads the adapter
        errored = False

        async def add_lora(self, lora: object) -> None:
            assert adapters.cancel("r")
            await asyncio.sleep(0)

    got = asyncio.run(adapters.get(Engine(), Generate("r", prompt_token_ids=[1], lora=str(adapter))))
    assert isinstance(got, Result) and got.status == "cancelled" and not adapters.waits
    again = asyncio.run(adapters.get(Engine(), Generate("r", prompt_token_ids=[1], lora=str(adapter))))
    assert not isinstance(again, Result)  # (loaded now: no add_lora, nothing to abort it)
