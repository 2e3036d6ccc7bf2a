"""The trainer handshake: ``toolkit.weights.publish``/``latest`` (published checkpoints, atomically),
``toolkit.samples.wait_step`` and the staleness settings. ``rollout.max_staleness`` end to end with
the sim engine and a small trainer loop: tests/integration/test_handshake.py."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.samples import write_run
from toolkit import samples
from toolkit.config import compose_config
from toolkit.core.errors import ConfigError
from toolkit.core.rundir import RunDir
from toolkit.launch.validation import validate
from toolkit.weights import (
    MARKER,
    CheckpointExists,
    WeightsTimeout,
    latest,
    publish,
    published,
    versions,
    wait_for_version,
)
from toolkit.weights.checkpoint import IN_PROGRESS


# ---- publish: the layout vLLM reloads ----------------------------------------------------------
def tiny_llama_state_dict(tie: bool = False) -> tuple[dict, dict]:
    """A random Llama with the tiny model's shapes (``toolkit/model/tiny.py``), no tokenizer needed."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from toolkit.model import tiny

    cfg = transformers.LlamaConfig(
        vocab_size=tiny.VOCAB, hidden_size=tiny.HIDDEN, intermediate_size=tiny.INTERMEDIATE,
        num_hidden_layers=tiny.LAYERS, num_attention_heads=tiny.HEADS, num_key_value_heads=tiny.HEADS,
        head_dim=tiny.HIDDEN // tiny.HEADS, max_position_embeddings=tiny.MAX_POSITIONS, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.state_dict(), cfg.to_dict()


def test_publish_writes_a_loadable_safetensors_checkpoint_of_the_tiny_model(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    state, config = tiny_llama_state_dict()
    wd = tmp_path / "weights"
    out = publish(wd, 3, state, config=config, files={"tokenizer.json": b"{}"})
    assert out == wd / "step_00003"
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([MARKER, "config.json", "model.safetensors", "tokenizer.json"])
    marker = json.loads((out / MARKER).read_text())
    assert marker["step"] == 3 and marker["files"] == ["config.json", "model.safetensors", "tokenizer.json"]
    assert isinstance(marker["time"], float)
    loaded = load_file(str(out / "model.safetensors"))
    assert sorted(loaded) == sorted(state)  # the names as given
    for name, t in state.items():
        assert loaded[name].shape == t.shape and loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], t)
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 128
    model, info = LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(model.model.embed_tokens.weight.to(torch.bfloat16), state["model.embed_tokens.weight"])
    assert latest(wd, 10) == (out, 3) and published(wd, 3)


def test_publish_takes_tied_views_and_non_contiguous_tensors_and_copies_model_dirs(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    state, config = tiny_llama_state_dict(tie=True)
    base = torch.arange(12.0).reshape(3, 4)
    state = {**state, "lm_head.weight": state["model.embed_tokens.weight"],  # shares storage
             "t": base.t(), "row": base[1]}                                 # a transposed view, a slice
    src = publish(tmp_path / "w", 1, state, config=config)
    loaded = load_file(str(src / "model.safetensors"))
    assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])
    assert torch.equal(loaded["t"], base.t()) and torch.equal(loaded["row"], base[1])

    # A model directory is copied (its marker is not), config= replaces its config.json, files= adds.
    tok = tmp_path / "tokenizer_config.json"
    tok.write_text("{}")
    out = publish(tmp_path / "w", 2, src, config={**config, "note": "step 2"}, files=[tok])
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "config.json", "model.safetensors",
                                                            "tokenizer_config.json"])
    assert json.loads((out / "config.json").read_text())["note"] == "step 2"
    assert json.loads((out / MARKER).read_text())["step"] == 2
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert versions(tmp_path / "w") == [1, 2]


def test_publish_takes_numpy_arrays(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    out = publish(tmp_path, 0, {"w": np.arange(6, dtype=np.float32).reshape(2, 3).T})
    assert np.array_equal(load_file(str(out / "model.safetensors"))["w"], np.arange(6, dtype=np.float32).reshape(2, 3).T)


def zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.float32)


# ---- atomicity --------------------------------------------------------------------------------
def test_latest_never_returns_a_temp_or_an_unmarked_checkpoint(tmp_path: Path) -> None:
    wd = tmp_path
    tmp = wd / ".step_00001.tmp-x"   # publish() still writing
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"half")
    crashed = wd / "step_00002"      # renamed by publish(), which died before its marker
    crashed.mkdir()
    (crashed / IN_PROGRESS).write_text("{}")
    (crashed / "model.safetensors").write_bytes(b"x")
    (wd / "step_00003").mkdir()     # an empty directory: nothing copied into it yet
    (wd / "step_00004.tmp-y").mkdir()  # not a checkpoint name
    (wd / "step_00004.tmp-y" / "config.json").write_text("{}")
    assert latest(wd, 3) is None and versions(wd) == []
    assert not published(wd, 1) and not published(wd, 2) and not published(wd, 3)
    for odd in ("step_3", "step_000004"):  # not the name checkpoint_dir() gives: not a checkpoint
        (wd / odd).mkdir()
        (wd / odd / "config.json").write_text("{}")
    assert latest(wd, 10) is None and versions(wd) == []
    hand = wd / "step_00004"          # a copy made by hand (no publish() files): counts once it has a file
    hand.mkdir()
    (hand / "config.json").write_text("{}")
    assert latest(wd, 10) == (hand, 4) and published(wd, 4)
    publish(wd, 5, {"w": zeros(2)})
    assert latest(wd, 10) == (wd / "step_00005", 5) and latest(wd, 4) == (hand, 4)
    assert versions(wd) == [4, 5] and versions(wd, 4) == [4]
    assert latest(None, 5) is None and latest(wd / "missing", 5) is None and not published(None, 5)


def test_republishing_a_step_is_refused_and_a_failed_publish_leaves_nothing(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    first = publish(tmp_path, 1, {"w": np.ones(2)})
    with pytest.raises(CheckpointExists, match=r"step 1 already has a checkpoint.*\(published\)"):
        publish(tmp_path, 1, {"w": zeros(2)})
    assert np.array_equal(load_file(str(first / "model.safetensors"))["w"], np.ones(2))  # not overwritten
    crashed = tmp_path / "step_00002"
    crashed.mkdir()
    (crashed / IN_PROGRESS).write_text("{}")
    with pytest.raises(CheckpointExists, match=r"step 2 .*interrupted publish; remove it"):
        publish(tmp_path, 2, {"w": zeros(2)})
    with pytest.raises(TypeError, match=r"weights\['bad'\] is a str"):
        publish(tmp_path, 3, {"w": zeros(2), "bad": "x"})
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        publish(tmp_path, -1, {"w": zeros(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00001", "step_00002"]  # no temp dir left
    assert latest(tmp_path, 10) == (first, 1)


def test_wait_for_version_waits_for_a_publish_stops_and_times_out_naming_the_version(tmp_path: Path) -> None:
    wd = tmp_path / "weights"
    publish(wd, 1, {"w": zeros(1)})

    async def wait_then_publish() -> tuple[Path, int] | None:
        later = threading.Timer(0.3, lambda: publish(wd, 2, {"w": zeros(1)}))
        later.start()
        try:
            return await wait_for_version(wd, 2, 4, timeout_s=60, poll_s=0.05)
        finally:
            later.join()

    assert asyncio.run(wait_then_publish()) == (wd / "step_00002", 2)
    assert asyncio.run(wait_for_version(wd, 1, 4, timeout_s=60)) == (wd / "step_00002", 2)
    assert asyncio.run(wait_for_version(wd, 5, 9, timeout_s=60, poll_s=0.01, stop=lambda: True)) is None
    with pytest.raises(WeightsTimeout) as err:
        asyncio.run(wait_for_version(wd, 3, 4, timeout_s=0.1, poll_s=0.02, why="step 4: "))
    msg = str(err.value)
    assert msg.startswith("step 4: no checkpoint of weight version >= 3 (step_00003 .. step_00004)")
    assert str(wd) in msg and "rollout.weights_timeout_s = 0.1s" in msg and "the latest is step_00002" in msg


# ---- wait_step ----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["gather", "shards"])
def test_wait_step_returns_the_table_once_the_report_exists(tmp_path: Path, layout: str) -> None:
    rd = write_run(tmp_path / "run", layout)
    report = rd.step_report(0)
    report.rename(tmp_path / "held.json")  # the step's files are there, its report is not yet

    later = threading.Timer(0.3, lambda: (tmp_path / "held.json").rename(report))
    later.start()
    try:
        table = samples.wait_step(rd.root, 0, timeout_s=60, poll_s=0.02)
    finally:
        later.join()
    assert table.equals(samples.read_step(rd.root, 0))
    assert samples.wait_step(rd, 0, timeout_s=0).column("index").to_pylist() == list(range(11))


def test_wait_step_times_out_naming_the_run_the_step_and_how_far_it_got(tmp_path: Path) -> None:
    rd = write_run(tmp_path / "run", "gather")
    with pytest.raises(samples.StepTimeout) as err:
        samples.wait_step(rd.root, 3, timeout_s=0.2, poll_s=0.05)
    assert str(err.value) == (f"step 3 of run {rd.root} was not written within 0.2s; "
                              "the last step with a report is 0")
    empty = RunDir(tmp_path / "empty")
    empty.make()
    with pytest.raises(samples.StepTimeout, match="no step has a report yet"):
        samples.wait_step(empty.root, 0, timeout_s=0.05)


def test_wait_step_fails_at_once_when_the_run_ended_without_the_step(tmp_path: Path) -> None:
    rd = write_run(tmp_path / "run", "gather")
    rd.report.write_text(json.dumps({"status": "failed", "error": "ComponentFailed: rank 0 failed"}))
    rd.lease.write_text(json.dumps({"epoch": 1, "released": True}))
    with pytest.raises(samples.RunEnded) as err:
        samples.wait_step(rd.root, 1, timeout_s=3600)
    assert str(err.value) == (f"run {rd.root} ended (failed: ComponentFailed: rank 0 failed) without step 1; "
                              "the last step with a report is 0")
    assert samples.wait_step(rd.root, 0, timeout_s=3600).num_rows == 11  # a step it did write is still read
    rd.report.write_text(json.dumps({"status": "ok", "error": None}))
    with pytest.raises(samples.RunEnded, match=r"ended \(ok\) without step 5"):
        samples.wait_step(rd.root, 5, timeout_s=3600)

    # Not ended: a resumed launch holds the lease (the report is the interrupted one's), or an sbatch
    # job requeued itself to go on.
    rd.report.write_text(json.dumps({"status": "interrupted", "error": "stopped by SIGTERM during step 1"}))
    rd.lease.write_text(json.dumps({"epoch": 2, "released": False}))
    with pytest.raises(samples.StepTimeout):
        samples.wait_step(rd.root, 1, timeout_s=0.1, poll_s=0.02)
    rd.lease.write_text(json.dumps({"epoch": 2, "released": True}))
    rd.append_event("requeue", slurm_job="12")
    with pytest.raises(samples.StepTimeout):
        samples.wait_step(rd.root, 1, timeout_s=0.1, poll_s=0.02)
    rd.append_event("resume", step=1, epoch=3)
    with pytest.raises(samples.RunEnded, match=r"ended \(interrupted: stopped by SIGTERM during step 1\)"):
        samples.wait_step(rd.root, 1, timeout_s=3600)


# ---- config -------------------------------------------------------------------------------------
def test_max_staleness_and_weights_timeout_are_validated_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["rollout.max_staleness=-1", "rollout.weights_timeout_s=0",
                                 "rollout.weights_poll_s=0"]))
    fields = sorted(e.field for e in err.value.errors)  # the fields' bounds, then the rules across fields
    assert fields == ["rollout.max_staleness", "rollout.max_staleness", "rollout.weights_poll_s",
                      "rollout.weights_timeout_s"]
    assert "needs rollout.weights_dir" in str(err.value)
    validate(compose_config([f"rollout.weights_dir={tmp_path}", "rollout.max_staleness=0"]))
    cfg = compose_config([])
    assert cfg.rollout.max_staleness is None and cfg.rollout.weights_timeout_s == 3600.0


def test_a_checkpoint_of_version_0_published_later_still_replaces_the_models_own_weights(tmp_path: Path) -> None:
    from toolkit.rollout.stepweights import StepWeights

    sw = StepWeights(compose_config([]).rollout, client=None, stop=lambda: False)  # type: ignore[arg-type]
    sw.held = (None, 0)  # the model's own weights, version 0
    assert sw._newer((tmp_path / "step_00000", 0))
    sw.held = (str(tmp_path / "step_00000"), 0)
    assert not sw._newer((tmp_path / "step_00000", 0)) and sw._newer((tmp_path / "step_00001", 1))
