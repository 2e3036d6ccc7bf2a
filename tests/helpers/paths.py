"""Where things are: the repository root (the directory launch resolves relative paths from), this
package (scripts run by path) and its data (stored renderings, prompt files)."""

from __future__ import annotations

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
ROOT = HELPERS.parents[1]
DATA = HELPERS / "data"
