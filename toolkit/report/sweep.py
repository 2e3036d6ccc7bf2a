"""The summary of a multirun sweep: one row per run, as CSV in the sweep dir and as a console table.

``python -m toolkit.launch -m tail.threshold=0.8,0.9,0.95`` runs the sweep (one run after another
locally; as Slurm jobs with ``hydra/launcher=submitit_slurm``). At the end Hydra calls
:class:`SweepSummary` (registered in ``conf/config.yaml`` under ``hydra.callbacks``), which reads
every run's ``report.json`` and writes ``<sweep dir>/sweep_summary.csv``.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from toolkit.core.rundir import RunDir
from toolkit.report.run_report import pct, si, table_width

logger = logging.getLogger(__name__)

SUMMARY_FILE = "sweep_summary.csv"
COLUMNS = ("run", "overrides", "status", "steps", "step_time_s", "flip_count", "flip_time_s", "spillover",
           "prefix_hit_rate", "tokens_per_s")


def _mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _overrides(run: Path) -> list[str]:
    return RunDir(run).read_overrides() or []


def run_row(run: Path) -> dict[str, Any]:
    """One run's row: its overrides and the means over its steps (flip point = sessions done when the
    step flipped to the tail group)."""
    row: dict[str, Any] = {k: None for k in COLUMNS}
    row["run"] = run.name
    row["overrides"] = _overrides(run)
    try:
        report = json.loads(RunDir(run).report.read_text())
    except (OSError, ValueError):
        row["status"] = "no report"
        return row
    steps = report.get("steps") or []
    flips = [s.get("flip") or {} for s in steps]
    row.update({
        "status": report.get("status"),
        "steps": len(steps),
        "step_time_s": _mean([s.get("wall_s") for s in steps]),
        "flip_count": _mean([f.get("count") for f in flips]),
        "flip_time_s": _mean([f.get("time_s") for f in flips]),
        "spillover": _mean([f.get("spillover") for f in flips]),
        "prefix_hit_rate": _mean([s.get("prefix_hit_rate") for s in steps]),
        "tokens_per_s": _mean([s.get("tokens_per_s") for s in steps]),
    })
    return row


def collect(sweep_dir: Path, only: set[str] | None = None) -> list[dict[str, Any]]:
    """Rows of every run under ``sweep_dir`` (a directory with a ``.hydra`` folder; ``only``: those of these
    names, the sweep's own jobs, not what an earlier sweep left in a reused directory), in job order;
    the overrides column keeps only what differs between runs (the swept values), and ``swept`` holds
    them as ``{key: value}``."""
    runs = sorted((p.parent for p in sweep_dir.glob("*/.hydra") if only is None or p.parent.name in only),
                  key=lambda p: (0, int(p.name)) if p.name.isdigit() else (1, p.name))
    rows = [run_row(r) for r in runs]
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if rows else set()
    for r in rows:
        differ = [o for o in r["overrides"] if o not in common]
        r["overrides"] = " ".join(differ)
        r["swept"] = dict(_split(o) for o in differ)
    return rows


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def swept_keys(rows: list[dict[str, Any]]) -> list[str]:
    """Every swept key, in the order they first appear."""
    return list(dict.fromkeys(k for r in rows for k in r.get("swept", {})))


def short_names(keys: list[str]) -> dict[str, str]:
    """Each key's last part (``tail.threshold`` -> ``threshold``), with more parts where two would clash."""
    out = {}
    for key in keys:
        parts = key.split(".")
        n = 1
        while n < len(parts) and sum(1 for k in keys if k.split(".")[-n:] == parts[-n:]) > 1:
            n += 1
        out[key] = ".".join(parts[-n:])
    return out


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.{digits}f}"
    return str(value)


def write_summary(sweep_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """The CSV: the fixed columns, then one per swept key under its full name."""
    path = sweep_dir / SUMMARY_FILE
    keys = swept_keys(rows)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*COLUMNS, *keys])
        w.writeheader()
        for r in rows:
            w.writerow({**{k: ("" if r[k] is None else r[k]) for k in COLUMNS},
                        **{k: r.get("swept", {}).get(k, "") for k in keys}})
    return path


Column = tuple[str, list[str], bool, int]
"""A table column: header, cells, right-aligned, rank (lower is dropped first when short of room;
97 and above always stay)."""


def summary_table(rows: list[dict[str, Any]], title: str, width: int = 80) -> Table:
    """One row per run; each swept key's value whole in its own column, headed by the key's last part,
    so the runs can be told apart in a ``width``-column terminal. Figures that do not fit are left
    out (the CSV has them all), the least telling first."""
    keys = swept_keys(rows)
    names = short_names(keys)
    # (header, cells, right-aligned, dropped when short of room: lower goes first)
    columns: list[Column] = [
        ("run", [r["run"] for r in rows], False, 99),
        *((names[k], [r.get("swept", {}).get(k, "-") for r in rows], False, 99) for k in keys),
        ("status", [_fmt(r["status"]) for r in rows], False, 99),
        ("step s", [_fmt(r["step_time_s"], 2) for r in rows], True, 98),
        ("flip", [_fmt(r["flip_count"], 1) for r in rows], True, 97),
        ("hit", [pct(r["prefix_hit_rate"]) for r in rows], True, 4),
        ("tok/s", [si(r["tokens_per_s"]) for r in rows], True, 3),
        ("flip s", [_fmt(r["flip_time_s"], 2) for r in rows], True, 2),
        ("spill", [pct(r["spillover"], 0) for r in rows], True, 1),
    ]
    return fitted_table(columns, len(rows), title, width)


def fitted_table(columns: list[Column], n_rows: int, title: str, width: int) -> Table:
    """A table of ``columns`` in ``width`` terminal columns: the least telling columns left out first."""
    for rank in sorted({c[3] for c in columns if c[3] < 97}):
        if table_width([[h, *cells] for h, cells, _, _ in columns]) <= width:
            break
        columns = [c for c in columns if c[3] != rank]
    table = Table(title=title)
    for header, _, right, _ in columns:
        table.add_column(header, justify="right" if right else "left", no_wrap=True)
    for i in range(n_rows):
        table.add_row(*(cells[i] for _, cells, _, _ in columns))
    return table


SWEEP_EXIT = [0]
"""The exit code a multirun sweep ends with: its worst run's. ``launch`` sets it for the points it runs in
its own process (1 if a run failed, 2 if one was invalid); :class:`SweepSummary` from the runs' reports
for every point (1 if one did not end ``ok``), wherever it ran (hydra-submitit-launcher's jobs: a point
that fails there returns normally, so that the others still run)."""


def sweep_exit(rows: list[dict[str, Any]]) -> int:
    """1 if a run of the sweep did not end ``ok`` (failed, or left no report: invalid, or killed), else 0."""
    return 1 if any(r["status"] != "ok" for r in rows) else 0


class SweepJobs(Callback):
    """Hydra callback that knows its sweep's jobs: the names of their directories as each ends (a launcher
    that runs them in other processes reports none here: then every run in the sweep directory counts)."""

    def __init__(self) -> None:
        self.jobs: set[str] = set()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        out = OmegaConf.select(job_return.hydra_cfg or {}, "hydra.runtime.output_dir")
        if out:
            self.jobs.add(Path(str(out)).name)

    def rows(self, sweep_dir: Path) -> list[dict[str, Any]]:
        return collect(sweep_dir, self.jobs or None)


class SweepSummary(SweepJobs):
    """Hydra callback: after a multirun, summarise its runs (CSV + console)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = self.rows(sweep_dir)
        if not rows:
            logger.warning("no runs found under %s; no sweep summary", sweep_dir)
            return
        SWEEP_EXIT[0] = max(SWEEP_EXIT[0], sweep_exit(rows))
        path = write_summary(sweep_dir, rows)
        console = Console()
        console.print(summary_table(rows, f"sweep summary ({len(rows)} runs)", console.width))
        console.print(f"[dim]{path}[/dim]")
