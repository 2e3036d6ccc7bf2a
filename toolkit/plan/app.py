"""``python -m toolkit.plan [overrides]``: launch's config, composed the same way (Hydra overrides,
``-m`` sweeps), run by the fleet twin instead of a fleet: no allocation, no process. Each run writes
``report.json`` (its step reports and the predictions) in its directory; a sweep ends with a ranked
table, ``plan_summary.csv`` and, with ``--plot``, ``plan_sweep.png``. ``replay=RUN_DIR`` runs a
finished run's own sessions instead (``toolkit/plan/replay.py``), its overrides under the new ones. What
the twin cannot run fails at setup with validation's errors, in one list, for every point of a sweep;
a run that would stop at its failure budget exits 1, as ``launch`` would."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from toolkit.config import CONF_DIR, Config, from_dictconfig, register_configs
from toolkit.core.errors import ConfigError, FieldError, ToolkitError
from toolkit.core.rundir import RunDir
from toolkit.launch.app import fail_point, hydra_cli
from toolkit.launch.composition import Setup
from toolkit.plan.replay import recorded
from toolkit.plan.summary import FIELDS, summarize
from toolkit.plan.sweep import OPTIONS
from toolkit.plan.twin import Twin, TwinRun, twin_errors

register_configs()

LABELS = {"step_time_s": "step time (mean)", "step_time_p90_s": "step time (p90)", "bound_ratio": "bound ratio",
          "samples_per_s": "samples/s", "fleet_busy_share": "fleet busy share", "prefix_hit": "prefix hit",
          "moves_per_step": "moves per step", "failed_share": "sessions failed", "twin_s": "twin's own time"}
TWIN = Setup(refusals=twin_errors)
"""A plan's config: launch's, and what the twin can run of it."""


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="plan")
def main(dcfg: DictConfig) -> None:
    console = Console()
    out = Path(HydraConfig.get().runtime.output_dir)
    logging.getLogger("toolkit").setLevel(logging.WARNING)  # a twin's replicas register by the thousand
    try:
        if OPTIONS["replay"]:
            rec = recorded(OPTIONS["replay"])
            cfg = rec.config([str(o) for o in HydraConfig.get().overrides.task])
            TWIN.validate(cfg)
            run = Twin(cfg, plan=rec.plan, gaps=rec.gaps).run()
        else:
            cfg = from_dictconfig(dcfg)
            TWIN.validate(cfg)
            run = Twin(cfg).run()
    except ToolkitError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        fail_point(2)
        return
    summary = summarize(run)
    report = {"status": "stopped" if run.stopped else "ok", "twin": True, "summary": summary,
              "virtual_s": run.virtual_s, "router": run.router, "replicas": run.replicas, "steps": run.steps}
    RunDir(out).report.write_text(json.dumps(report, indent=1, default=float))
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        _show(console, cfg, run, summary, out)
    if run.stopped:
        fail_point(1)


def _show(console: Console, cfg: Config, run: TwinRun, summary: dict[str, Any], out: Path) -> None:
    what = "replay" if OPTIONS["replay"] else "twin"
    ran = f"{len(run.steps)} of {cfg.steps}" if len(run.steps) < cfg.steps else f"{cfg.steps}"
    table = Table(title=f"{what}: {ran} steps of {cfg.sessions_per_step} sessions", show_header=False)
    table.add_column()
    table.add_column(justify="right")
    for k in FIELDS:
        v = summary[k]
        table.add_row(LABELS[k], "-" if v is None else f"{v:.3f}" if k != "samples_per_s" else f"{v:,.1f}")
    table.add_row("virtual time", f"{run.virtual_s:,.1f}s")
    console.print(table)
    if OPTIONS["replay"]:
        same, drawn = (len(s) for s in recorded(OPTIONS["replay"]).served)
        rest = (f"; {drawn} it did not record (not finished, or past its steps or sessions) from its workload"
                if drawn else "")
        console.print(f"replayed: {same} sessions as {OPTIONS['replay']} recorded them{rest}",
                      highlight=False, soft_wrap=True)
    if summary["stopped"]:
        console.print(f"[red]the run would stop:[/red] {summary['stopped']}", highlight=False, soft_wrap=True)
    console.print(f"[dim]{out / 'report.json'}[/dim]", soft_wrap=True)


def cli() -> None:
    """The plan's own options first (``--plot``, ``replay=RUN_DIR``: the run read once, here), then
    launch's checks of the overrides (on the replayed run's own, with the twin's refusals), then Hydra."""
    errors = []
    if "--plot" in sys.argv:
        sys.argv.remove("--plot")
        OPTIONS["plot"] = True
        if not {"-m", "--multirun"} & set(sys.argv):
            errors.append(FieldError("--plot", "", "with -m: it draws a sweep's step times"))
    replays = [a for a in sys.argv[1:] if a.startswith("replay=")]
    for arg in replays:
        sys.argv.remove(arg)
        OPTIONS["replay"] = arg.partition("=")[2]
    if replays and not OPTIONS["replay"]:
        errors.append(FieldError("replay", "", "a finished run's directory: replay=RUN_DIR"))
    setup = TWIN
    try:
        if errors:
            raise ConfigError(errors)
        if OPTIONS["replay"]:
            base = recorded(OPTIONS["replay"]).base([a for a in sys.argv[1:] if not a.startswith("-")])
            setup = Setup(tuple(base), twin_errors)
    except ToolkitError as exc:
        Console().print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    hydra_cli(main, setup)
