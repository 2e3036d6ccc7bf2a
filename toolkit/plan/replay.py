"""Replay: a finished run's own sessions under other settings (``python -m toolkit.plan replay=RUN_DIR
[overrides]``). :class:`Recorded` reads the run's Parquet files (each session's prompt, each turn's
output tokens and the observation after it, its reward) and its step reports (the gap between one step's end and
the next one's start); :class:`ReplayPrompts` and :class:`ReplayEnv` hand the sessions their recorded
prompts and observations, and :meth:`Recorded.plan` gives each turn its recorded tokens in the twin's
engines, so a replayed session says what it said, wherever and whenever it now runs."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

from hydra.utils import instantiate

from toolkit.config import Config, SimEngineConfig, compose_config, samples_per_prompt
from toolkit.core.errors import ToolkitError
from toolkit.core.protocol import Generate
from toolkit.core.rundir import RunDir
from toolkit.engine.plans import plan_output
from toolkit.launch.composition import chooses_group
from toolkit.rollout.envs import Environment, EnvStep
from toolkit.rollout.prompts import Prompt, PromptSource
from toolkit.samples import read_step

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
    """A finished run's sessions, by ``(started step, index)``: ``(prompt, turns, reward)``; its step gaps."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run = RunDir(Path(run_dir))
        overrides = self.run.read_overrides()
        if overrides is None:
            raise ReplayError(f"replay={run_dir}: no overrides.yaml there (a launch's run directory has one)")
        self.overrides = overrides
        self.sessions: dict[tuple[int, int], tuple[list[int], list[Turn], float]] = {}
        reports: list[dict[str, Any]] = []
        for step in itertools.count():  # the steps written whole, from the first (either output layout)
            report = self.run.step_report(step)
            try:
                table = read_step(self.run, step, columns=COLUMNS) if report.exists() else None
            except FileNotFoundError:
                table = None
            if table is None:
                break
            for r in table.to_pylist():
                if not r["branch"]:  # a session's own sample (a gateway's branches ran in it)
                    self.sessions[(r["started_step"], r["index"])] = (
                        r["tokens"][: r["prompt_length"]], turns_of(r["tokens"], r["loss_mask"], r["prompt_length"]),
                        r["reward"])
            reports.append(json.loads(report.read_text()))
        if not self.sessions:
            raise ReplayError(f"replay={run_dir}: no step with its Parquet file(s) and report there")
        self.steps = len(reports)
        """The steps written whole."""
        self.gaps = [max(0.0, b["started_at"] - a["ended_at"]) for a, b in itertools.pairwise(reports)]
        """Seconds between a step's end and the next one's start (the trainer's part, weights)."""
        self._by_session = {f"{s}/{i}": turns for (s, i), (_, turns, _) in self.sessions.items()}
        self.served: tuple[set[tuple[int, int]], set[tuple[int, int]]] = (set(), set())
        """The sessions the replay started so far: those the run recorded, and the others."""

    def base(self, overrides: list[str]) -> list[str]:
        """The run's overrides that go under ``overrides``: not those of a config group chosen there again
        (``engine=sim`` starts from the sim's defaults, not from the fields the run set for vLLM)."""
        chosen = {_key(o) for o in overrides if chooses_group(o)}
        return [o for o in self.overrides if _key(o).split(".")[0] not in chosen]

    def config(self, overrides: list[str]) -> Config:
        """The run's config with ``overrides`` on top, its prompts and environment the recorded ones; a
        session the run did not record (past its steps or sessions, or one it never finished) gets the
        run's own prompt source and environment. The run's steps written, unless ``overrides`` set them."""
        cfg = compose_config([*self.base(overrides), *overrides])
        self.served = (set(), set())
        root = str(self.run.root)
        workload = cfg.workload
        workload.prompts = {"_target_": f"{__name__}.ReplayPrompts", "run_dir": root,
                            "samples_per_prompt": samples_per_prompt(cfg), "source": workload.prompts}
        workload.env = {"_target_": f"{__name__}.ReplayEnv", "_recursive_": False, "run_dir": root,
                        "env": workload.env}
        if not any(_key(o) == "steps" for o in overrides):
            cfg.steps = min(cfg.steps, self.steps)
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


COLUMNS = ["started_step", "index", "branch", "tokens", "loss_mask", "prompt_length", "reward"]
REPLAYED = "replayed"
"""A recorded prompt's metadata key: its ``(started step, index)``."""


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


@functools.lru_cache(maxsize=4)
def recorded(run_dir: str) -> Recorded:
    """The run's :class:`Recorded`, read once per process (every rank's prompts and environments share it)."""
    return Recorded(run_dir)


class ReplayPrompts(PromptSource):
    """The run's recorded prompts; ``source`` (the run's own prompts) for the sessions it did not record."""

    def __init__(self, run_dir: str, source: PromptSource | None = None, samples_per_prompt: int = 1) -> None:
        self.rec = recorded(run_dir)
        self.source = source
        self.samples_per_prompt = samples_per_prompt

    def get(self, step: int, index: int) -> Prompt:
        rec = self.rec.sessions.get((step, index))
        self.rec.served[rec is None].add((step, index))
        if rec is not None:
            return Prompt(list(rec[0]), {REPLAYED: (step, index)})
        if self.source is None:
            raise ReplayError(f"session {index} of step {step} is not in the run, which has no prompt source")
        return self.source.get(step, index)

    def prompt_key(self, step: int, index: int) -> str:
        return self.source.prompt_key(step, index) if self.source is not None else ""


class ReplayEnv(Environment):
    """Answers each turn with the observation the run's environment gave it and ends where it ended, with
    its reward; a session the run did not record runs in the run's own environment (``env``)."""

    def __init__(self, run_dir: str, env: Any = None) -> None:
        self.rec = recorded(run_dir)
        self.env = env
        self.inner: Environment | None = None
        self.turns: list[Turn] = []
        self.reward = 0.0
        self.turn = 0

    def reset(self, prompt: Prompt) -> list[int]:
        key = prompt.metadata.get(REPLAYED)
        if key is None:
            self.inner = instantiate(self.env)
            return self.inner.reset(prompt)
        prompt_ids, self.turns, self.reward = self.rec.sessions[key]
        self.turn = 0
        return list(prompt_ids)

    def step(self, generated: list[int], finish_reason: str) -> EnvStep:
        if self.inner is not None:
            return self.inner.step(generated, finish_reason)
        k, self.turn = self.turn, self.turn + 1
        if k + 1 >= len(self.turns):
            return EnvStep(reward=self.reward, done=True)
        return EnvStep(observation=list(self.turns[k][1]))
