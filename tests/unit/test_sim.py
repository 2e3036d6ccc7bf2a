from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import msgspec
import pytest

from tests.helpers.aio import run
from tests.helpers.requests import gen
from toolkit.config import SimEngineConfig
from toolkit.core.protocol import Generate, Sampling
from toolkit.engine.plans import PLAN_FIELDS, plan_output
from toolkit.engine.prefix_cache import PrefixCache
from toolkit.engine.sim import SimEngine


def test_step_time_matches_the_documented_model() -> None:
    eng = SimEngine(SimEngineConfig(step_overhead_s=0.0))
    # 16 GB / 4.3 TB/s = 3.72 ms; 2k context x 128 KiB / 4.3 TB/s = 0.062 ms per sequence.
    assert eng.step_time(0) == pytest.approx(3.72e-3, rel=0.01)
    per_seq = eng.step_time(2048) - eng.step_time(0)
    assert per_seq == pytest.approx(6.24e-5, rel=0.01)
    tp2 = SimEngine(SimEngineConfig(step_overhead_s=0.0, tensor_parallel_size=2, tp_efficiency=0.85))
    assert eng.step_time(0) / tp2.step_time(0) == pytest.approx(1.85)


def test_outputs_are_deterministic_and_seeded_per_request() -> None:
    cfg = SimEngineConfig()
    a = plan_output(cfg, gen("a", [5, 6, 7], 512))
    b = plan_output(cfg, gen("b", [5, 6, 7], 512))
    c = plan_output(cfg, gen("c", [5, 6, 8], 512))
    assert a == b
    assert a != c
    assert plan_output(cfg, gen("d", [5, 6, 7], 512, seed=1)) != a
    tokens, logprobs, _ = a
    assert len(tokens) == len(logprobs) and all(0 < t < cfg.vocab_size for t in tokens)
    assert all(lp <= 0 for lp in logprobs)


def test_outputs_and_their_logprobs_are_windows_from_one_place() -> None:
    import numpy as np

    from toolkit.core.draws import POOL, id_pool
    from toolkit.engine.plans import _logprob_pool, draw_output

    lps = _logprob_pool()
    tokens, logprobs = draw_output(np.random.default_rng(3), 32000, 20_000)
    assert len(tokens) == len(logprobs) == 20_000 and all(0 < t < 32000 for t in tokens)
    assert all(type(x) is float and x <= 0 for x in logprobs) and float(np.mean(logprobs)) == pytest.approx(-0.7, rel=0.03)
    assert float(np.float32(logprobs[0])) == logprobs[0]  # float32 values, as an engine's are
    start = next(i for i in range(POOL) if lps[i : i + 50] == logprobs[:50])
    assert tokens[2:] == (id_pool(32000) * 2)[start + 2 : start + 20_000]  # ids and logprobs: one place
    assert all(a is b for a, b in zip(logprobs, lps[start:], strict=False))  # the pool's objects, not copies
    assert draw_output(np.random.default_rng(5), 32000, 0) == ([], [])


def test_draws_are_pinned_across_processes_and_a_sessions_share_changes_only_the_length() -> None:
    def plan(share: float) -> tuple[list[int], list[float], str]:
        req = Generate("p", session_id="s", prompt_token_ids=[5, 6, 7], sampling=Sampling(512))
        return plan_output(SimEngineConfig(output_len_median=100, output_len_session_share=share), req)

    tokens, _, _ = plan(0.0)
    # Pinned: nothing per process enters the seed (Python's hash of a tuple of ints has no hash seed;
    # the strings go through blake2b), so a real run and its twin, in any processes, draw the same.
    assert (len(tokens), tokens[:4]) == (481, [27349, 26549, 14253, 5875])
    correlated = plan(0.5)  # its session's and prompt's draws seed the same generator first
    assert len(correlated[0]) != len(tokens)
    assert correlated[0] == tokens[: len(correlated[0])]


def test_output_lengths_are_heavy_tailed_and_capped() -> None:
    cfg = SimEngineConfig(output_len_median=100, output_len_sigma=1.0)
    lens = sorted(len(plan_output(cfg, gen(str(i), [i + 1, 2, 3], 4000))[0]) for i in range(2000))
    median, p99 = lens[1000], lens[1980]
    assert 80 < median < 125
    assert p99 > 6 * median  # lognormal sigma 1: p99 / median = e^2.33 = 10.2
    capped = [plan_output(cfg, gen(str(i), [i + 1], 50)) for i in range(300)]
    assert max(len(t) for t, _, _ in capped) == 50
    # A natural length of exactly 50 ends on its own ("stop"); only longer ones are cut.
    assert "length" in {f for t, _, f in capped if len(t) == 50}
    assert {f for t, _, f in capped if len(t) < 50} == {"stop"}


def test_a_moved_request_continues_its_planned_output() -> None:
    cfg = SimEngineConfig(output_len_median=200)
    whole = plan_output(cfg, gen("m", [3, 1, 4, 1, 5], 1000, seed=3))
    tokens, logprobs, finish = whole
    assert len(tokens) > 20
    k = 17
    cont = Generate("m", prompt_token_ids=[3, 1, 4, 1, 5, *tokens[:k]], resumed_tokens=k,
                    sampling=Sampling(max_tokens=1000 - k, seed=3))
    rest = plan_output(cfg, cont)
    assert tokens[:k] + rest[0] == tokens and logprobs[:k] + rest[1] == logprobs and rest[2] == finish


def test_a_plan_reads_only_the_plan_fields_of_its_engine() -> None:
    """The twin hands a moved request the rest of its first leg's plan on an engine that agrees on
    ``PLAN_FIELDS``: every other setting, changed, leaves every plan as it was; each of those changes one."""
    base = SimEngineConfig(output_len_session_share=0.3, output_len_prompt_share=0.2, max_model_len=700)
    reqs = [Generate(request_id=f"s{i}/0", session_id=f"s{i}", prompt_key=f"p{i % 2}",
                     prompt_token_ids=[(5 * i + j) % 900 + 1 for j in range(150 + 40 * i)],
                     sampling=Sampling(max_tokens=600, temperature=1.0)) for i in range(8)]
    plans = [plan_output(base, r) for r in reqs]
    changed = 0
    for f in dataclasses.fields(base):
        v = getattr(base, f.name)
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            continue
        other = dataclasses.replace(base, **{f.name: v + "x" if isinstance(v, str) else type(v)(v * 0.5 + 1)})
        same = [plan_output(other, r) for r in reqs] == plans
        assert same == (f.name not in PLAN_FIELDS), f.name
        changed += not same
    assert changed == len(PLAN_FIELDS)


def test_session_share_makes_a_sessions_turns_alike() -> None:
    def turn_lengths(share: float) -> list[tuple[int, int]]:
        cfg = SimEngineConfig(output_len_median=100, output_len_session_share=share)
        return [tuple(len(plan_output(cfg, Generate(f"s{i}/{t}", session_id=f"s{i}",
                                                        prompt_token_ids=[i + 1, t + 7],
                                                        sampling=Sampling(4000)))[0]) for t in (0, 1))
                for i in range(400)]

    def log_corr(pairs: list[tuple[int, int]]) -> float:
        import numpy as np
        a = np.log(np.array(pairs, dtype=float))
        return float(np.corrcoef(a[:, 0], a[:, 1])[0, 1])

    assert abs(log_corr(turn_lengths(0.0))) < 0.2
    assert 0.35 < log_corr(turn_lengths(0.5)) < 0.65  # the shared share is the correlation of log lengths


def test_prompt_share_makes_siblings_alike_and_they_still_sample_apart() -> None:
    """GRPO siblings: the same prompt, other sessions. Their log lengths correlate by the prompt share;
    sampled (temperature > 0) they get different tokens, greedy ones the same."""
    import numpy as np

    def sibling_lengths(share: float) -> np.ndarray:
        cfg = SimEngineConfig(output_len_median=100, output_len_prompt_share=share)
        return np.log(np.array([[len(plan_output(cfg, Generate(f"p{p}/s{k}", session_id=f"p{p}/s{k}",
                                                                prompt_key=f"p{p}", prompt_token_ids=[p + 1, 5],
                                                                sampling=Sampling(4000)))[0]) for k in (0, 1)]
                                for p in range(400)], dtype=float))

    a = sibling_lengths(0.0)
    assert abs(float(np.corrcoef(a[:, 0], a[:, 1])[0, 1])) < 0.2
    b = sibling_lengths(0.5)
    assert 0.35 < float(np.corrcoef(b[:, 0], b[:, 1])[0, 1]) < 0.65
    cfg = SimEngineConfig()
    one, two = (plan_output(cfg, Generate(f"s{k}", session_id=f"s{k}", prompt_key="p", prompt_token_ids=[3, 4],
                                          sampling=Sampling(64)))[0] for k in (0, 1))
    assert one != two
    greedy = [plan_output(cfg, Generate(f"s{k}", session_id=f"s{k}", prompt_key="p", prompt_token_ids=[3, 4],
                                        sampling=Sampling(64, temperature=0.0)))[0] for k in (0, 1)]
    assert greedy[0] == greedy[1]


def test_prefix_cache_matches_block_prefixes_and_evicts_lru() -> None:
    cache = PrefixCache(block_size=4, capacity_tokens=16)
    a = list(range(1, 14))
    assert cache.match(a) == 0
    cache.insert(a)
    assert cache.match(a) == 12
    assert cache.match(a[:8] + [99] * 8) == 8
    cache.insert(list(range(100, 120)))  # 5 new blocks push a's blocks out
    assert cache.match(a) == 0


def test_engine_generates_batches_and_counts_prefix_hits() -> None:
    async def main() -> None:
        eng = SimEngine(SimEngineConfig(time_scale=0.01))
        await eng.start()
        prompt = list(range(1, 100))
        results = await asyncio.gather(*(eng.generate(gen(f"r{i}", prompt + [i + 200], 32)) for i in range(8)))
        assert all(r.status == "ok" and 1 <= len(r.output_token_ids) <= 32 for r in results)
        assert eng.prefix_queries == 8 * 100
        again = await eng.generate(gen("again", prompt + [200], 8))
        assert again.cached_tokens >= 96
        await eng.close()

    run(main())


def test_engine_counts_where_its_time_went() -> None:
    """Steps, prefilled tokens and modelled seconds are exactly the time model's for a request alone;
    the wall time with work is at least the modelled time, and stops counting when it is idle."""
    async def main() -> None:
        eng = SimEngine(SimEngineConfig(time_scale=0.01))
        await eng.start()
        prompt = list(range(1, 50))
        res = await eng.generate(gen("a", prompt, 40))
        n = len(res.output_token_ids)
        stats = eng.stats()
        assert (stats.engine_steps, stats.prefill_tokens, stats.generated_tokens) == (n, len(prompt), n)
        # Step k reads the prompt and k tokens; the first also prefills the prompt.
        want = sum(eng.step_time(len(prompt) + k, len(prompt) if k == 0 else 0) for k in range(n)) * 0.01
        assert stats.model_s == pytest.approx(want)
        assert stats.active_s >= stats.model_s * 0.99
        await asyncio.sleep(0.05)
        assert eng.stats().active_s == pytest.approx(stats.active_s, abs=0.02)  # idle: not counted
        again = await eng.generate(gen("b", prompt, 8))  # the prompt is cached but for its last block
        assert eng.stats().prefill_tokens - stats.prefill_tokens == len(prompt) - again.cached_tokens
        await eng.close()

    run(main())


def test_abort_returns_partial_output_and_client_errors_are_immediate() -> None:
    async def main() -> None:
        eng = SimEngine(SimEngineConfig(time_scale=1.0, output_len_median=10000, max_model_len=100000))
        await eng.start()
        task = asyncio.create_task(eng.generate(gen("long", [1, 2, 3], 50000)))
        await asyncio.sleep(0.1)
        await eng.abort("long")
        res = await task
        assert res.status == "cancelled" and res.finish_reason == "abort"
        assert 0 < len(res.output_token_ids) < 1000
        bad = await eng.generate(gen("bad", [1, 999999]))
        assert bad.status == "client_error"
        await eng.close()

    run(main())


def test_in_place_update_switches_versions_at_a_step_boundary_and_aborts_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        eng = SimEngine(SimEngineConfig(time_scale=0.05, output_len_median=1e6, max_model_len=100000))
        await eng.start()
        prompt = list(range(1, 100))
        warm = await eng.generate(gen("warm", prompt + [500], 4))
        assert warm.weight_versions == [0] and warm.weight_version == 0
        ids = [f"l{i}" for i in range(4)]
        long = [asyncio.create_task(eng.generate(gen(rid, [7, 8, i], 2000))) for i, rid in enumerate(ids)]
        while not all(rid in eng.by_id and eng.by_id[rid].produced > 0 for rid in ids):
            await asyncio.sleep(0.001)
        steps = eng.steps
        await eng.update_weights_in_place(str(tmp_path), 5)
        # At the next step boundary: at most the step under way ran on the old weights meanwhile.
        assert eng.weight_version == 5 and eng.steps - steps <= 1
        assert not eng.cache.blocks and all(not t.done() for t in long)
        after = await eng.generate(gen("after", prompt + [500], 4))
        assert after.weight_versions == [5] and after.cached_tokens == 0  # the old weights' cache is gone
        for res in await asyncio.gather(*long):
            assert res.status == "ok" and res.finish_reason == "length" and len(res.output_token_ids) == 2000
            assert res.weight_versions == [0, 5] and res.weight_version == 5
        # An idle engine switches at once.
        await eng.update_weights_in_place(str(tmp_path), 6)
        assert (await eng.generate(gen("idle", [1, 2], 3))).weight_versions == [6]
        await eng.close()

    run(main())


def test_a_request_that_brings_its_kv_prefills_none_of_it_and_counts_it_neither_hit_nor_miss() -> None:
    async def main() -> None:
        cfg = SimEngineConfig(time_scale=0.01, kv_link_bytes_per_s=1e12, block_size=16)
        eng = SimEngine(cfg)
        prefills: list[int] = []
        timed = eng.step_time
        eng.step_time = lambda context, prefill=0: (prefills.append(prefill), timed(context, prefill))[1]  # type: ignore[method-assign]
        await eng.start()
        prompt = list(range(1, 101))  # 100 tokens: 6 whole blocks travel, the last 4 tokens do not
        whole = await eng.generate(gen("plain", prompt, 8))
        assert prefills[0] == 100 and whole.cached_tokens == 0
        eng2 = SimEngine(cfg)
        prefills.clear()
        eng2.step_time = eng.step_time  # type: ignore[method-assign]
        await eng2.start()
        moved = Generate("moved", prompt_token_ids=prompt, sampling=Sampling(max_tokens=8), kv_tokens=100)
        res = await eng2.generate(moved)
        assert res.status == "ok" and res.output_token_ids == whole.output_token_ids
        assert prefills[0] == 4 and res.cached_tokens == 0
        assert (eng2.prefix_queries, eng2.prefix_hits) == (4, 0)  # the 96 that travelled count neither way
        # A replica that held its first 32 tokens already (a shared system prompt): those are hits.
        eng3 = SimEngine(cfg)
        await eng3.start()
        await eng3.generate(gen("system", [*prompt[:32], 999], 1))
        queries, hits = eng3.prefix_queries, eng3.prefix_hits
        res = await eng3.generate(msgspec.structs.replace(moved, request_id="moved3"))
        assert res.cached_tokens == 32
        assert (eng3.prefix_queries - queries, eng3.prefix_hits - hits) == (100 - 64, 32)
        await eng3.close()
        await eng.close()
        await eng2.close()

    run(main())


def test_a_request_aborted_while_its_kv_is_on_the_way_never_lands() -> None:
    async def main() -> None:
        # 100 tokens of 128 KiB over 1 MB/s: ~13 s on the way.
        eng = SimEngine(SimEngineConfig(time_scale=1.0, kv_link_bytes_per_s=1e6))
        await eng.start()
        task = asyncio.create_task(eng.generate(
            Generate("moved", prompt_token_ids=list(range(1, 101)), sampling=Sampling(max_tokens=8), kv_tokens=100)))
        while "moved" not in eng.by_id:
            await asyncio.sleep(0)
        seq = eng.by_id["moved"]
        assert not eng.waiting and not eng.running and eng.stats().waiting == 0  # not in the batch's way
        await eng.abort("moved")
        res = await task
        assert res.status == "cancelled" and res.output_token_ids == []
        eng._landed(seq)  # its transfer ends after all
        assert not eng.waiting and eng.cache.match(list(range(1, 102))) == 0  # nothing landed, nothing cached
        await eng.close()

    run(main())


def test_the_sim_refuses_what_vllm_refuses_and_answers_the_rest() -> None:
    """Sampling parameters vLLM's SamplingParams refuses, and a prompt with no room for one token: each a
    client error of that request alone (what passes on the sim passes on vLLM)."""
    async def main() -> None:
        eng = SimEngine(SimEngineConfig(time_scale=0.01, max_model_len=64))
        await eng.start()
        bad = {"max_tokens=0": Sampling(max_tokens=0), "temperature=-1": Sampling(temperature=-1.0),
               "temperature=nan": Sampling(temperature=float("nan")), "top_p=0": Sampling(top_p=0.0),
               "n=0": Sampling(n=0), "n=2 greedy": Sampling(n=2, temperature=0.0)}
        for what, s in bad.items():
            res = await eng.generate(Generate(what, prompt_token_ids=[1, 2, 3], sampling=s))
            assert res.status == "client_error", what
        full = await eng.generate(gen("full", [1] * 64, 8))
        assert full.status == "client_error" and "max_model_len 64" in full.error
        ok = await eng.generate(gen("ok", [1] * 63, 8))
        assert ok.status == "ok" and len(ok.output_token_ids) == 1 and ok.finish_reason == "length"
        await eng.close()

    run(main())


def test_greedy_decoding_does_not_read_the_seed() -> None:
    """As vLLM's: at temperature 0 the seed changes nothing; sampled, it does."""
    cfg = SimEngineConfig()

    def plan(seed: int, temperature: float) -> list[int]:
        return plan_output(cfg, Generate("r", prompt_token_ids=list(range(1, 40)),
                                         sampling=Sampling(max_tokens=64, seed=seed, temperature=temperature)))[0]

    assert plan(1, 0.0) == plan(2, 0.0) and plan(1, 1.0) != plan(2, 1.0)
