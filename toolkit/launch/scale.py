"""``python -m toolkit.launch.scale RUN_DIR throughput=4 tail=2``: change a running run's replica counts.

The request goes into ``<run dir>/scale.json`` (a sequence number and the counts); the run's launch
applies it within a fraction of a second (:class:`toolkit.launch.replicas.ReplicaSet`): new replicas start and
join their group once ready; removed ones are drained (their requests migrate to the others, or with
``--finish`` end where they are) and exit. Nothing is lost and no request is answered twice. The same
from Python::

    from toolkit.launch.scale import scale
    scale("outputs/run1", {"throughput": 4, "tail": 2}, wait_s=600)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from toolkit.config import load_run_config
from toolkit.core.errors import ConfigError, FieldError, ToolkitError
from toolkit.core.lease import LeaseRecord
from toolkit.core.rundir import RunDir, atomic_write, read_json


class ScaleTimeout(ToolkitError):
    """The run did not reach the asked counts in time."""


def request(run_dir: str | Path, groups: dict[str, int], migrate: bool = True) -> int:
    """Ask the run in ``run_dir`` for these replica counts; returns the request's sequence number.
    Raises ConfigError naming every unknown group or bad count, ToolkitError if no launch runs there."""
    rd = RunDir(Path(run_dir))
    if not rd.config.exists():
        raise ToolkitError(f"{rd.root} holds no run (no config.yaml)")
    cfg = load_run_config(rd.root)
    errors = []
    for g, n in groups.items():
        if g not in cfg.groups:
            errors.append(FieldError(g, n, f"one of the run's groups {sorted(cfg.groups)}"))
        elif not isinstance(n, int) or isinstance(n, bool) or n < 0:
            errors.append(FieldError(g, n, "a replica count, an integer >= 0"))
    if errors:
        raise ConfigError(errors)
    lease = LeaseRecord.read(rd)
    if lease is None or lease.released:
        raise ToolkitError(f"no launch is running {rd.root} (its lease is {'released' if lease else 'missing'}): "
                           "set groups.<name>.replicas when you resume it instead")
    prev = read_json(rd.scale_request) or {}
    seq = int(prev.get("seq", 0)) + 1
    atomic_write(rd.scale_request, json.dumps({"seq": seq, "groups": {**prev.get("groups", {}), **groups},
                                               "migrate": migrate, "t": time.time()}))
    return seq


def state(run_dir: str | Path) -> dict[str, Any] | None:
    """What launch has applied: ``applied_seq`` and per group ``target``, ``members`` (replicas
    started), ``draining``, ``ready`` (serving, from the router)."""
    return read_json(RunDir(Path(run_dir)).scale_state)


def settled(st: dict[str, Any] | None, seq: int, groups: dict[str, int]) -> bool:
    if st is None or st.get("applied_seq", 0) < seq:
        return False
    return all(st["groups"][g]["members"] == n and st["groups"][g]["draining"] == 0
               and st["groups"][g]["ready"] == n for g, n in groups.items())


def scale(run_dir: str | Path, groups: dict[str, int], migrate: bool = True,
          wait_s: float | None = None) -> dict[str, Any] | None:
    """Request the counts; with ``wait_s``, wait until every named group has exactly that many ready
    replicas and none draining (ScaleTimeout after ``wait_s``). Returns the last state seen."""
    seq = request(run_dir, groups, migrate)
    if wait_s is None:
        return state(run_dir)
    deadline = time.monotonic() + wait_s
    while not settled(st := state(run_dir), seq, groups):
        if st and st.get("applied_seq", 0) >= seq and st.get("error"):
            raise ToolkitError(f"launch could not apply the request: {st['error']}")
        if time.monotonic() > deadline:
            raise ScaleTimeout(f"not scaled to {groups} after {wait_s:.0f}s; state: {st}")
        time.sleep(0.2)
    return st


def _parse(items: list[str]) -> dict[str, int]:
    groups: dict[str, int] = {}
    errors = []
    for item in items:
        name, eq, count = item.partition("=")
        if not eq or not count.strip().isdigit():
            errors.append(FieldError(item, item, "GROUP=COUNT, e.g. throughput=4"))
        else:
            groups[name] = int(count)
    if errors:
        raise ConfigError(errors)
    return groups


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m toolkit.launch.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("counts", nargs="+", help="GROUP=COUNT, e.g. throughput=4 tail=2")
    p.add_argument("--finish", action="store_true",
                   help="removed replicas finish the requests they hold (default: those migrate to the others)")
    p.add_argument("--wait", type=float, default=None, metavar="S",
                   help="wait up to S seconds until the counts are reached (ready and nothing draining)")
    args = p.parse_args(argv)
    try:
        st = scale(args.run_dir, _parse(args.counts), migrate=not args.finish, wait_s=args.wait)
    except ToolkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    groups = (st or {}).get("groups", {})
    for g, s in groups.items():
        print(f"{g}: target {s['target']}, started {s['members']}, ready {s['ready']}, draining {s['draining']}")
    if not args.wait:
        print("requested; launch applies it within a second (--wait S waits until it is done)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
