"""Replay's reading of a session (``toolkit/plan/replay.py``): its turns are the runs of its loss mask."""

from __future__ import annotations

from toolkit.core.protocol import Generate, Sampling
from toolkit.plan.replay import Recorded, turns_of


def test_a_sessions_turns_are_its_generated_runs_each_with_the_observation_after_it() -> None:
    tokens = [1, 2, 3, 10, 11, 12, 50, 51, 20, 21, 60, 30]
    mask = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1]
    assert turns_of(tokens, mask, 3) == [([10, 11, 12], [50, 51]), ([20, 21], [60]), ([30], [])]


def test_a_replayed_turn_says_its_recorded_tokens_and_a_moved_one_the_rest_of_them() -> None:
    rec = Recorded.__new__(Recorded)
    rec._by_session = {"0/5": [([7, 8, 9, 10], [1]), ([4, 4], [])]}
    from toolkit.config import SimEngineConfig

    cfg = SimEngineConfig()
    first = Generate(request_id="j/0/5/0", prompt_token_ids=[1, 2], sampling=Sampling(max_tokens=16))
    assert rec.plan(cfg, first)[0] == [7, 8, 9, 10] and rec.plan(cfg, first)[2] == "stop"
    moved = Generate(request_id="j/0/5/0", prompt_token_ids=[1, 2, 7, 8], sampling=Sampling(max_tokens=14),
                     resumed_tokens=2)
    assert rec.plan(cfg, moved)[0] == [9, 10]
    cut = Generate(request_id="j/0/5/1~1", prompt_token_ids=[1], sampling=Sampling(max_tokens=1))
    assert rec.plan(cfg, cut)[0] == [4] and rec.plan(cfg, cut)[2] == "length"


def test_a_config_group_chosen_again_drops_the_fields_the_run_set_in_it() -> None:
    """A vLLM run replayed with ``engine=sim``: its ``engine.*`` fields are vLLM's, which the sim's config
    does not have; the other overrides stay under the new ones."""
    rec = Recorded.__new__(Recorded)
    rec.overrides = ["steps=2", "engine=vllm", "engine.kv_cache_gib=20", "groups.tail.replicas=2", "seed=3"]
    assert rec.base(["engine=sim", "tail.policy=count"]) == ["steps=2", "groups.tail.replicas=2", "seed=3"]
    assert rec.base(["groups=single"]) == ["steps=2", "engine=vllm", "engine.kv_cache_gib=20", "seed=3"]
    assert rec.base(["engine.time_scale=0.5"]) == rec.overrides  # a field, not a group chosen again
