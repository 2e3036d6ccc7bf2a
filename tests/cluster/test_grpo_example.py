"""examples/grpo_tiny.py end to end: real vLLM (CPU) rollouts, a torch GRPO trainer, the handshake. The
on-policy run streams its weights (``--stream``: ``Streamer.send``, max_staleness=0), the partial one
publishes checkpoints (``--partial``: close=count, max_staleness=1). The reward rises, every on-policy
step runs on the weights sent after the step before, and the trainer's logprobs match the engine's
closely."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.mpi]

ROOT = Path(__file__).resolve().parents[2]
STEPS = {False: 8, True: 10}
"""On-policy, ``--partial``: a partial run trains on rows up to two versions behind, which move the
policy less per step (measured, mean of the last 3: 0.22 at step 7 and 0.28 at step 9)."""
MARGIN = 0.05
"""Mean reward of the last 3 steps over the first 3 (random model: ~0.12-0.15; measured on-policy:
0.152 -> 0.204 and 0.150 -> 0.243 at step 5, 0.148 -> 0.289 and 0.158 -> 0.378 at step 7; partial:
0.141 -> 0.280 at step 9; engines are not bitwise reproducible)."""


@pytest.fixture(scope="module", autouse=True)
def _vllm() -> None:
    if os.environ.get("TOOLKIT_REQUIRE_VLLM") == "1":
        import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
    pytest.importorskip("vllm")
    pytest.importorskip("torch")


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("partial", [False, True], ids=["on-policy-streamed", "partial-checkpoints"])
def test_grpo_on_the_tiny_model_raises_the_reward(tmp_path: Path, partial: bool) -> None:
    out = tmp_path / "grpo"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "grpo_tiny.py"), "--out", str(out),
                           "--steps", str(STEPS[partial]), "--cache", str(tmp_path / "cache"),
                           *(["--partial"] if partial else ["--stream"])],
                          capture_output=True, text=True, timeout=1400, cwd=ROOT)
    log = out / "launch.log"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
    rows = list(csv.DictReader(open(out / "reward.csv")))
    assert [int(r["step"]) for r in rows] == list(range(STEPS[partial]))
    if partial:
        # A step ahead at most, and the slowest sessions of a step landing in the next.
        assert all(int(r["staleness_max"]) <= 1 for r in rows)
        assert sum(int(r["carried"]) for r in rows) > 0
    else:
        assert [r["weight_versions"] for r in rows] == [str(s) for s in range(STEPS[partial])]  # strictly on-policy
    reward = [float(r["reward_mean"]) for r in rows]
    first, last = sum(reward[:3]) / 3, sum(reward[-3:]) / 3
    assert last >= first + MARGIN, reward
    # Rows of the trainer's own weights: the same weights in two implementations (bf16 engine, fp32
    # trainer), close, not equal. Rows of older weights (--partial: the trainer is an update ahead) also
    # hold how far up to two updates moved the policy (1.0-2.2 measured at lr 1e-2), which no bound of
    # the toolkit's sets: only sane (tokens out of step with their logprobs would be far off).
    for r in rows:
        if r["k3_kl"]:
            assert 0 < float(r["mean_abs_dlogprob"]) < 0.5 and 0 <= float(r["k3_kl"]) < 0.1, r
        if r["k3_kl_stale"]:
            assert partial and 0 < float(r["mean_abs_dlogprob_stale"]) < 5.0, r
    if not partial:
        assert all(r["k3_kl"] for r in rows)
    assert (out / "reward.png").stat().st_size > 10_000
    if not partial:  # every update went over the network: no checkpoint was written
        assert '"streamed"' in proc.stdout and not (out / "weights").exists()
