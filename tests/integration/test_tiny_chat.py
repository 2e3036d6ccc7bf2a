"""The tiny model's tokenizer in a fresh interpreter: building it imports no torch. The tokenizer and
its chat template: tests/unit/test_tiny_chat.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytest.importorskip("tokenizers")


def test_tokenizer_only_needs_no_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import sys; from toolkit.model.tiny import ensure_tiny_tokenizer; "
            f"ensure_tiny_tokenizer({str(tmp_path)!r}); assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
