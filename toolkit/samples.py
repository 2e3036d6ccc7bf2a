"""The Python API for trainers: read a step's samples from either output layout, merge samples, write them.

::

    from toolkit import samples

    samples.steps(run_dir)                      # [0, 1, ...]: the steps whose outputs are complete
    table = samples.read_step(run_dir, 0)       # pyarrow.Table, one row per session, sorted by index
    table = samples.wait_step(run_dir, 0, 600)  # the same, once the step is written (a trainer's loop)
    files = samples.step_files(run_dir, 0)      # the Parquet files (for pandas, polars, HF datasets)
    for s in samples.iter_samples(run_dir, 0):  # Sample objects, streamed one row group at a time
        ...
    c = samples.merge(a, b)                     # one session's sample a continued by sample b
    samples.write_samples([c], "mine.parquet")  # the same schema as the step files

Both layouts (``rollout.output=gather``: ``steps/step_XXXXX.parquet``; ``shards``:
``steps/step_XXXXX/manifest.json`` + one shard per rank) read the same way. A step counts as written
once its report ``steps/step_XXXXX.json`` exists (rank 0 writes it last).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from functools import reduce
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from toolkit.core.errors import ToolkitError
from toolkit.core.rundir import RunDir, read_json
from toolkit.core.slurmctl import queued_states
from toolkit.model.tokenizer import Tokenizer
from toolkit.session.columns import pack
from toolkit.session.columns import to_table as _to_table
from toolkit.session.columns import write_parquet as _write_parquet
from toolkit.session.sample import NonPrefixTurn, Sample, merge

__all__ = ["NonPrefixTurn", "RunEnded", "Sample", "StepTimeout", "StepUnavailable", "from_row", "iter_samples",
           "merge", "merge_all", "read_step", "step_files", "steps", "to_samples", "to_table", "wait_step",
           "write_samples"]

_REPORT = re.compile(r"^step_(\d{5,})\.json$")


def _run_dir(run_dir: str | Path | RunDir) -> RunDir:
    return run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))


def steps(run_dir: str | Path | RunDir) -> list[int]:
    """The steps of a run whose outputs are complete (their report exists), in order."""
    d = _run_dir(run_dir).steps
    found = (_REPORT.match(p.name) for p in d.iterdir()) if d.is_dir() else iter(())
    return sorted(int(m.group(1)) for m in found if m)


def step_files(run_dir: str | Path | RunDir, step: int) -> list[Path]:
    """The Parquet files of one step: one file (gather) or the shards in rank order (shards)."""
    rd = _run_dir(run_dir)
    d = rd.steps
    single = rd.step_parquet(step)
    if single.is_file():
        return [single]
    manifest = rd.step_manifest(step)
    if manifest.is_file():
        info = json.loads(manifest.read_text())
        return [d / s["path"] for s in info["shards"]]
    raise FileNotFoundError(f"step {step} has no output in {d}: neither {single.name} nor {manifest.relative_to(d)}")


def read_step(run_dir: str | Path | RunDir, step: int, columns: list[str] | None = None) -> pa.Table:
    """One step as an Arrow table, its rows sorted by ``started_step`` (a step closed on a count holds
    sessions carried from earlier ones), then session index, whatever the layout."""
    files = step_files(run_dir, step)
    keys = [k for k in ("started_step", "index") if k in pq.read_schema(files[0]).names]
    cols = None if columns is None else list(dict.fromkeys([*columns, *keys]))
    tables = [pq.read_table(f, columns=cols) for f in files]
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    if len(tables) > 1:  # (one file is written in that order)
        table = table.take(pc.sort_indices(table, [(k, "ascending") for k in keys]))
    extra = [k for k in keys if columns is not None and k not in columns]
    return table.drop_columns(extra) if extra else table


class StepUnavailable(ToolkitError):
    """:func:`wait_step` cannot return the step: it ran out of time, or the run ended without it."""


class StepTimeout(StepUnavailable):
    """The step's report did not appear within ``timeout_s``."""


class RunEnded(StepUnavailable):
    """The run ended (``report.json``: ok, failed or interrupted) without writing the step."""


def _progress(run_dir: Path) -> str:
    done = steps(run_dir)
    return f"the last step with a report is {done[-1]}" if done else "no step has a report yet"


def _run_ended(rd: RunDir) -> dict[str, Any] | None:
    """``report.json`` if it says the run is over: its launch released the lease (a resumed run takes
    the lease first, so an old report no longer counts) and it was not requeued to go on by itself."""
    report = read_json(rd.report)
    if not isinstance(report, dict):
        return None
    lease = read_json(rd.lease)
    if isinstance(lease, dict) and not lease.get("released", False):
        return None  # a launch holds the run: the report is from before a resume, or about to be released
    events = rd.read_events()
    if report.get("status") == "interrupted":
        if events and events[-1].get("kind") == "requeue":
            return None  # an sbatch job requeued itself: it resumes at its next start
        job = lease.get("slurm_job") if isinstance(lease, dict) else ""
        if job and _slurm_job_queued(str(job)):
            return None  # its SIGTERM was Slurm's preemption (or scontrol requeue): it resumes by itself
    return report


_QUEUED: dict[str, tuple[float, bool]] = {}
_QUEUED_POLL_S = 10.0
"""squeue at most this often per job: a trainer may wait hours for a requeued job to start."""


def _slurm_job_queued(job: str) -> bool:
    """Whether Slurm still lists ``job`` as live (pending again after a requeue), where squeue runs."""
    at, queued = _QUEUED.get(job, (-_QUEUED_POLL_S, False))
    if time.monotonic() - at < _QUEUED_POLL_S:
        return queued
    if shutil.which("squeue") is None:
        return False
    listed = queued_states({job})
    queued = listed is None or job in listed  # squeue failed: nothing says the run is over
    _QUEUED[job] = (time.monotonic(), queued)
    return queued


def wait_step(run_dir: str | Path | RunDir, step: int, timeout_s: float, poll_s: float = 0.2,
              columns: list[str] | None = None) -> pa.Table:
    """Step ``step`` as :func:`read_step` returns it, once it is written (its report exists): a
    trainer's wait for the rollout. Raises :class:`StepTimeout` after ``timeout_s``, and
    :class:`RunEnded` at once if the run ended (``report.json``: failed, interrupted, or ok with
    fewer steps) without it; both name the run dir, the step and how far the run got."""
    rd = _run_dir(run_dir)
    report_path = rd.step_report(step)
    deadline = time.monotonic() + timeout_s
    while True:
        if report_path.exists():
            return read_step(rd, step, columns)
        ended = _run_ended(rd)
        if ended is not None:
            if report_path.exists():  # written just before the run's report
                return read_step(rd, step, columns)
            why = f": {ended['error']}" if ended.get("error") else ""
            raise RunEnded(f"run {rd.root} ended ({ended.get('status')}{why}) without step {step}; "
                           f"{_progress(rd.root)}")
        if time.monotonic() >= deadline:
            raise StepTimeout(f"step {step} of run {rd.root} was not written within {timeout_s:g}s; "
                              f"{_progress(rd.root)}")
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def from_row(row: dict[str, Any]) -> Sample:
    """A :class:`Sample` from one row of a step file (logprobs come back at float32 precision)."""
    return Sample(
        index=row["index"], session_id=row["session_id"], tokens=list(row["tokens"]),
        loss_mask=list(row["loss_mask"]), rollout_logprobs=list(row["rollout_logprobs"]),
        prompt_length=row["prompt_length"], reward=row["reward"], status=row["status"],
        num_turns=row["num_turns"], generated_tokens=row["generated_tokens"], cached_tokens=row["cached_tokens"],
        weight_versions=list(row["weight_versions"]),
        turn_weight_versions=[list(t) for t in row.get("turn_weight_versions") or ()],
        replicas=set(row.get("replicas") or ()),
        groups=set(row.get("groups") or ()), response=row.get("response") or "",
        response_decoded=bool(row.get("response_decoded", False)), error=row.get("error") or "",
        branch=int(row.get("branch") or 0), messages=row.get("messages") or "",
        started_step=int(_or(row.get("started_step"), -1)), carried=int(row.get("carried") or 0),
        staleness=int(row.get("staleness") or 0),
    )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def to_samples(table: pa.Table) -> list[Sample]:
    return [from_row(r) for r in table.to_pylist()]


def iter_samples(run_dir: str | Path | RunDir, step: int | None = None, batch_size: int = 256) -> Iterator[Sample]:
    """Samples of one step (or of every complete step), streamed in file order: by index within a file;
    with shards, rank by rank (use :func:`read_step` for one index-sorted table)."""
    for s in [step] if step is not None else steps(run_dir):
        for f in step_files(run_dir, s):
            for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_size):
                yield from (from_row(r) for r in batch.to_pylist())


def to_table(samples: Iterable[Sample], group_names: list[str] | None = None) -> pa.Table:
    """Samples as a table with the step files' schema, sorted by index."""
    items = list(samples)
    names = group_names if group_names is not None else sorted({g for s in items for g in s.groups})
    return _to_table(pack(items, names), names, [s.session_id for s in items])


def write_samples(samples: Iterable[Sample], path: str | Path) -> int:
    """Write samples as one Parquet file with the step files' schema; returns its size in bytes."""
    return _write_parquet(to_table(samples), Path(path))


def merge_all(parts: Iterable[Sample], tokenizer: Tokenizer | None = None) -> Sample:
    """Fold :func:`merge` over one session's samples in order."""
    return reduce(lambda a, b: merge(a, b, tokenizer), parts)
