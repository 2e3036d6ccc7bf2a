"""``python -m toolkit.report``: the step table reads whole at 80 columns (a default terminal, a Slurm
log), a step per row when it fits, a step per column when it does not; numbers carry their units."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from toolkit.report.run_report import main as run_report_main
from toolkit.report.run_report import report_tables, si, summary_table


def step(i: int) -> dict:
    return {
        "step": i, "wall_s": 3.514, "bound_s": 1.82, "bound_ratio": 1.931, "sessions": 128,
        "done_s": {"sessions": {"tail10_share": 0.442}}, "tokens_per_s": 46230.0, "reward_mean": 0.61234,
        "prefix_hit_rate": 0.765, "tail": {"policy": "age", "moves": 43, "started": 17},
        "flip": {"count": 122, "expected_count": 122, "time_s": 2.31, "spillover": 0.0},
        "groups": {"throughput": {"requests": 300}, "tail": {"requests": 84}},
        "requests_by_status": {"ok": 383, "timeout": 1},
    }


REPORT = {"run_dir": "/runs/r1", "steps": [step(i) for i in range(10)],
          "summary": {"steps": 10, "sessions": 1280, "startup_s": 1.04, "step_wall_s_mean": 3.51,
                      "generated_tokens": 812345, "tokens_per_s": 46230.0,
                      "failed_requests": {"timeout": 5}, "replica_restarts": 0}}


def render(width: int, *renderables: object) -> str:
    console = Console(width=width, record=True)
    for r in renderables:
        console.print(r)
    return console.export_text()


def test_numbers_are_formatted_to_their_meaning() -> None:
    assert (si(950), si(4623), si(46230), si(1_250_000), si(None)) == ("950", "4.62k", "46.2k", "1.25M", "-")
    assert (si(999.7), si(999_700), si(999_999_999)) == ("1k", "1M", "1G")  # rounded before the unit is chosen


def test_at_80_columns_every_figure_is_whole_a_step_per_column() -> None:
    tables = report_tables(REPORT, 80)
    text = render(80, *tables)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert len(tables) == 2  # ten steps do not fit one 80-column table: split, none cut
    for cell in ("3.51s", "1.82s", "1.93x", "44%", "46.2k", "0.612", "76.5%", "122/122", "2.31s", "step 9"):
        assert cell in text, cell
    assert "req throughput" in text and "300" in text and "req tail" in text and "84" in text  # per group
    assert "{" not in text  # no dict printed in a cell


def test_a_wide_terminal_gets_a_step_per_row() -> None:
    (table,) = report_tables(REPORT, 200)
    text = render(200, table)
    assert "…" not in text
    rows = [line for line in text.splitlines() if "122/122" in line]
    assert len(rows) == 10 and all("3.51s" in r and "1.93x" in r and " 43 " in r and " 17 " in r for r in rows)


def test_the_summary_is_a_table_and_json_is_for_machines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = render(80, summary_table(REPORT["summary"]))
    assert "mean step time" in text and "3.51s" in text and "812,345" in text and "timeout 5" in text
    assert "{" not in text
    (tmp_path / "report.json").write_text(json.dumps(REPORT))
    capsys.readouterr()
    assert run_report_main([str(tmp_path), "--json"]) == 0  # python -m toolkit.report.run_report DIR --json
    assert json.loads(capsys.readouterr().out) == REPORT


def test_the_step_reports_tokens_are_the_engines_not_the_rows(tmp_path: Path) -> None:
    """A gateway session's n=2 turn makes two rows that share the first turn: the engines made 120
    tokens, the rows hold 220."""
    from toolkit.config import compose_config
    from toolkit.core.protocol import Result
    from toolkit.rollout.stepreport import step_report
    from toolkit.session.columns import ColumnBuilder
    from toolkit.session.requests import RequestLog
    from toolkit.session.sample import Sample

    cfg = compose_config([])
    groups = list(cfg.groups)
    log = RequestLog()
    first = Result("s/1", output_token_ids=[5] * 100, logprobs=[-0.1] * 100, group="throughput")
    log.add(first, None, 10, 0.0, 1.0, 0, 0)
    builder = ColumnBuilder(groups)
    for k in range(2):
        choice = Result(f"s/2/{k}", output_token_ids=[6 + k] * 10, logprobs=[-0.1] * 10, group="throughput")
        log.add(choice, None, 110, 1.0, 2.0, 0, 0)
        s = Sample.start(0, "s", [1] * 10)
        s.add_turn(list(s.tokens), first)
        s.add_turn(list(s.tokens), choice)
        s.branch = k
        builder.add(s)
    log.sessions_done_at.append(2.0)
    cols = builder.columns()
    assert int(cols["generated_tokens"].sum()) == 220
    report = step_report(0, 2.0, 0.0, cols, log.columns(groups), groups, cfg, None)
    assert report["generated_tokens"] == 120 and report["tokens_per_s"] == 60.0


def test_the_timeline_draws_the_last_steps_of_a_long_run(tmp_path: Path) -> None:
    from toolkit.core.rundir import RunDir
    from toolkit.report.run_report import TIMELINE_STEPS, draw_timeline

    rd = RunDir(tmp_path)
    rd.timelines.mkdir(parents=True)
    for k in range(40):
        rd.timeline("rollout", k).write_text(json.dumps(
            {"job": "rollout", "step": k, "t0": 1000.0 + k, "events": [[0.1, "tail", 1], [0.5, "tail", 0]]}))
    png = draw_timeline(tmp_path)
    assert png is not None
    from matplotlib import image

    height = image.imread(png).shape[0]  # pixels: a panel per drawn step
    assert height == round((2.4 * TIMELINE_STEPS + 0.6) * 110)


def test_a_run_still_going_is_reported_from_its_step_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from toolkit.core.rundir import RunDir
    from toolkit.report.run_report import current_report

    rd = RunDir(tmp_path)
    rd.steps.mkdir(parents=True)
    assert current_report(rd) is None
    for k in range(2):
        rd.step_report(k).write_text(json.dumps(step(k)))
    rd.lease.write_text(json.dumps({"epoch": 1, "released": False}))
    live = current_report(rd)
    assert live is not None and live["status"] == "running" and [s["step"] for s in live["steps"]] == [0, 1]
    capsys.readouterr()
    assert run_report_main([str(tmp_path)]) == 0  # python -m toolkit.report.run_report DIR
    assert "step" in capsys.readouterr().out
    # The launch ended and wrote its report: that one, whole.
    rd.report.write_text(json.dumps({**REPORT, "status": "ok", "steps": [step(0), step(1)]}))
    rd.lease.write_text(json.dumps({"epoch": 1, "released": True}))
    done = current_report(rd)
    assert done is not None and done["status"] == "ok" and done["summary"] == REPORT["summary"]


def test_stale_and_filtered_rows_are_written_but_not_counted_in_the_report() -> None:
    """Their rewards stay out of ``reward_mean``; the flip's expected count is where the router flips."""
    import numpy as np

    from toolkit.config import compose_config
    from toolkit.rollout.stepreport import step_report
    from toolkit.session.columns import ColumnBuilder
    from toolkit.session.requests import RequestLog
    from toolkit.session.sample import Sample

    cfg = compose_config(["sessions_per_step=4", "tail.threshold=0.5"])
    groups = list(cfg.groups)
    builder = ColumnBuilder(groups)
    for i, (status, reward) in enumerate([("completed", 1.0), ("completed", 0.0), ("stale", 1.0), ("filtered", 1.0)]):
        s = Sample.start(i, f"rollout/0/{i}", [1, 2])
        s.reward = reward
        s.mark(status)
        builder.add(s)
    cols = builder.columns()
    report = step_report(0, 2.0, 0.0, cols, RequestLog().columns(groups), groups, cfg, None)
    assert report["reward_mean"] == 0.5 and report["sessions"] == 4 and np.sum(cols["reward"]) == 3.0
    assert report["flip"]["expected_count"] == 2
