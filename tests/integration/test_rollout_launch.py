"""``launch`` end to end with the example prompt file, shards output and decoded responses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.procs import launch
from toolkit import samples as api
from toolkit.model.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_jsonl_prompts_to_decoded_shards(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", "engine.time_scale=0.2", "workload=jsonl", "rollout.output=shards",
                  "rollout.decode_responses=true", "steps=2", "sessions_per_step=12", "groups=single"], cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    records = [json.loads(line) for line in (ROOT / "tests" / "helpers" / "data" / "rollout_prompts.jsonl").read_text().splitlines()]
    tok = ByteTokenizer()
    assert api.steps(run) == [0, 1]
    for step in (0, 1):
        rows = api.read_step(run, step).to_pylist()
        assert [r["index"] for r in rows] == list(range(12))
        for r in rows:
            want = records[(step * 12 + r["index"]) % len(records)]["prompt"]
            assert tok.decode(r["tokens"][:r["prompt_length"]]) == want  # the file's text, tokenized on the rank
            assert r["status"] == "completed" and r["num_turns"] == 3
            assert r["metadata"]["response_decoded"] and r["response"] == tok.decode(r["tokens"][r["prompt_length"]:])
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "ok" and report["summary"]["sessions"] == 24
