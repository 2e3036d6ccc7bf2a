"""The end of a ``python -m toolkit.plan -m`` sweep: every point's predictions, ranked by step time (a
point whose run would stop at its failure budget last, marked ``x``), in a table of 80 columns and
``plan_summary.csv``; the setting that moved step time most; ``--plot`` draws step time against the first
swept value (a line per value of the second)."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from toolkit.core.rundir import RunDir
from toolkit.plan.summary import FIELDS, difference
from toolkit.report.run_report import pct
from toolkit.report.sweep import Column, SweepJobs, _fmt, fitted_table, short_names, swept_keys

logger = logging.getLogger(__name__)

SUMMARY_FILE = "plan_summary.csv"
PLOT_FILE = "plan_sweep.png"
OPTIONS: dict[str, Any] = {"plot": False, "replay": ""}
"""The plan's command-line options beyond Hydra's (``--plot``, ``replay=RUN_DIR``)."""


def plan_rows(sweep_dir: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (the sweep's runs) with their predictions, fastest first, those that would stop last."""
    for r in rows:
        try:
            summary = json.loads(RunDir(sweep_dir / r["run"]).report.read_text())["summary"]
        except (OSError, ValueError, KeyError):
            summary = {}
        r.update({k: summary.get(k) for k in FIELDS})
        r["stopped"] = summary.get("stopped") or ""
    return sorted(rows, key=lambda r: (bool(r["stopped"]), r["step_time_s"] is None, r["step_time_s"] or 0.0))


def write_csv(sweep_dir: Path, rows: list[dict[str, Any]]) -> Path:
    keys = swept_keys(rows)
    path = sweep_dir / SUMMARY_FILE
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["rank", "run", *keys, *FIELDS, "stopped"])
        w.writeheader()
        for i, r in enumerate(rows, 1):
            w.writerow({"rank": i, "run": r["run"], **{k: r["swept"].get(k, "") for k in keys},
                        **{k: "" if r[k] is None else r[k] for k in FIELDS}, "stopped": r["stopped"]})
    return path


def plan_table(rows: list[dict[str, Any]], width: int = 80) -> Table:
    keys = swept_keys(rows)
    names = short_names(keys)
    columns: list[Column] = [
        ("#", [f"{i}x" if r["stopped"] else str(i) for i, r in enumerate(rows, 1)], True, 99),
        *((names[k], [r["swept"].get(k, "-") for r in rows], False, 99) for k in keys),
        ("step s", [_fmt(r["step_time_s"], 2) for r in rows], True, 98),
        ("p90 s", [_fmt(r["step_time_p90_s"], 2) for r in rows], True, 5),
        ("bound", [_fmt(r["bound_ratio"], 2) for r in rows], True, 97),
        ("smp/s", [_fmt(r["samples_per_s"], 1) for r in rows], True, 4),
        ("busy", [pct(r["fleet_busy_share"], 0) for r in rows], True, 3),
        ("hit", [pct(r["prefix_hit"], 0) for r in rows], True, 2),
        ("moves", [_fmt(r["moves_per_step"], 1) for r in rows], True, 1),
        ("fail", [pct(r["failed_share"], 0) for r in rows], True, 6),
    ]
    return fitted_table(columns, len(rows), f"plan: {len(rows)} configs, fastest first", width)


def verdict(rows: list[dict[str, Any]]) -> str:
    """The best point, how much it gains over the worst, and the setting that made the difference, among
    the points whose runs would not stop; and those that would."""
    timed = [r for r in rows if r["step_time_s"] is not None and not r["stopped"]]
    stopped = [r for r in rows if r["stopped"]]
    tail = (f"; {len(stopped)} would stop at their failure budget (x): " + ", ".join(r["overrides"] or r["run"]
                                                                                     for r in stopped)
            if stopped else "")
    if not timed:
        return ("no point would run to its end" if stopped else "no point ran") + tail
    best, worst = timed[0], timed[-1]
    line = (f"best: {best['overrides'] or best['run']} at {best['step_time_s']:.2f}s a step, "
            f"{1 - best['step_time_s'] / worst['step_time_s']:.0%} below the slowest")
    moved = difference(timed, swept_keys(timed))
    if moved is not None:
        line += f"; {moved[0]} made the most difference ({moved[1]:.2f}s between its values' means)"
    return line + tail


def plot(sweep_dir: Path, rows: list[dict[str, Any]]) -> Path | None:
    import matplotlib  # heavy, and only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(rows)
    if not keys:
        return None
    x_key, line_key = keys[0], (keys[1] if len(keys) > 1 else None)
    drawn = [r for r in rows if r["step_time_s"] is not None and not r["stopped"] and x_key in r["swept"]]
    if not drawn:
        return None
    values = list(dict.fromkeys(r["swept"][x_key] for r in drawn))
    try:
        xs = {v: float(v) for v in values}
        ticks = None
    except ValueError:  # a choice (router.policy=...): one place on the axis a value, in sweep order
        xs = {v: float(i) for i, v in enumerate(values)}
        ticks = values
    lines: dict[str, list[tuple[float, float]]] = {}
    for r in drawn:
        label = f"{line_key}={r['swept'].get(line_key)}" if line_key else "step time"
        lines.setdefault(label, []).append((xs[r["swept"][x_key]], r["step_time_s"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if ticks is not None:
        ax.set_xticks(range(len(ticks)), ticks)
    ax.set_xlabel(x_key)
    ax.set_ylabel("predicted step time (s)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = sweep_dir / PLOT_FILE
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class PlanSweep(SweepJobs):
    """Hydra callback of ``toolkit.plan``: after a multirun, rank its points (table, CSV, plot)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = plan_rows(sweep_dir, self.rows(sweep_dir))
        if not rows:
            logger.warning("no twin runs under %s", sweep_dir)
            return
        console = Console()
        console.print(plan_table(rows, min(console.width, 80)))
        console.print(verdict(rows), highlight=False, soft_wrap=True)
        console.print(f"[dim]{write_csv(sweep_dir, rows)}[/dim]")
        if OPTIONS["plot"]:
            path = plot(sweep_dir, rows)
            console.print(f"[dim]{path}[/dim]" if path is not None else
                          "--plot: no point ran to its end with a swept value to draw")
