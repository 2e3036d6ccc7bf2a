"""Replay: a finished run's own sessions under other settings (``python -m toolkit.plan replay=RUN_DIR
[overrides]``). :class:`Recorded` reads the run's Parquet files (each session's prompt, each turn's
output tokens and the observation after it) and its step reports (the gap between one step's end and
the next one's start); :class:`ReplayPrompts` and :class:`ReplayEnv` hand the sessions their recorded
prompts and observations, and :meth:`Recorded.plan` gives each turn its recorded tokens in the twin's
engines, so a replayed session says what it said, wherever and whenever it now runs."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from omegaconf import OmegaConf

from toolkit.config import Config, SimEngineConfig, compose_config
from toolkit.core.errors import ToolkitError
from toolkit.core.protocol import Generate
from toolkit.core.rundir import RunDir
from toolkit.engine.plans import plan_output
from toolkit.rollout.envs import Environment, EnvStep
from toolkit.rollout.prompts import Prompt, PromptSource

Turn = tuple[list[int], list[int]]
"""One turn: the tokens generated, then the observation the environment answered (empty after the last)."""


class ReplayError(ToolkitError):
    """A run that cannot be replayed (no config overrides, no step files)."""


def turns_of(tokens: list[int], loss_mask: list[int], prompt_length: int) -> list[Turn]:
    """A session's turns from its merged tokens: the runs of its loss mask (generated, then observed)."""
    runs = [(bit, [t for t, _ in run]) for bit, run in
            itertools.groupby(zip(tokens[prompt_length:], loss_mask[prompt_length:], strict=True), key=lambda x: x[1])]
    turns: list[Turn] = []
    for bit, run in runs:
        if bit:
            turns.append((run, []))
        elif turns:
            turns[-1][1].extend(run)
    return turns


class Recorded:
    """A finished run's sessions, per step: ``(prompt, turns)`` by session index; and its step gaps."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run = RunDir(Path(run_dir))
        path = self.run.root / ".hydra" / "overrides.yaml"
        if not path.exists():
            raise ReplayError(f"replay={run_dir}: no .hydra/overrides.yaml there (a launch's run directory "
                              "has one)")
        self.overrides = [str(o) for o in OmegaConf.to_container(OmegaConf.load(path)) or []]
        self.sessions: list[dict[int, tuple[list[int], list[Turn]]]] = []
        reports: list[dict[str, Any]] = []
        for step in itertools.count():
            parquet, report = self.run.step_parquet(step), self.run.step_report(step)
            if not parquet.exists() or not report.exists():
                break
            rows = pq.read_table(parquet, columns=["index", "tokens", "loss_mask", "prompt_length"]).to_pylist()
            self.sessions.append({r["index"]: (r["tokens"][: r["prompt_length"]],
                                               turns_of(r["tokens"], r["loss_mask"], r["prompt_length"]))
                                  for r in rows})
            reports.append(json.loads(report.read_text()))
        if not self.sessions:
            raise ReplayError(f"replay={run_dir}: no step with its Parquet file and report there")
        self.gaps = [max(0.0, b["started_at"] - a["ended_at"]) for a, b in itertools.pairwise(reports)]
        """Seconds between a step's end and the next one's start (the trainer's part, weights)."""
        self._by_session = {f"{s}/{i}": turns for s, step in enumerate(self.sessions)
                            for i, (_, turns) in step.items()}

    def config(self, overrides: list[str]) -> Config:
        """The run's config with ``overrides`` on top, its prompts and environment the recorded ones."""
        cfg = compose_config([*self.overrides, *overrides])
        root = str(self.run.root)
        workload = cfg.workload
        workload.prompts = {"_target_": f"{__name__}.ReplayPrompts", "run_dir": root}
        workload.env = {"_target_": f"{__name__}.ReplayEnv", "run_dir": root}
        cfg.steps = min(cfg.steps, len(self.sessions))
        cfg.sessions_per_step = max(len(s) for s in self.sessions)
        return cfg

    def plan(self, cfg: SimEngineConfig, req: Generate) -> tuple[list[int], list[float], str]:
        """Turn ``req``'s recorded tokens (what is left of them after ``resumed_tokens``), cut at its
        budget; a request the run did not make is planned by the sim."""
        sid, _, rest = req.request_id.rpartition("/")
        turns = self._by_session.get(sid.partition("/")[2])
        turn = int(rest.partition("~")[0]) if rest.partition("~")[0].isdigit() else -1
        if turns is None or not 0 <= turn < len(turns):
            return plan_output(cfg, req)
        out = turns[turn][0]
        k = req.resumed_tokens
        budget = max(0, min(req.sampling.max_tokens + k, cfg.max_model_len - len(req.prompt_token_ids) + k))
        tokens = out[:budget]
        finish = "stop" if len(out) <= budget else "length"
        return tokens[k:], [-0.5] * (len(tokens) - k), finish


@functools.lru_cache(maxsize=4)
def recorded(run_dir: str) -> Recorded:
    """The run's :class:`Recorded`, read once per process (every rank's prompts and environments share it)."""
    return Recorded(run_dir)


class ReplayPrompts(PromptSource):
    def __init__(self, run_dir: str) -> None:
        self.rec = recorded(run_dir)

    def get(self, step: int, index: int) -> Prompt:
        prompt, _ = self.rec.sessions[step][index]
        return Prompt(list(prompt), {"step": step, "index": index})


class ReplayEnv(Environment):
    """Answers each turn with the observation the run's environment gave it, and ends where it ended."""

    def __init__(self, run_dir: str) -> None:
        self.rec = recorded(run_dir)
        self.turns: list[Turn] = []
        self.turn = 0

    def reset(self, prompt: Prompt) -> list[int]:
        prompt_ids, self.turns = self.rec.sessions[prompt.metadata["step"]][prompt.metadata["index"]]
        self.turn = 0
        return list(prompt_ids)

    def step(self, generated: list[int], finish_reason: str) -> EnvStep:
        k, self.turn = self.turn, self.turn + 1
        if k + 1 >= len(self.turns):
            return EnvStep(done=True)
        return EnvStep(observation=list(self.turns[k][1]))
