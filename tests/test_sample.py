from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.protocol import Result
from toolkit.rollout.columns import pack, to_table, write_parquet
from toolkit.rollout.sample import NonPrefixTurn, Sample

tokens = st.lists(st.integers(1, 30000), min_size=0, max_size=40)


@st.composite
def sessions(draw):  # type: ignore[no-untyped-def]
    prompt = draw(st.lists(st.integers(1, 30000), min_size=1, max_size=50))
    turns = draw(st.lists(st.tuples(tokens, tokens), min_size=0, max_size=5))
    return prompt, turns


def build(index: int, prompt: list[int], turns: list[tuple[list[int], list[int]]]) -> Sample:
    s = Sample.start(index, f"s{index}", prompt)
    for k, (out, obs) in enumerate(turns):
        context = list(s.tokens)
        res = Result(f"r{k}", output_token_ids=out, logprobs=[-0.5 - i for i in range(len(out))],
                     replica_id=f"rep{k % 2}", group="throughput" if k % 2 else "tail", cached_tokens=k,
                     weight_version=k // 2)
        s.add_turn(context, res)
        s.extend_observation(obs)
    return s


@given(sessions())
@settings(max_examples=200, deadline=None)
def test_merge_invariants(sess) -> None:  # type: ignore[no-untyped-def]
    prompt, turns = sess
    s = build(0, prompt, turns)
    s.check()
    assert s.tokens[: len(prompt)] == prompt
    assert s.generated_tokens == sum(len(o) for o, _ in turns)
    assert s.response_length == len(s.tokens) - len(prompt)
    # Generated tokens and their logprobs sit exactly where the mask is 1.
    gen = [t for t, m in zip(s.tokens, s.loss_mask, strict=True) if m]
    assert gen == [t for o, _ in turns for t in o]
    lps = [lp for lp, m in zip(s.rollout_logprobs, s.loss_mask, strict=True) if m]
    assert lps == [-0.5 - i for o, _ in turns for i in range(len(o))]


@given(st.lists(sessions(), min_size=1, max_size=8))
@settings(max_examples=40, deadline=None)
def test_parquet_round_trip(tmp_path_factory, batch) -> None:  # type: ignore[no-untyped-def]
    samples = [build(i, p, t) for i, (p, t) in enumerate(batch)]
    order = list(reversed(samples))  # rank order differs from index order
    groups = ["tail", "throughput"]
    table = to_table(pack(order, groups), groups, [s.session_id for s in order])
    path = Path(tmp_path_factory.mktemp("pq")) / "step.parquet"
    write_parquet(table, path)
    rows = pq.read_table(path).to_pylist()
    assert [r["index"] for r in rows] == list(range(len(samples)))
    for r, s in zip(rows, samples, strict=True):
        assert r["session_id"] == s.session_id
        assert r["tokens"] == s.tokens
        assert r["loss_mask"] == s.loss_mask
        assert np.allclose(r["rollout_logprobs"], s.rollout_logprobs)
        assert r["response_length"] == s.response_length
        assert r["num_turns"] == s.num_turns
        assert sorted(r["groups"]) == sorted(s.groups)
        assert r["weight_versions"] == s.weight_versions
        assert r["response"] == "" and r["response_decoded"] is False
        assert r["status"] == "completed"


def test_non_prefix_turn_is_caught() -> None:
    s = Sample.start(0, "s0", [1, 2, 3])
    s.add_turn([1, 2, 3], Result("a", output_token_ids=[7, 8], logprobs=[-1.0, -1.0]))
    with pytest.raises(NonPrefixTurn, match="first difference at position 3"):
        s.add_turn([1, 2, 3, 9], Result("b", output_token_ids=[4]))
    # A prompt that extends the accumulated tokens merges; the extension is masked out.
    s.add_turn([1, 2, 3, 7, 8, 50], Result("c", output_token_ids=[4], logprobs=[-2.0]))
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 1]
    s.check()


def test_loads_with_pandas(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    s = build(0, [1, 2], [([3, 4], [5])])
    write_parquet(to_table(pack([s], ["tail"]), ["tail"], ["x"]), tmp_path / "a.parquet")
    df = pd.read_parquet(tmp_path / "a.parquet")
    assert list(df["tokens"][0]) == [1, 2, 3, 4, 5]
