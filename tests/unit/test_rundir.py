from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from toolkit.core.rundir import RunDir, atomic_write, read_json


def test_read_json_retries_a_half_written_file(tmp_path: Path) -> None:
    path = tmp_path / "sentinel.json"
    path.write_text('{"job": "j", "st')  # a writer that does not rename, caught mid-write

    def finish() -> None:
        time.sleep(0.08)
        path.write_text(json.dumps({"job": "j", "step": 3}))

    t = threading.Thread(target=finish)
    t.start()
    try:
        assert read_json(path, retries=20, delay_s=0.02) == {"job": "j", "step": 3}
    finally:
        t.join()


def test_read_json_absent_is_none_and_atomic_write_leaves_no_temp(tmp_path: Path) -> None:
    assert read_json(tmp_path / "nope.json") is None
    atomic_write(tmp_path / "a" / "x.json", json.dumps({"k": 1}))
    assert read_json(tmp_path / "a" / "x.json") == {"k": 1}
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["x.json"]


def test_file_writer_never_blocks_its_caller_and_keeps_the_latest_content_in_order(tmp_path: Path,
                                                                                  monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import toolkit.core.rundir as rundir

    release = threading.Event()
    started = threading.Event()
    real = rundir.atomic_write

    def slow_disk(path: Path, data: bytes | str) -> None:  # the first write hangs until released
        if path.name == "a.json" and not release.is_set():
            started.set()
            assert release.wait(30)
        real(path, data)

    monkeypatch.setattr(rundir, "atomic_write", slow_disk)
    w = rundir.FileWriter()
    try:
        a, b = tmp_path / "a.json", tmp_path / "b.json"
        w.write(a, '{"v": 1}')
        assert started.wait(10)
        # The writer's thread is stuck in the file system; its callers are not.
        w.write(b, '{"v": 1}')
        w.write(b, '{"v": 2}')  # replaces the one not yet written
        assert w.pending(a) and w.pending(b) and not w.pending(tmp_path / "never.json")
        w.write(a, '{"v": 3}')
        w.remove(b)  # after the writes handed in before it
        w.write(tmp_path / "c.json", "{}")
        assert not w.flush(timeout_s=0.05) and not b.exists()
        release.set()
        assert w.flush(timeout_s=10)
        assert read_json(a) == {"v": 3} and not b.exists() and read_json(tmp_path / "c.json") == {}
        assert not w.pending(a) and w.error(a) is None
    finally:
        release.set()
        w.close()


def test_file_writer_logs_a_failed_write_and_goes_on(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    from toolkit.core.rundir import FileWriter

    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "x.json"
    w = FileWriter()
    w.write(bad, "{}")  # its directory is a file
    w.write(tmp_path / "ok.json", '{"k": 1}')
    assert w.flush(10)
    error = w.error(bad)
    assert error is not None and "Error" in error and not w.pending(bad)
    assert w.error(tmp_path / "ok.json") is None
    (tmp_path / "file").unlink()
    w.write(bad, "{}")  # written again: the error is the last write's
    w.close()
    assert w.error(bad) is None and read_json(bad) == {}
    assert read_json(tmp_path / "ok.json") == {"k": 1}
    assert any("writing" in r.getMessage() and "x.json" in r.getMessage() for r in caplog.records)


def test_a_torn_run_config_is_refused_not_read_as_defaults(tmp_path: Path) -> None:
    from toolkit.config import compose_config, load_run_config, save_run_config
    from toolkit.core.errors import ToolkitError
    from toolkit.core.rundir import RunDir

    rd = RunDir(tmp_path)
    cfg = compose_config(["steps=7"])
    save_run_config(cfg, rd.config)
    assert load_run_config(tmp_path).steps == 7
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]  # written whole, then renamed
    text = rd.config.read_text()
    for torn in ("", text[: text.index("\nsteps:")]):  # whole lines: YAML that lacks fields
        rd.config.write_text(torn)
        with pytest.raises(ToolkitError, match="is not a whole run config .* it lacks .*steps"):
            load_run_config(tmp_path)
    # Cut inside a line, wherever it falls: not YAML any more, refused just as clearly.
    for cut in range(1, text.index("\nsteps:"), 7):  # before `steps`: never a whole config
        rd.config.write_text(text[:cut])
        with pytest.raises(ToolkitError, match="is not a whole run config"):
            load_run_config(tmp_path)


def test_clear_steps_from_reads_step_numbers_of_any_width(tmp_path: Path) -> None:
    from toolkit.core.rundir import RunDir

    rd = RunDir(tmp_path)
    rd.steps.mkdir(parents=True)
    names = ["step_19999.json", "step_20000.parquet", "step_20000", "step_99999.json", "step_100000.json",
             "step_123456.parquet"]
    for n in names:
        (rd.steps / n).mkdir() if "." not in n else (rd.steps / n).write_text("{}")
    removed = sorted(p.name for p in rd.clear_steps_from(20000))  # six digits are not 10000 and 12345
    assert removed == sorted(names[1:]) and [p.name for p in rd.steps.iterdir()] == ["step_19999.json"]


def test_launch_follows_a_router_that_moved_on_its_own(tmp_path: Path) -> None:
    """A router Slurm requeued (preemption) comes back on new ports and writes its new address; launch,
    which did not restart it, finds it there once the old address stops answering."""
    from toolkit.config import compose_config
    from toolkit.launch.run import Run

    rd = RunDir(tmp_path / "run")
    rd.make()
    run = Run(compose_config([]), rd)
    run.address = {"frontend": "tcp://10.0.0.1:5000", "backend": "tcp://10.0.0.1:5001"}
    run._follow_router()  # no address file (yet): it stays
    assert run.address["frontend"] == "tcp://10.0.0.1:5000"
    moved = {"frontend": "tcp://10.0.0.2:6000", "backend": "tcp://10.0.0.2:6001", "pid": "7"}
    rd.router_address.write_text(json.dumps(moved))
    run._follow_router()
    assert run.address == moved
