"""The Python API (``toolkit.samples``) over both output layouts, and loading step files with pyarrow,
pandas, polars and HF datasets (each skipped if not installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers.samples import N, OneRankComm, sample, write_run
from toolkit import samples as api
from toolkit.core.rundir import RunDir
from toolkit.model.tokenizer import ByteTokenizer
from toolkit.rollout.shards import gather_shard_info


@pytest.fixture(params=["gather", "shards"])
def run(request, tmp_path: Path) -> RunDir:  # type: ignore[no-untyped-def]
    return write_run(tmp_path / "run", request.param)


def test_read_step_gives_one_sorted_table_from_either_layout(run: RunDir) -> None:
    assert api.steps(run.root) == [0]
    table = api.read_step(run.root, 0)
    assert table.column("index").to_pylist() == list(range(N))
    got = api.to_samples(table)
    for g, want in zip(got, (sample(i) for i in range(N)), strict=True):
        assert g.rollout_logprobs == want.rollout_logprobs  # -0.25 is exact in float32
        assert g == want
    assert got[4].status == "failed" and "does not extend" in got[4].error
    slim = api.read_step(run, 0, columns=["tokens", "reward"])
    assert slim.column_names == ["tokens", "reward"]
    assert slim.column("reward").to_pylist() == [i / 10 for i in range(N)]


def test_iter_samples_streams_every_sample_of_every_step(run: RunDir) -> None:
    got = sorted(api.iter_samples(run.root, batch_size=2), key=lambda s: s.index)
    assert [s.index for s in got] == list(range(N))
    assert got == api.to_samples(api.read_step(run.root, 0))


def test_manifest_counts_rows_and_bytes(tmp_path: Path) -> None:
    rd = write_run(tmp_path / "run", "shards")
    m = json.loads((rd.steps / "step_00000" / "manifest.json").read_text())
    assert m["layout"] == "shards" and m["rows"] == N
    assert [s["rows"] for s in m["shards"]] == [4, 4, 3]
    assert [s["path"] for s in m["shards"]] == [f"step_00000/shard_{r:05d}.parquet" for r in range(3)]
    assert all(s["bytes"] == (rd.steps / s["path"]).stat().st_size for s in m["shards"])
    gathered = gather_shard_info(OneRankComm(), 5, 6)
    assert gathered is not None and gathered.tolist() == [[5, 6]]


def test_a_missing_step_names_both_layouts(tmp_path: Path) -> None:
    rd = write_run(tmp_path / "run", "gather")
    with pytest.raises(FileNotFoundError, match=r"step_00003.parquet nor step_00003/manifest.json"):
        api.step_files(rd.root, 3)


def test_decoded_responses_and_metadata_survive_the_file(tmp_path: Path) -> None:
    rd = write_run(tmp_path / "run", "gather", decoded=True)
    rows = pq.read_table(api.step_files(rd.root, 0)[0]).to_pylist()
    for r in rows:
        assert r["response_decoded"] is True and r["metadata"] == {"response_decoded": True}
        assert r["response"] == ByteTokenizer().decode(r["tokens"][r["prompt_length"]:])


@pytest.mark.parametrize("layout", ["gather", "shards"])
def test_step_files_load_with_pandas(tmp_path: Path, layout: str) -> None:
    pd = pytest.importorskip("pandas")
    rd = write_run(tmp_path / "run", layout)
    df = pd.concat([pd.read_parquet(f) for f in api.step_files(rd.root, 0)]).sort_values("index")
    assert df["index"].tolist() == list(range(N))
    assert list(df.iloc[1]["tokens"]) == sample(1).tokens
    assert df.iloc[0]["metadata"] == {"response_decoded": False}


@pytest.mark.parametrize("layout", ["gather", "shards"])
def test_step_files_load_with_polars(tmp_path: Path, layout: str) -> None:
    pl = pytest.importorskip("polars")
    rd = write_run(tmp_path / "run", layout)
    df = pl.read_parquet([str(f) for f in api.step_files(rd.root, 0)]).sort("index")
    assert df["index"].to_list() == list(range(N))
    assert df["tokens"][2].to_list() == sample(2).tokens
    assert df["rollout_logprobs"][2].to_list() == sample(2).rollout_logprobs
    assert df["metadata"].struct.field("response_decoded").to_list() == [False] * N
    assert df.filter(pl.col("status") == "failed")["index"].to_list() == [4]


@pytest.mark.parametrize("layout", ["gather", "shards"])
def test_step_files_load_with_hf_datasets(tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    rd = write_run(tmp_path / "run", layout)
    ds = datasets.load_dataset("parquet", data_files=[str(f) for f in api.step_files(rd.root, 0)],
                               split="train", cache_dir=str(tmp_path / "cache"))
    rows = sorted(ds.to_list(), key=lambda r: r["index"])  # shards come rank by rank
    assert ds.num_rows == N and [r["index"] for r in rows] == list(range(N))
    row = rows[3]
    assert row["tokens"] == sample(3).tokens and row["loss_mask"] == sample(3).loss_mask
    assert row["metadata"] == {"response_decoded": False} and row["response"] == ""


def test_carried_sessions_come_back_in_one_order_from_either_layout(tmp_path: Path) -> None:
    """A step closed on a count holds sessions carried from earlier steps: rows by ``started_step``, then
    index, whether one file holds them or each rank's shard."""
    import numpy as np

    from toolkit.rollout.shards import write_manifest, write_shard
    from toolkit.session.columns import pack, to_table, write_parquet
    from toolkit.session.sample import Sample, merge

    def landed(started: int, i: int) -> Sample:
        s = Sample.start(i, f"job/{started}/{i}", [7, i])
        s.started_step, s.carried, s.staleness = started, 1 - started, 1 - started
        return s

    per_rank = [[landed(1, 0), landed(1, 1)], [landed(0, 1), landed(1, 2)]]
    names = ["throughput"]

    def table(samples: list[Sample]) -> object:
        return to_table(pack(samples, names), names, [s.session_id for s in samples], sort=False)

    gather, shards = RunDir(tmp_path / "gather"), RunDir(tmp_path / "shards")
    for rd in (gather, shards):
        rd.make()
        rd.step_report(1).write_text("{}")
    write_parquet(table(per_rank[0] + per_rank[1]), gather.step_parquet(1))
    write_manifest(shards, 1, np.array([write_shard(shards, 1, r, table(ss)) for r, ss in enumerate(per_rank)],
                                       dtype=np.int64))
    want = ["job/0/1", "job/1/0", "job/1/1", "job/1/2"]
    for rd in (gather, shards):
        assert api.read_step(rd.root, 1, columns=["session_id"])["session_id"].to_pylist() == want
        carried = api.to_samples(api.read_step(rd.root, 1))[0]
        assert (carried.started_step, carried.carried, carried.staleness) == (0, 1, 1)
    a, b = landed(0, 1), landed(0, 1)
    b.tokens, b.prompt_length, b.loss_mask, b.rollout_logprobs = [7, 1, 9], 3, [0, 0, 0], [0.0] * 3
    b.carried, b.staleness = 2, 0
    assert (lambda m: (m.started_step, m.carried, m.staleness))(merge(a, b)) == (0, 2, 1)
