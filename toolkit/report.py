"""``python -m toolkit.report RUN_DIR``: print a run's report as a table and (re)draw ``timeline.png``.

The timeline has one panel per step: requests in flight per engine group over time, as the router
saw them (``timeline/<job>.step_XXXXX.json``), with the tail flip marked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from toolkit.rundir import read_json


def load_timelines(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted((run_dir / "timeline").glob("*.json")):
        data = read_json(p)
        if data:
            out.append(data)
    return sorted(out, key=lambda d: (d["job"], d["step"]))


def draw_timeline(run_dir: Path, path: Path | None = None) -> Path | None:
    """Draw ``timeline.png``; None when the router recorded no step."""
    steps = load_timelines(run_dir)
    if not steps:
        return None
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
    out = path or run_dir / "timeline.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _fmt(x: Any, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    return format(x, spec) if isinstance(x, float) else str(x)


def report_table(report: dict[str, Any]) -> Table:
    table = Table(title=f"run report: {report.get('run_dir', '')}")
    for col in ("step", "wall s", "bound s", "wall/bound", "sessions", "last 10% of sessions", "tok/s", "reward", "prefix hit", "flip", "flip s",
                "spillover", "after flip by group", "failed requests"):
        table.add_column(col)
    for s in report.get("steps", []):
        flip = s.get("flip") or {}
        hit = s.get("prefix_hit_rate")
        bad = {k: v for k, v in s.get("requests_by_status", {}).items() if k != "ok"}
        tail10 = ((s.get("done_s") or {}).get("sessions") or {}).get("tail10_share")
        table.add_row(
            str(s["step"]), _fmt(s.get("wall_s")), _fmt(s.get("bound_s")), _fmt(s.get("bound_ratio")),
            str(s.get("sessions")),
            f"{100 * tail10:.0f}% of step" if tail10 is not None else "-", _fmt(s.get("tokens_per_s"), ",.0f"),
            _fmt(s.get("reward_mean"), ".3f"), f"{100 * hit:.1f}%" if hit is not None else "-",
            f"{flip.get('count')}/{flip.get('expected_count')}" if flip else "off",
            _fmt(flip.get("time_s")), _fmt(flip.get("spillover"), ".4f"),
            str(flip.get("requests_after_by_group", "-")) if flip else "-",
            str(bad or "-"),
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.report", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    console = Console()
    report = read_json(args.run_dir / "report.json")
    if report is None:
        console.print(f"[red]error:[/red] no report.json in {args.run_dir}")
        return 2
    console.print(report_table(report))
    summary = report.get("summary") or {}
    if summary:
        console.print(json.dumps(summary))
    png = draw_timeline(args.run_dir)
    console.print(f"timeline: {png}" if png else "timeline: no router timeline recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
