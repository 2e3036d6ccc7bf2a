from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from toolkit.rundir import atomic_write, read_json


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
