"""A rank's environment sessions: each one turn by turn against the router (through any client with
``generate`` and ``abort``), until its environment says it is done. The rollout rank runs them over
its ``RouterClient``; the fleet twin (``toolkit.plan``) runs the same sessions in virtual time."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from hydra.utils import instantiate

from toolkit.config import Config
from toolkit.core import clock
from toolkit.core.errors import ToolkitError
from toolkit.core.protocol import Generate, Sampling
from toolkit.rollout.envs import Environment
from toolkit.rollout.guard import BadReward, Waits, finite_reward, guarded, token_ids, user_call
from toolkit.rollout.hints import HintFailed, LengthHint, ask
from toolkit.rollout.prompts import Prompt, PromptSource
from toolkit.session.requests import OpenStep
from toolkit.session.sample import NonPrefixTurn, Sample, session_id

UserCall = Callable[..., Awaitable[Any]]
MAX_TURNS_HARD = 256


def rank_cap(cfg: Config, rank: int, size: int) -> int:
    """Sessions rank ``rank`` of ``size`` runs at once: its exact share of ``max_concurrent_rollouts``."""
    cap = cfg.rollout.max_concurrent_rollouts
    if cap is None:
        return 1 << 30
    return max(1, cap // size + (1 if rank < cap % size else 0))


class EnvSessions:
    def __init__(self, cfg: Config, client: Any, prompts: PromptSource, max_model_len: int,
                 open_step: Callable[[], OpenStep], call: UserCall = user_call) -> None:
        """``client``: ``generate(Generate) -> (Result, Route)`` and ``abort(request_id)``; ``open_step``:
        the step a session's requests land in now (read at each request); ``call``: how the environment's
        methods are called (``user_call``: a synchronous one in a thread of its own)."""
        self.call = call
        self.cfg = cfg
        self.client = client
        self.prompts = prompts
        self.max_model_len = max_model_len
        self.open_step = open_step
        self._hydra_factory = instantiate(cfg.workload.env, _partial_=True)
        self._factory: Callable[[], Environment] | None = None
        self.length_hint: LengthHint | None = instantiate(cfg.workload.length_hint) if cfg.workload.length_hint else None
        w = cfg.workload
        self.sampling = Sampling(max_tokens=w.max_tokens, temperature=w.temperature, top_p=w.top_p)

    def _new_env(self) -> Environment:
        """A session's own environment. Hydra's partial authorizes its target at every call (~0.3 ms):
        the first call does, later ones call the same target with the same arguments directly."""
        if self._factory is not None:
            return self._factory()
        env: Environment = self._hydra_factory()
        f = self._hydra_factory
        self._factory = functools.partial(f.func, *f.args, **f.keywords) if isinstance(f, functools.partial) else f
        return env

    def _begin(self, step: int, index: int) -> tuple[Environment, Prompt]:
        """A session's environment and prompt (the user's code)."""
        return self._new_env(), self.prompts.get(step, index)

    async def run(self, step: int, index: int, attempt: int = 0) -> list[Sample]:
        """Session ``index`` of step ``step`` to its end (``attempt`` > 0: restarted)."""
        sid = session_id(self.cfg.job, step, index)
        sample = Sample.start(index, sid, [])
        # The toolkit's own failures (the router gone...) are not the environment's.
        waits = Waits()
        _, error = await guarded("environment", sid, self._turns(step, sid, sample, waits, attempt),
                                 self.cfg.workload.env_timeout_s, (ToolkitError,), waits)
        if error:
            sample.mark("failed", error)
        return [sample]

    async def _turns(self, step: int, sid: str, sample: Sample, waits: Waits, attempt: int) -> None:
        cfg = self.cfg
        # The user's constructor and prompt source run as its methods do (one call: one thread): one that
        # hangs or raises (a ToolkitError included) is its session's, never the loop's or the rank's.
        env, prompt = await self.call(self._begin, step, sample.index)
        open_step = self.open_step()  # the step it may land in: the rank's, read at each request
        context = token_ids(await self.call(env.reset, prompt), "reset's prompt")
        sample.tokens, sample.loss_mask, sample.rollout_logprobs = list(context), [0] * len(context), [0.0] * len(context)
        sample.prompt_length = len(context)
        for turn in range(MAX_TURNS_HARD):
            if sample.status != "completed":  # ended by its timeout, in an environment that swallowed the cancellation
                return
            budget = min(self.sampling.max_tokens, self.max_model_len - len(context))
            if budget < 1:
                sample.mark("truncated", "context reached max_model_len")
                return
            msg = Generate(
                request_id=f"{sid}/{turn}" + (f"~{attempt}" if attempt else ""), job=cfg.job, session_id=sid,
                step=open_step.step,
                prompt_token_ids=context,
                sampling=Sampling(budget, self.sampling.temperature, self.sampling.top_p),
                deadline=clock.wall() + cfg.rollout.request_timeout_s,
                prompt_key=self.prompts.prompt_key(step, sample.index),
            )
            if self.length_hint is not None:
                try:
                    msg.expected_tokens = ask(self.length_hint, msg)
                except HintFailed as exc:  # the user's code: this session fails, alone
                    sample.mark("failed", str(exc))
                    return
            sent = clock.wall()
            waits.begin()
            try:
                res, route = await self.client.generate(msg)
            except asyncio.CancelledError:  # the session timed out: its request leaves the engines too
                await self.client.abort(msg.request_id)
                raise
            finally:
                waits.end()
            open_step.log.add(res, route, len(context), sent, clock.wall(), sample.index, step)
            open_step.answered(sid, res)
            if res.status != "ok":
                sample.mark("aborted" if res.status == "cancelled" else "failed", f"{res.status}: {res.error}")
                return
            try:
                sample.add_turn(context, res)
            except NonPrefixTurn as exc:
                sample.mark("failed", str(exc))
                return
            outcome = await self.call(env.step, res.output_token_ids, res.finish_reason)
            del res  # its tokens are in the sample now: not held through the next turn's request
            try:
                sample.reward += finite_reward(outcome.reward)
            except BadReward as exc:
                sample.mark("failed", f"environment: {exc}")
                return
            if outcome.done:
                return
            sample.extend_observation(token_ids(outcome.observation, "step's observation"))
            context = list(sample.tokens)
        sample.mark("truncated", f"more than {MAX_TURNS_HARD} turns")
