from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit import samples as api
from toolkit.core.protocol import Result, join_versions
from toolkit.model.tokenizer import ByteTokenizer
from toolkit.session.columns import (
    STAT_COLUMNS,
    ColumnBuilder,
    StatBuilder,
    final_rows,
    pack,
    to_table,
    write_parquet,
)
from toolkit.session.sample import NonPrefixTurn, Sample, merge

tokens = st.lists(st.integers(1, 30000), min_size=0, max_size=40)


@st.composite
def sessions(draw):  # type: ignore[no-untyped-def]
    prompt = draw(st.lists(st.integers(1, 30000), min_size=1, max_size=50))
    turns = draw(st.lists(st.tuples(tokens, tokens), min_size=0, max_size=5))
    return prompt, turns


def turn_versions(k: int) -> list[int]:
    """Turn k's versions: odd turns straddle an in-place update ([0, 1], [1, 2], ...)."""
    return join_versions([k // 2, (k + 1) // 2])


def build(index: int, prompt: list[int], turns: list[tuple[list[int], list[int]]], first_turn: int = 0) -> Sample:
    s = Sample.start(index, f"s{index}", prompt)
    for k, (out, obs) in enumerate(turns, first_turn):
        context = list(s.tokens)
        res = Result(f"r{k}", output_token_ids=out, logprobs=[-0.5 - i for i in range(len(out))],
                     replica_id=f"rep{k % 2}", group="throughput" if k % 2 else "tail", cached_tokens=k,
                     weight_version=(k + 1) // 2, weight_versions=turn_versions(k))
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
def test_the_stats_alone_are_every_columns_scalars(batch) -> None:  # type: ignore[no-untyped-def]
    """The twin's packer (the scalars a step report reads) gives what a rank's gives for them, twice over
    (each ``columns()`` starts the builder empty again)."""
    groups = ["tail", "throughput"]
    whole, stats = ColumnBuilder(groups), StatBuilder(groups)
    for _ in range(2):
        for i, (p, t) in enumerate(batch):
            s = build(i, p, t)
            s.groups.update(g for g in groups if i % 2)
            whole.add(s)
            stats.add(s)
        assert len(stats) == len(whole) == len(batch)
        full, alone = whole.columns(), stats.columns()
        assert list(alone) == list(STAT_COLUMNS)
        for name in STAT_COLUMNS:
            assert alone[name].dtype == full[name].dtype and alone[name].tolist() == full[name].tolist()


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
        assert r["turn_weight_versions"] == s.turn_weight_versions == [turn_versions(k) for k in range(s.num_turns)]
        assert r["response"] == "" and r["response_decoded"] is False
        assert r["metadata"] == {"response_decoded": False}
        assert r["replicas"] == sorted(s.replicas)
        assert r["status"] == "completed" and r["error"] == ""


def test_a_turn_that_straddles_an_update_lists_both_versions() -> None:
    s = Sample.start(0, "s0", [1, 2])
    s.add_turn([1, 2], Result("a", output_token_ids=[3, 4], weight_version=0, weight_versions=[0]))
    s.add_turn([1, 2, 3, 4], Result("b", output_token_ids=[5, 6, 7], weight_version=2, weight_versions=[0, 2]))
    s.add_turn([1, 2, 3, 4, 5, 6, 7], Result("c", output_token_ids=[8], weight_version=2))  # an old Result: scalar only
    assert s.turn_weight_versions == [[0], [0, 2], [2]]
    assert s.weight_versions == [0, 2]  # ordered, each once
    row = api.from_row(to_table(pack([s], ["tail"]), ["tail"], ["s0"]).to_pylist()[0])
    assert row.turn_weight_versions == s.turn_weight_versions and row.weight_versions == s.weight_versions


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


# Token ids the byte tokenizer maps to printable ASCII, so decoding pieces and decoding the whole agree.
ascii_tokens = st.lists(st.integers(5 + 32, 5 + 126), min_size=0, max_size=30)


@st.composite
def split_sessions(draw):  # type: ignore[no-untyped-def]
    """A session, a split point in its turns, and an observation between the two halves."""
    prompt = draw(st.lists(st.integers(5 + 32, 5 + 126), min_size=1, max_size=30))
    turns = draw(st.lists(st.tuples(ascii_tokens, ascii_tokens), min_size=0, max_size=5))
    k = draw(st.integers(0, len(turns)))
    extra = draw(ascii_tokens)
    return prompt, turns, k, extra


def whole_and_halves(prompt, turns, k, extra):  # type: ignore[no-untyped-def]
    a = build(0, prompt, turns[:k])
    b = build(0, a.tokens + extra, turns[k:], first_turn=k)
    whole = build(0, prompt, turns[:k])
    whole.extend_observation(extra)
    for t, (out, obs) in enumerate(turns[k:], k):
        whole.add_turn(list(whole.tokens), Result(f"r{t}", output_token_ids=out, logprobs=[-0.5 - i for i in range(len(out))],
                                                  replica_id=f"rep{t % 2}", group="throughput" if t % 2 else "tail",
                                                  cached_tokens=t, weight_version=(t + 1) // 2,
                                                  weight_versions=turn_versions(t)))
        whole.extend_observation(obs)
    return whole, a, b


@given(split_sessions())
@settings(max_examples=200, deadline=None)
def test_merge_of_two_halves_is_the_whole_session(case) -> None:  # type: ignore[no-untyped-def]
    whole, a, b = whole_and_halves(*case)
    m = merge(a, b)
    m.check()
    assert len(m.tokens) == len(m.loss_mask) == len(m.rollout_logprobs) == m.prompt_length + m.response_length
    for name in ("tokens", "loss_mask", "rollout_logprobs", "prompt_length", "num_turns", "generated_tokens",
                 "cached_tokens", "weight_versions", "turn_weight_versions", "replicas", "groups", "status"):
        assert getattr(m, name) == getattr(whole, name), name
    assert m.response == "" and m.metadata == {"response_decoded": False}


@given(split_sessions())
@settings(max_examples=100, deadline=None)
def test_merge_decodes_the_observation_only_when_both_were_decoded(case) -> None:  # type: ignore[no-untyped-def]
    tok = ByteTokenizer()
    whole, a, b = whole_and_halves(*case)
    whole.decode_response(tok)
    a.decode_response(tok)
    b.decode_response(tok)
    m = merge(a, b, tok)
    assert m.response_decoded and m.response == whole.response
    assert m.metadata == {"response_decoded": True}
    # One side undecoded: the merge is undecoded, and no tokenizer is needed.
    _, a2, b2 = whole_and_halves(*case)
    b2.decode_response(tok)
    m2 = merge(a2, b2)
    assert m2.response == "" and not m2.response_decoded
    if case[3]:  # an observation between the halves cannot be decoded without a tokenizer
        with pytest.raises(ValueError, match="pass a tokenizer"):
            merge(a, b)


def test_merge_catches_a_non_prefix_continuation() -> None:
    a = build(0, [10, 11, 12], [([20, 21], [30])])
    b = build(0, [10, 11, 99, 20, 21, 30, 40], [([50], [])])
    with pytest.raises(NonPrefixTurn, match="first difference at position 2"):
        merge(a, b)
    short = build(0, [10, 11], [([50], [])])
    with pytest.raises(NonPrefixTurn):
        merge(a, short)
    other = Sample.start(1, "s1", a.tokens + [1])
    with pytest.raises(ValueError, match="one session"):
        merge(a, other)


def test_merge_keeps_the_worse_status_and_both_errors() -> None:
    a = build(0, [1, 2], [([3], [4])])
    b = build(0, a.tokens, [([5], [])])
    b.mark("truncated", "context reached max_model_len")
    m = merge(a, b)
    assert m.status == "truncated" and m.error == "context reached max_model_len"
    a.mark("failed", "boom")
    assert merge(a, b).status == "failed" and merge(a, b).error == "boom; context reached max_model_len"


def test_merge_keeps_the_branch_and_the_whole_recorded_conversation() -> None:
    a = build(0, [1, 2], [([3], [4])])
    a.branch, a.messages = 2, '[{"role": "user", "content": "hi"}]'
    b = build(0, a.tokens, [([5], [])])
    b.branch, b.messages = 2, '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]'
    m = merge(a, b)
    assert m.branch == 2 and m.messages == b.messages


def test_logprobs_an_engine_did_not_send_are_nan_and_the_row_says_so() -> None:
    s = Sample.start(0, "s0", [1, 2])
    s.add_turn([1, 2], Result("r0", output_token_ids=[7, 8], logprobs=[-0.1, -0.2]))
    s.add_turn(list(s.tokens), Result("r1", output_token_ids=[9, 10, 11], logprobs=[-0.3]))  # short
    s.add_turn(list(s.tokens), Result("r2", output_token_ids=[12, 13], logprobs=[-0.4, float("nan")]))
    s.check()
    lps = s.rollout_logprobs[2:]
    assert lps[:2] == [-0.1, -0.2] and all(np.isnan(lps[2:5])) and lps[5] == -0.4 and np.isnan(lps[6])
    assert s.status == "completed" and s.error == (
        "turn 1: 3 of 3 tokens have no logprob from the engine (NaN); "
        "turn 2: 1 of 2 tokens have no logprob from the engine (NaN)")


@given(split_sessions(), st.booleans())
@settings(max_examples=30, deadline=None)
def test_a_merged_sample_round_trips_through_parquet(tmp_path_factory, case, decoded) -> None:  # type: ignore[no-untyped-def]
    tok = ByteTokenizer()
    _, a, b = whole_and_halves(*case)
    if decoded:
        a.decode_response(tok)
        b.decode_response(tok)
    m = merge(a, b, tok)
    if not decoded:
        m.mark("failed", "a reason with ünïcode")
    path = Path(tmp_path_factory.mktemp("rt")) / "m.parquet"
    api.write_samples([m], path)
    [back] = api.to_samples(pq.read_table(path))
    f32 = np.asarray(m.rollout_logprobs, dtype=np.float32).tolist()
    assert back.rollout_logprobs == f32
    back.rollout_logprobs = m.rollout_logprobs
    assert back == m


def test_write_parquet_sorts_by_index_one_row_group_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import toolkit.session.columns as columns

    monkeypatch.setattr(columns, "ROW_GROUP_TOKENS", 20)  # a few rows per group
    batch = [build(i, [1 + i] * (3 + i % 4), [([7] * (1 + i % 3), [8])]) for i in range(30)]
    order = batch[0::3] + batch[1::3] + batch[2::3]  # rank order of three ranks
    table = to_table(pack(order, ["tail", "throughput"]), ["tail", "throughput"], sort=False)
    assert table.column("index").to_pylist() != list(range(30))
    write_parquet(table, tmp_path / "s.parquet")
    f = pq.ParquetFile(tmp_path / "s.parquet")
    assert f.num_row_groups > 3
    rows = f.read().to_pylist()
    assert [r["index"] for r in rows] == list(range(30))
    assert [r["tokens"] for r in rows] == [s.tokens for s in batch]


def test_sessions_packed_as_they_end_keep_their_rows_together_and_write_sorted(tmp_path: Path) -> None:
    """A rank packs each session as it ends, so its rows come in completion order: each session's rows
    (a branch, then its final line) stay together with the final one last, and the step's file is in
    index order with a session's branch still before its final line. The builder keeps nothing."""
    groups = ["tail", "throughput"]
    batch = {i: build(i, [1 + i] * (2 + i % 3), [([7] * (1 + i % 4), [8]), ([9] * i, [])]) for i in range(6)}
    branch = build(2, [3] * 4, [([5] * 3, [])])
    branch.branch = 1
    builder = ColumnBuilder(groups)
    ended = [[batch[3]], [batch[5]], [branch, batch[2]], [batch[0]], [batch[4]], [batch[1]]]
    for session in ended:
        for sample in session:
            builder.add(sample)
    cols = builder.columns()
    assert len(builder) == 0 and all(a.size == 0 for a in builder.columns().values())
    assert cols["index"].tolist() == [3, 5, 2, 2, 0, 4, 1]
    assert final_rows(cols).tolist() == [True, True, False, True, True, True, True]
    write_parquet(to_table(cols, groups, sort=False), tmp_path / "s.parquet")
    rows = pq.read_table(tmp_path / "s.parquet").to_pylist()
    assert [(r["index"], r["branch"]) for r in rows] == [(0, 0), (1, 0), (2, 1), (2, 0), (3, 0), (4, 0), (5, 0)]
    assert [r["tokens"] for r in rows] == [batch[0].tokens, batch[1].tokens, branch.tokens,
                                           *(batch[k].tokens for k in range(2, 6))]


def test_a_copy_shares_no_container_with_its_original() -> None:
    """An ``n > 1`` turn's choices each grow a copy of the line: a list or set they shared would mix
    their tokens (every container field, present or added later, must be copied)."""
    import dataclasses

    s = Sample.start(3, "job/0/3", [1, 2, 3])
    s.weight_versions, s.turn_weight_versions, s.replicas, s.groups = [1], [[1]], {"r0"}, {"g"}
    c = s.copy()
    assert c == s
    for f in dataclasses.fields(Sample):
        value = getattr(s, f.name)
        if isinstance(value, list | set | dict):
            assert getattr(c, f.name) is not value, f.name
    assert all(a is not b for a, b in zip(c.turn_weight_versions, s.turn_weight_versions, strict=True))


def test_text_that_is_not_utf8_is_escaped_and_its_sample_packed_whole() -> None:
    """An environment's error naming a file decoded with surrogateescape: one failed row, not a rank's step."""
    from toolkit.session.columns import ColumnBuilder, to_table

    builder = ColumnBuilder(["throughput"])
    bad = Sample.start(0, "j/0/0", [1, 2, 3])
    bad.mark("failed", "environment raised OSError: " + b"caf\xff.txt".decode("utf-8", "surrogateescape"))
    builder.add(bad)
    builder.add(Sample.start(1, "j/0/1", [4]))
    cols = builder.columns()
    assert cols["tokens__len"].tolist() == [3, 1] and cols["index"].tolist() == [0, 1]
    table = to_table(cols, ["throughput"], ["j/0/0", "j/0/1"])
    assert table.column("error").to_pylist()[0] == "environment raised OSError: caf\\udcff.txt"
