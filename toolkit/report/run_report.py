"""``python -m toolkit.report RUN_DIR``: print a run's report as a table and (re)draw ``timeline.png``.

The timeline has one panel per step: requests in flight per engine group over time, as the router
saw them (``timeline/<job>.step_XXXXX.json``), with the tail flip marked.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from toolkit.core.rundir import RunDir, read_json
from toolkit.samples import steps


def load_timelines(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(RunDir(run_dir).timelines.glob("*.json")):
        data = read_json(p)
        if data:
            out.append(data)
    return sorted(out, key=lambda d: (d["job"], d["step"]))


TIMELINE_STEPS = 12
"""Steps ``timeline.png`` draws (the last ones): one panel each, so a long run's figure stays a figure."""


def draw_timeline(run_dir: Path, path: Path | None = None, last: int = TIMELINE_STEPS) -> Path | None:
    """Draw ``timeline.png`` of the last ``last`` steps; None when the router recorded no step."""
    latest = sorted(load_timelines(run_dir), key=lambda d: d.get("t0", 0.0))[-last:]
    steps = sorted(latest, key=lambda d: (d["job"], d["step"]))
    if not steps:
        return None
    # matplotlib takes ~0.5 s to import: only when a timeline is drawn.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(steps)
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.4 * n + 0.6), squeeze=False, sharex=False)
    groups = sorted({g for s in steps for _, g, _ in s["events"]})
    colors = {g: plt.get_cmap("tab10")(i % 10) for i, g in enumerate(groups)}
    for ax, s in zip(axes[:, 0], steps, strict=True):
        for g in groups:
            pts = [(t, k) for t, gg, k in s["events"] if gg == g]
            if not pts:
                continue
            xs = [0.0] + [t for t, _ in pts]
            ys = [0] + [k for _, k in pts]
            ax.step(xs, ys, where="post", label=g, color=colors[g], linewidth=1.2)
        if s.get("flip_time") is not None:
            x = s["flip_time"] - s["t0"]
            ax.axvline(x, color="black", linestyle="--", linewidth=1)
            ax.annotate(f"flip at {s['flip_count']}", (x, ax.get_ylim()[1] * 0.9), xytext=(4, 0),
                        textcoords="offset points", fontsize=8)
        title = f"{s['job']} step {s['step']}"
        if s.get("migrated"):
            title += f" ({s['migrated']} migrated)"
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_ylabel("in flight")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since step begin")
    fig.tight_layout()
    out = path or RunDir(run_dir).timeline_png
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def si(x: float | None) -> str:
    """A rate or count to three figures with k/M: 950, 4.62k, 1.25M."""
    if x is None:
        return "-"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        # Rounded first: 999,700 is 1.00M, not 1e+03k.
        if abs(float(f"{x:.3g}")) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.0f}"


def secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _failed(s: dict[str, Any]) -> str:
    return str(sum(v for k, v in s.get("requests_by_status", {}).items() if k != "ok"))


def by_status(counts: dict[str, int], skip: str = "") -> str:
    """``{"completed": 30, "failed": 2}`` as "30 completed, 2 failed" (without ``skip``); "-" if none."""
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]) if k != skip) or "-"


def _carried(s: dict[str, Any]) -> str:
    return f"{s['carried_in']}/{s['carried_out']}" if s.get("close") == "count" else "-"


def _flip(s: dict[str, Any]) -> str:
    flip = s.get("flip")
    return "-" if not flip else f"{flip.get('count')}/{flip.get('expected_count')}" if flip.get("count") else "no"


STEP_FIELDS: list[tuple[str, str, Callable[[dict[str, Any]], str]]] = [
    # (header, what it is, cell): short headers so a step fits an 80-column line.
    ("step", "step", lambda s: str(s["step"])),
    ("wall", "wall time of the step", lambda s: secs(s.get("wall_s"))),
    ("bound", "its lower bound (critical path or throughput)", lambda s: secs(s.get("bound_s"))),
    ("/bound", "wall over bound", lambda s: times(s.get("bound_ratio"))),
    ("sess", "sessions", lambda s: str(s.get("sessions", "-"))),
    ("last10%", "share of the step the last 10% of sessions took",
     lambda s: pct(((s.get("done_s") or {}).get("sessions") or {}).get("tail10_share"), 0)),
    ("tok/s", "generated tokens per second", lambda s: si(s.get("tokens_per_s"))),
    ("reward", "mean reward", lambda s: "-" if s.get("reward_mean") is None else f"{s['reward_mean']:.3f}"),
    ("hit", "prefix-cache hit rate", lambda s: pct(s.get("prefix_hit_rate"))),
    ("moves", "requests moved to the tail group while running", lambda s: str((s.get("tail") or {}).get("moves", "-"))),
    ("started", "requests the policy started on the tail group (before any flip)",
     lambda s: str((s.get("tail") or {}).get("started", "-"))),
    ("flip", "sessions done at the flip / expected", _flip),
    ("flip@", "time of the flip", lambda s: secs((s.get("flip") or {}).get("time_s"))),
    ("not done", "sessions by status, other than completed (failed, truncated, stale, filtered...)",
     lambda s: by_status(s.get("sessions_by_status") or {}, "completed")),
    ("carried", "sessions carried in / on (rollout.close=count)", _carried),
    ("req fail", "requests that did not end ok", _failed),
]


def step_fields(report: dict[str, Any]) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    """The columns of the step table: :data:`STEP_FIELDS` and the requests of each engine group."""
    groups = sorted({g for s in report.get("steps", []) for g in (s.get("groups") or {})})
    fields = [(h, f) for h, _, f in STEP_FIELDS]
    at = len(fields) - 1
    for g in groups:
        fields.insert(at, (f"req {g}", lambda s, g=g: str(((s.get("groups") or {}).get(g) or {}).get("requests", 0))))
        at += 1
    return fields


def table_width(columns: list[list[str]]) -> int:
    """Characters a rich table (default box, padding 1) needs for these columns (header included)."""
    return sum(max(len(c) for c in col) + 3 for col in columns) + 1


def report_tables(report: dict[str, Any], width: int) -> list[Table]:
    """The steps as one table, a step per row, when it fits ``width``; else the same figures a step per
    column (a figure per row), in as many tables as it takes: no cell is ever cut."""
    fields = step_fields(report)
    steps = report.get("steps", [])
    cells = [[f(s) for _, f in fields] for s in steps]
    title = "steps"
    if table_width([[h, *(row[i] for row in cells)] for i, (h, _) in enumerate(fields)]) <= width:
        table = Table(title=title)
        for h, _ in fields:
            table.add_column(h, justify="left" if h == "step" else "right", no_wrap=True)
        for row in cells:
            table.add_row(*row)
        return [table]
    label = ["", *(h for h, _ in fields[1:])]
    chunks: list[list[list[str]]] = []
    for row in cells:
        column = [f"step {row[0]}", *row[1:]]
        if chunks and table_width([label, *chunks[-1], column]) <= width:
            chunks[-1].append(column)
        else:
            chunks.append([column])
    return [_vertical(title if i == 0 else "", label, c) for i, c in enumerate(chunks)]


def _vertical(title: str, label: list[str], columns: list[list[str]]) -> Table:
    table = Table(title=title or None)
    table.add_column("", no_wrap=True)
    for col in columns:
        table.add_column(col[0], justify="right", no_wrap=True)
    for i, name in enumerate(label[1:], start=1):
        table.add_row(name, *(col[i] for col in columns))
    return table


SUMMARY_FIELDS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("steps", "steps", str),
    ("sessions", "sessions", str),
    ("startup_s", "startup", secs),
    ("step_wall_s_mean", "mean step time", secs),
    ("generated_tokens", "generated tokens", lambda v: f"{v:,}"),
    ("tokens_per_s", "tokens/s", si),
    ("sessions_by_status", "sessions by status", lambda v: by_status(v or {})),
    ("failed_requests", "failed requests", lambda v: ", ".join(f"{k} {n}" for k, n in v.items()) or "none"),
    ("replica_restarts", "replica restarts", str),
    ("router_restarts", "router restarts", str),
    ("resumes", "resumes", str),
]


def summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title="summary", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column()
    for key, name, fmt in SUMMARY_FIELDS:
        if key in summary:
            table.add_row(name, "-" if summary[key] is None else fmt(summary[key]))
    return table


def current_report(rd: RunDir) -> dict[str, Any] | None:
    """``report.json`` with every step report on disk: a run still going (or killed, or resumed and
    going again) has steps its last report.json does not hold yet, or none at all."""
    report = read_json(rd.report)
    on_disk = [r for r in (read_json(rd.step_report(k)) for k in steps(rd)) if r]
    if report is None and not on_disk:
        return None
    lease = read_json(rd.lease)
    held = isinstance(lease, dict) and not lease.get("released", False)
    report = dict(report or {"run_dir": str(rd.root), "status": "stopped without a report", "summary": None})
    if held or {r.get("step") for r in on_disk} - {r.get("step") for r in report.get("steps") or []}:
        report["status"] = "running" if held else report["status"]
        report["steps"] = on_disk
        report["summary"] = None  # report.json's, if any, is of an earlier launch
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.report", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", action="store_true", help="print report.json (steps and summary) and stop")
    args = parser.parse_args(argv)
    console = Console()
    report = current_report(RunDir(args.run_dir))
    if report is None:
        console.print(f"[red]error:[/red] neither report.json nor a step report in {args.run_dir}")
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    console.print(f"run report: {report.get('run_dir') or args.run_dir}", highlight=False)
    for table in report_tables(report, console.width):
        console.print(table)
    summary = report.get("summary") or {}
    if summary:
        console.print(summary_table(summary))
    png = draw_timeline(args.run_dir)
    console.print(f"timeline: {png}" if png else "timeline: no router timeline recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
