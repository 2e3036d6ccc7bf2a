"""The type check CI runs: mypy over the files ``[tool.mypy]`` in pyproject.toml names (the bottom layer
and the router), in this process, with the project's settings."""

from __future__ import annotations

import os
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_is_clean() -> None:
    cwd = os.getcwd()
    os.chdir(ROOT)  # mypy reads pyproject.toml and the `files` it names from the working directory
    try:
        out, err, code = api.run(["--config-file", str(ROOT / "pyproject.toml")])
    finally:
        os.chdir(cwd)
    assert code == 0, out + err
