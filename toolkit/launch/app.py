"""``python -m toolkit.launch [overrides]``: compose -> validate -> run dir -> lease -> start -> steps -> teardown.

A Hydra app: ``--cfg job`` prints the config, ``-m`` sweeps. The run directory is Hydra's output
directory; it receives the resolved ``config.yaml``, ``steps/``, ``report.json`` and ``logs/``.
``resume=true`` continues the run a directory holds (``toolkit/launch/resume.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from toolkit.cluster import preflight
from toolkit.config import CONF_DIR, Config, from_dictconfig, register_configs, save_run_config
from toolkit.core.errors import Interrupted, ToolkitError
from toolkit.core.lease import Lease, LeaseRecord, previous_incarnation
from toolkit.core.rundir import RunDir, atomic_write
from toolkit.core.slurmctl import requeue
from toolkit.launch import resume
from toolkit.launch.composition import LAUNCH, Setup, precheck
from toolkit.launch.resume import check
from toolkit.launch.run import STOP, Run
from toolkit.launch.validation import validate
from toolkit.report.run_report import by_status, draw_timeline
from toolkit.report.sweep import SWEEP_EXIT

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = 75
"""EX_TEMPFAIL: the run stopped cleanly before its last step; ``resume=true`` continues it."""

register_configs()


def _raise_on_sigterm() -> None:
    """SIGTERM, SIGHUP and SIGINT end the run through its teardown (``KeyboardInterrupt``), once: a later
    SIGTERM or SIGHUP (the kernel's SIGHUP after the shell's, logind's SIGTERM then SIGHUP, Slurm's
    SIGTERMs) must not cut that teardown short; a later Ctrl-C still does, as a user asking twice means.
    A SIGHUP, first or not, means the terminal is gone: launch's writes to it go nowhere from then on."""
    # A dropped SSH session: a teardown and a report rather than a death that leaves the jobs to the
    # lease (unless launch runs under nohup, which asked for SIGHUP to be ignored).
    hup = signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN
    terminal = [fd for fd in (1, 2) if os.isatty(fd)]  # known now: a hung-up terminal answers no ioctl

    def tearing_down(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            _leave_terminal(terminal)

    def first(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, tearing_down)
        if hup:
            signal.signal(signal.SIGHUP, tearing_down)
        tearing_down(signum, frame)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, first)
    signal.signal(signal.SIGINT, first)
    if hup:
        signal.signal(signal.SIGHUP, first)


def _leave_terminal(fds: list[int]) -> None:
    """The terminal hung up: every write to it fails (EIO), and the teardown prints. What launch writes
    there goes nowhere from now on (the run's report and logs are in its run dir)."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            os.dup2(null, fd)
    finally:
        os.close(null)


def check_run_dir(cfg: Config, run_dir: RunDir) -> bool:
    """True to resume the run ``run_dir`` holds (refused if the config changed what it generates);
    False for a new run (refused if the directory holds one and ``resume`` is off)."""
    if cfg.resume and run_dir.holds_run():
        check(cfg, run_dir)
        return True
    run_dir.ensure_unused()
    return False


def run(cfg: Config, run_dir: RunDir, console: Console, overrides: list[str] | None = None) -> dict:
    """Run a validated config in ``run_dir`` (or continue it, with ``resume``); always tears down
    what it started and releases the run's lease. ``overrides``: the command line's, kept with the run
    by the launch that makes it (``RunDir.overrides``)."""
    resuming = check_run_dir(cfg, run_dir)
    run_dir.make()
    lease = Lease(run_dir, cfg.cluster.lease_s)
    epoch = lease.acquire()
    try:
        if overrides is not None and not run_dir.overrides.exists():
            atomic_write(run_dir.overrides, yaml.safe_dump(list(overrides)))
        first = 0
        if resuming:
            first = resume.prepare(run_dir, epoch, cfg, overrides).first_step
            run_dir.append_event("resume", step=first, epoch=epoch, slurm_job=os.environ.get("SLURM_JOB_ID"),
                                 slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
            console.print(f"resuming {run_dir.root} at step {first + 1} of {cfg.steps}")
        save_run_config(cfg, run_dir.config)
        return _run_steps(cfg, run_dir, console, first, lease)
    finally:
        lease.release()


def _run_steps(cfg: Config, run_dir: RunDir, console: Console, first: int, lease: Lease) -> dict:
    with Run(cfg, run_dir, console, lease) as r:
        try:
            console.print(f"[dim]run dir {run_dir.root}[/dim]")
            if first >= cfg.steps:
                console.print(f"every one of the {cfg.steps} steps is already done")
                r.load_previous(first)
                summary = r.summary()
            else:
                r.start()
                console.print(f"ready in {r.t_ready - r.t_start:.1f}s: router + "
                              + ", ".join(f"{c.replicas} {g}" for g, c in cfg.groups.items())
                              + f" replica(s); {cfg.ranks} rank(s)")
                summary = r.execute(first)
        except Interrupted as exc:
            # The job's time is running out: the requeue comes before the trackers' uploads (Run's exit
            # closes them), whose minutes would otherwise let the time limit end the job as TIMEOUT.
            r.stop_components()
            r.write_report(r.summary(), error=str(exc), status="interrupted")
            _requeue(cfg, run_dir, console)
            raise
        except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM (scancel, preemption, scontrol requeue)
            name = str(exc) or "SIGINT"
            # First: Slurm's SIGKILL follows its SIGTERM after KillWait, maybe before the teardown ends.
            run_dir.append_event("signal", signal=name, step=r.next_step)
            r.teardown()
            r.write_report(r.summary(), error=f"stopped by {name} during step {r.next_step}", status="interrupted")
            raise
        except BaseException as exc:
            r.teardown()
            r.write_report(None, error=f"{type(exc).__name__}: {exc}")
            raise
    r.write_report(summary)
    try:
        draw_timeline(run_dir.root)
    except Exception as exc:  # a figure: the run and its files are whole without it
        logger.warning("could not draw %s: %r", run_dir.timeline_png, exc)
    print_summary(console, summary, run_dir)
    return summary


def _requeue(cfg: Config, run_dir: RunDir, console: Console) -> None:
    """Inside an sbatch job (``cluster=allocation``), after a clean stop: put the job back in the queue;
    its next start sees ``SLURM_RESTART_COUNT`` and resumes (``slurm/*.sbatch``)."""
    job = os.environ.get("SLURM_JOB_ID")
    if cfg.cluster.type != "allocation" or not job:
        console.print(f"[yellow]stopped; continue with resume=true hydra.run.dir={run_dir.root}[/yellow]")
        return
    console.print(f"[yellow]requeueing Slurm job {job}; it resumes at its next start[/yellow]")
    # The event first: the SIGTERM that ends this incarnation of the job can come as soon as scontrol
    # has requeued it. Everything is stopped and written by then: that SIGTERM has nothing left to
    # interrupt but the lease's release.
    run_dir.append_event("requeue", slurm_job=job)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    error = requeue(job)
    if error:
        # Trainers waiting on the run (toolkit.samples) must not wait for a job that will not come back.
        run_dir.append_event("requeue_failed", slurm_job=job, error=error)
        logger.error("scontrol requeue %s failed: %s", job, error)
        console.print(f"[red]scontrol requeue {job} failed: {error}; continue with resume=true "
                      f"hydra.run.dir={run_dir.root}[/red]")


def print_summary(console: Console, summary: dict, run_dir: RunDir) -> None:
    table = Table(title="rollout summary", show_header=False)
    table.add_column()
    table.add_column(overflow="fold")  # paths wrap, never cut
    table.add_row("steps", str(summary["steps"]))
    table.add_row("sessions", str(summary["sessions"]))
    table.add_row("startup", f"{summary['startup_s']:.1f}s" if summary["startup_s"] else "-")
    table.add_row("mean step time", f"{summary['step_wall_s_mean']:.2f}s" if summary["step_wall_s_mean"] else "-")
    table.add_row("generated tokens", f"{summary['generated_tokens']:,}")
    table.add_row("tokens/s", f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "-")
    table.add_row("sessions by status", by_status(summary.get("sessions_by_status") or {}))
    table.add_row("failed requests", str(summary["failed_requests"] or "none"))
    table.add_row("outputs", f"{run_dir.steps}/step_*.parquet, {run_dir.report}, {run_dir.timeline_png}")
    console.print(table)


def fail_point(code: int) -> None:
    """A run failed: a single run exits with ``code``; in a sweep the other points still run (Hydra
    would stop at a SystemExit, with no ``sweep_summary.csv``), and the sweep exits with it at the end."""
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        sys.exit(code)
    SWEEP_EXIT[0] = max(SWEEP_EXIT[0], code)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(dcfg: DictConfig) -> None:
    STOP.install()  # from the start: SIGUSR1's default action would end launch without a teardown
    console = Console()
    run_dir = RunDir(Path(HydraConfig.get().runtime.output_dir))
    try:
        cfg = from_dictconfig(dcfg)
        if not cfg.resume and (rec := LeaseRecord.read(run_dir)) is not None and previous_incarnation(rec):
            # Requeued with the command line it started with (a hydra-submitit sweep point: submitit requeues
            # it as it was): the run it made goes on, as the sbatch template's resume=true would have it.
            console.print(f"Slurm job {rec.slurm_job} was requeued: its run in {run_dir.root} resumes")
            cfg = dataclasses.replace(cfg, resume=True)
        validate(cfg)
        preflight(cfg, run_dir.root)
        check_run_dir(cfg, run_dir)
    except ToolkitError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        fail_point(2)
        return
    _raise_on_sigterm()
    try:
        run(cfg, run_dir, console, [str(o) for o in HydraConfig.get().overrides.task])
    except Interrupted as exc:
        console.print(f"[yellow]interrupted:[/yellow] {exc}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_INTERRUPTED)  # a sweep stops too: its job is ending (a signal before the time limit)
    except ToolkitError as exc:
        console.print(f"[red]run failed:[/red] {exc}", highlight=False, soft_wrap=True)
        fail_point(1)
    except Exception as exc:
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            raise  # a single run: the traceback, as any program's
        # A sweep's point: it fails, the other points run, and the sweep's summary lists it.
        logger.exception("sweep point %s failed", run_dir.root)
        console.print(f"[red]run failed:[/red] {type(exc).__name__}: {exc} (traceback in the point's log)",
                      highlight=False, soft_wrap=True)
        fail_point(1)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: every component was stopped[/yellow]")
        sys.exit(130)


def hydra_cli(app: Callable[[], None], setup: Setup = LAUNCH) -> None:
    """Run the Hydra ``app`` on ``sys.argv``: the overrides are checked first (against ``setup``), so that a
    composition error comes back as the toolkit's error list (``toolkit/launch/composition.py``); a sweep
    exits with its worst point's code."""
    try:
        precheck(sys.argv[1:], setup)
    except ToolkitError as exc:
        Console().print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    app()
    if SWEEP_EXIT[0]:
        sys.exit(SWEEP_EXIT[0])


def cli() -> None:
    """``python -m toolkit.launch``: :func:`main` through :func:`hydra_cli`."""
    hydra_cli(main)


if __name__ == "__main__":
    cli()
