"""lifecycle helpers that need no other component."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PRINT_STDOUT_FILE = "import sys; from toolkit.lifecycle import stdout_file; print(stdout_file(), file=sys.stderr)"


def test_stdout_file_names_the_log_a_job_prints_to_and_nothing_else(tmp_path: Path) -> None:
    log = tmp_path / "job_log.out"
    with open(log, "w") as out:
        got = subprocess.run([sys.executable, "-c", PRINT_STDOUT_FILE], stdout=out, stderr=subprocess.PIPE,
                             text=True, timeout=60)
    assert got.stderr.strip() == str(log)
    piped = subprocess.run([sys.executable, "-c", PRINT_STDOUT_FILE], capture_output=True, text=True, timeout=60)
    assert piped.stderr.strip() == "None"
