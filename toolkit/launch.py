"""``python -m toolkit.launch [overrides]``: compose -> validate -> run dir -> start -> steps -> teardown.

A Hydra app: ``--cfg job`` prints the config, ``-m`` sweeps. The run directory is Hydra's output
directory; it receives the resolved ``config.yaml``, ``steps/``, ``report.json`` and ``logs/``.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from toolkit.cluster import preflight
from toolkit.config import Config, from_dictconfig, register_configs, save_run_config
from toolkit.errors import ToolkitError
from toolkit.rundir import RunDir
from toolkit.validation import validate

logger = logging.getLogger(__name__)

register_configs()


def _raise_on_sigterm() -> None:
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def run(cfg: Config, run_dir: RunDir, console: Console) -> dict:
    """Run a validated config in ``run_dir``; always tears down what it started."""
    from toolkit.run import Run

    run_dir.ensure_unused()
    run_dir.make()
    save_run_config(cfg, run_dir.config)
    with Run(cfg, run_dir, console) as r:
        try:
            console.print(f"[dim]run dir {run_dir.root}[/dim]")
            r.start()
            console.print(f"ready in {r.t_ready - r.t_start:.1f}s: router + "
                          + ", ".join(f"{c.replicas} {g}" for g, c in cfg.groups.items())
                          + f" replica(s); {cfg.ranks} rank(s)")
            summary = r.execute()
        except BaseException as exc:
            r.teardown()
            r.write_report(None, error=f"{type(exc).__name__}: {exc}")
            raise
    r.write_report(summary)
    from toolkit.report import draw_timeline

    draw_timeline(run_dir.root)
    print_summary(console, summary, run_dir)
    return summary


def print_summary(console: Console, summary: dict, run_dir: RunDir) -> None:
    table = Table(title="rollout summary", show_header=False)
    table.add_row("steps", str(summary["steps"]))
    table.add_row("sessions", str(summary["sessions"]))
    table.add_row("startup", f"{summary['startup_s']:.1f}s" if summary["startup_s"] else "-")
    table.add_row("mean step time", f"{summary['step_wall_s_mean']:.2f}s" if summary["step_wall_s_mean"] else "-")
    table.add_row("generated tokens", f"{summary['generated_tokens']:,}")
    table.add_row("tokens/s", f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "-")
    table.add_row("failed requests", str(summary["failed_requests"] or "none"))
    table.add_row("outputs", f"{run_dir.steps}/step_*.parquet, {run_dir.report}, {run_dir.root / 'timeline.png'}")
    console.print(table)


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    console = Console()
    run_dir = RunDir(Path(HydraConfig.get().runtime.output_dir))
    try:
        cfg = from_dictconfig(dcfg)
        validate(cfg)
        preflight(cfg, run_dir.root)
        run_dir.ensure_unused()
    except ToolkitError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        sys.exit(2)
    _raise_on_sigterm()
    try:
        run(cfg, run_dir, console)
    except ToolkitError as exc:
        console.print(f"[red]run failed:[/red] {exc}", highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: every component was stopped[/yellow]")
        sys.exit(130)


if __name__ == "__main__":
    main()
