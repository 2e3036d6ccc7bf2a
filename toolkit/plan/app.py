"""``python -m toolkit.plan [overrides]``: launch's config, composed the same way (Hydra overrides,
``-m`` sweeps), run by the fleet twin instead of a fleet: no allocation, no process. Each run writes
``report.json`` (its step reports and the predictions) in its directory; a sweep ends with a ranked
table, ``plan_summary.csv`` and, with ``--plot``, ``plan_sweep.png``. ``replay=RUN_DIR`` runs a
finished run's own sessions instead (``toolkit/plan/replay.py``), its overrides under the new ones."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from toolkit.config import CONF_DIR, from_dictconfig, register_configs
from toolkit.core.errors import ToolkitError
from toolkit.core.rundir import RunDir
from toolkit.launch.app import fail_point, hydra_cli
from toolkit.launch.validation import validate
from toolkit.plan.replay import recorded
from toolkit.plan.summary import FIELDS, summarize
from toolkit.plan.sweep import OPTIONS
from toolkit.plan.twin import Twin

register_configs()

LABELS = {"step_time_s": "step time (mean)", "step_time_p90_s": "step time (p90)", "bound_ratio": "bound ratio",
          "samples_per_s": "samples/s", "fleet_busy_share": "fleet busy share", "prefix_hit": "prefix hit",
          "moves_per_step": "moves per step", "twin_s": "twin's own time"}


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="plan")
def main(dcfg: DictConfig) -> None:
    console = Console()
    out = Path(HydraConfig.get().runtime.output_dir)
    logging.getLogger("toolkit").setLevel(logging.WARNING)  # a twin's replicas register by the thousand
    try:
        if OPTIONS["replay"]:
            rec = recorded(OPTIONS["replay"])
            cfg = rec.config([str(o) for o in HydraConfig.get().overrides.task])
            validate(cfg)
            run = Twin(cfg, plan=rec.plan, gaps=rec.gaps).run()
        else:
            cfg = from_dictconfig(dcfg)
            validate(cfg)
            run = Twin(cfg).run()
    except ToolkitError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        fail_point(2)
        return
    summary = summarize(run)
    report = {"status": "ok", "twin": True, "summary": summary, "virtual_s": run.virtual_s,
              "router": run.router, "replicas": run.replicas, "steps": run.steps}
    RunDir(out).report.write_text(json.dumps(report, indent=1, default=float))
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return
    what = "replay" if OPTIONS["replay"] else "twin"
    table = Table(title=f"{what}: {cfg.steps} steps of {cfg.sessions_per_step} sessions", show_header=False)
    table.add_column()
    table.add_column(justify="right")
    for k in FIELDS:
        v = summary[k]
        table.add_row(LABELS[k], "-" if v is None else f"{v:.3f}" if k != "samples_per_s" else f"{v:,.1f}")
    table.add_row("virtual time", f"{run.virtual_s:,.1f}s")
    console.print(table)
    if OPTIONS["replay"]:
        console.print(f"replayed: the sessions of {OPTIONS['replay']}", highlight=False, soft_wrap=True)
    console.print(f"[dim]{out / 'report.json'}[/dim]", soft_wrap=True)


def cli() -> None:
    """The plan's own options first (``--plot``, ``replay=RUN_DIR``), then launch's checks of the
    overrides, then Hydra."""
    if "--plot" in sys.argv:
        sys.argv.remove("--plot")
        OPTIONS["plot"] = True
    for arg in [a for a in sys.argv[1:] if a.startswith("replay=")]:
        sys.argv.remove(arg)
        OPTIONS["replay"] = arg.partition("=")[2]
    hydra_cli(main)
