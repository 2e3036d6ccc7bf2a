"""A session merged into one training sample, on the rank that ran it.

``tokens`` = first prompt + every turn's generated tokens + every observation, in order;
``loss_mask`` is 1 exactly on generated tokens; ``rollout_logprobs`` is aligned to ``tokens`` (0.0
where the mask is 0). Responses are not decoded unless asked: ``response = ""`` and
``metadata["response_decoded"] = False``; with a tokenizer, :meth:`Sample.decode_response` fills
``response`` with the text of every token after the first prompt. A turn whose prompt does not extend
the accumulated tokens is caught (:class:`NonPrefixTurn`) and the sample marked failed, never
silently merged. :func:`merge` concatenates two samples of one session under the same rules.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from toolkit.core.errors import ToolkitError
from toolkit.core.protocol import Result
from toolkit.model.tokenizer import Tokenizer

SAMPLE_STATUSES = ("completed", "truncated", "aborted", "failed", "stale", "filtered")
"""Row outcomes. ``stale``: a carried session dropped for ``rollout.max_staleness``; ``filtered``: a member
of a group whose rewards were all equal (``rollout.filter_groups``). Both are written, never counted."""


def session_id(job: str, step: int, index: int) -> str:
    """The id of session ``index`` of step ``step`` (the step it started in): ``job/step/index``."""
    return f"{job}/{step}/{index}"


class NonPrefixTurn(ToolkitError):
    """A turn's prompt does not start with the tokens accumulated so far."""


@dataclass
class Sample:
    index: int
    session_id: str
    tokens: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    prompt_length: int
    reward: float = 0.0
    status: str = "completed"
    num_turns: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    weight_versions: list[int] = field(default_factory=list)
    """Every weight version that generated a token of the sample, in order of first use, each once."""
    turn_weight_versions: list[list[int]] = field(default_factory=list)
    """Per turn (in order): the versions that generated its tokens (``Result.weight_versions``): two or
    more for a turn that ran across an in-place weight update (``rollout.update_mode=pause``)."""
    replicas: set[str] = field(default_factory=set)
    groups: set[str] = field(default_factory=set)
    response: str = ""
    response_decoded: bool = False
    error: str = ""
    branch: int = 0
    """0 for a session's sample; 1, 2, ... for the branches a gateway session split off (a harness that
    rewrote its history, or the other choices of an ``n > 1`` turn), in the order they started."""
    messages: str = ""
    """The conversation as JSON (gateway sessions with ``workload.record_messages``), else ``""``."""
    started_step: int = -1
    """The step the session started in (-1: not set; the step it lands in, with ``rollout.close=all``)."""
    carried: int = 0
    """Step boundaries the session ran across before it landed (``rollout.close=count``)."""
    staleness: int = 0
    """How far its oldest token's policy was behind when it landed: the newest weight version the
    engines held minus its oldest (without ``rollout.weights_dir``: steps since its attempt began)."""

    @classmethod
    def start(cls, index: int, session_id: str, prompt: list[int]) -> Sample:
        return cls(index, session_id, list(prompt), [0] * len(prompt), [0.0] * len(prompt), len(prompt))

    def copy(self) -> Sample:
        """An independent copy (its lists and sets new; their ints, floats and strings shared): an
        ``n > 1`` turn's other choices each grow one, and ``copy.deepcopy`` walks every token."""
        return dataclasses.replace(
            self, tokens=list(self.tokens), loss_mask=list(self.loss_mask),
            rollout_logprobs=list(self.rollout_logprobs), weight_versions=list(self.weight_versions),
            turn_weight_versions=[list(v) for v in self.turn_weight_versions], replicas=set(self.replicas),
            groups=set(self.groups))

    @property
    def response_length(self) -> int:
        """Tokens after the first prompt: generations and observations."""
        return len(self.tokens) - self.prompt_length

    @property
    def metadata(self) -> dict[str, Any]:
        """What trainers read beside the arrays: ``response_decoded`` says whether ``response`` is real."""
        return {"response_decoded": self.response_decoded}

    def decode_response(self, tokenizer: Tokenizer) -> None:
        """``response`` = the text of every token after the first prompt (generations and observations)."""
        self.response = tokenizer.decode(self.tokens[self.prompt_length:])
        self.response_decoded = True

    def add_turn(self, prompt: list[int], result: Result) -> None:
        """Merge one generation whose request carried ``prompt``."""
        n = len(self.tokens)
        if len(prompt) < n or (prompt if len(prompt) == n else prompt[:n]) != self.tokens:
            at = next((i for i, (a, b) in enumerate(zip(prompt, self.tokens, strict=False)) if a != b), min(len(prompt), n))
            raise NonPrefixTurn(
                f"turn {self.num_turns} of {self.session_id}: its prompt ({len(prompt)} tokens) does not extend "
                f"the {n} accumulated tokens (first difference at position {at})"
            )
        extra = prompt[n:]
        self.extend_observation(extra)
        out = result.output_token_ids
        lps = result.logprobs if len(result.logprobs) == len(out) else [math.nan] * len(out)  # (read, not kept)
        # NaN: an engine (or a moved request's leg) sent none. A NaN makes the sum NaN: only then are they
        # counted, so a turn with every logprob is one C-level pass.
        missing = sum(map(math.isnan, lps)) if math.isnan(sum(lps)) else 0
        if missing:
            # Unknown, not a made-up probability (0.0 would be certainty): NaN, and the row says so.
            note = f"turn {self.num_turns}: {missing} of {len(out)} tokens have no logprob from the engine (NaN)"
            self.error = f"{self.error}; {note}" if self.error else note
        self.tokens.extend(out)
        self.loss_mask.extend([1] * len(out))
        self.rollout_logprobs.extend(lps)
        self.num_turns += 1
        self.generated_tokens += len(out)
        self.cached_tokens += result.cached_tokens
        versions = list(result.weight_versions) or [result.weight_version]
        self.turn_weight_versions.append(versions)
        for v in versions:
            if v not in self.weight_versions:
                self.weight_versions.append(v)
        if result.replica_id:
            self.replicas.add(result.replica_id)
        if result.group:
            self.groups.add(result.group)

    def extend_observation(self, observation: list[int]) -> None:
        self.tokens.extend(observation)
        self.loss_mask.extend([0] * len(observation))
        self.rollout_logprobs.extend([0.0] * len(observation))

    def mark(self, status: str, error: str = "") -> None:
        assert status in SAMPLE_STATUSES, status
        self.status = status
        if error:
            self.error = error

    def check(self) -> None:
        """The invariants every merged sample keeps (used by tests and before writing)."""
        n = len(self.tokens)
        assert len(self.loss_mask) == n and len(self.rollout_logprobs) == n
        assert sum(self.loss_mask) == self.generated_tokens
        assert all(lp == 0.0 for lp, m in zip(self.rollout_logprobs, self.loss_mask, strict=True) if not m)
        assert 0 <= self.prompt_length <= n


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def merge(a: Sample, b: Sample, tokenizer: Tokenizer | None = None) -> Sample:
    """Session ``a`` continued by ``b``: one sample, as if ``b``'s turns had been added to ``a``.

    ``b``'s first prompt must extend ``a``'s tokens (the usual whole-context prompt); what it adds
    beyond them is an observation (loss mask 0). Otherwise :class:`NonPrefixTurn` is raised and
    nothing is merged. The response text is kept only when both samples were decoded: then the
    observation between them is decoded too (which needs ``tokenizer`` if there is one); otherwise the
    result is undecoded (``response = ""``). Counters add up, sets unite, the worse status wins; the
    branch is ``a``'s and the recorded conversation (``messages``) ``b``'s, which goes on from ``a``'s.
    """
    if a.session_id != b.session_id or a.index != b.index:
        raise ValueError(f"merge needs two samples of one session, got {a.session_id!r} (index {a.index}) "
                         f"and {b.session_id!r} (index {b.index})")
    n = len(a.tokens)
    if b.prompt_length < n or b.tokens[:n] != a.tokens:
        raise NonPrefixTurn(
            f"merging {a.session_id}: the second sample's prompt ({b.prompt_length} tokens) does not extend the "
            f"first sample's {n} tokens (first difference at position {_first_difference(b.tokens[:b.prompt_length], a.tokens)})"
        )
    obs = b.tokens[n:b.prompt_length]
    decoded = a.response_decoded and b.response_decoded
    response = ""
    if decoded:
        if obs and tokenizer is None:
            raise ValueError(f"merging {a.session_id}: both samples are decoded, so the {len(obs)} observation "
                             "tokens between them must be decoded too: pass a tokenizer")
        response = a.response + (tokenizer.decode(obs) if obs and tokenizer is not None else "") + b.response
    tail = slice(b.prompt_length, None)
    return Sample(
        index=a.index, session_id=a.session_id,
        tokens=list(b.tokens),
        loss_mask=a.loss_mask + [0] * len(obs) + b.loss_mask[tail],
        rollout_logprobs=a.rollout_logprobs + [0.0] * len(obs) + b.rollout_logprobs[tail],
        prompt_length=a.prompt_length,
        reward=a.reward + b.reward,
        status=max(a.status, b.status, key=SAMPLE_STATUSES.index),
        num_turns=a.num_turns + b.num_turns,
        generated_tokens=a.generated_tokens + b.generated_tokens,
        cached_tokens=a.cached_tokens + b.cached_tokens,
        weight_versions=a.weight_versions + [v for v in b.weight_versions if v not in a.weight_versions],
        turn_weight_versions=[list(t) for t in a.turn_weight_versions + b.turn_weight_versions],
        replicas=a.replicas | b.replicas,
        groups=a.groups | b.groups,
        response=response,
        response_decoded=decoded,
        error="; ".join(e for e in (a.error, b.error) if e),
        branch=a.branch,
        messages=b.messages or a.messages,  # b's conversation goes on from a's: the whole of it
        started_step=a.started_step,  # where the session began
        carried=max(a.carried, b.carried),
        staleness=max(a.staleness, b.staleness),  # its oldest tokens' policy, at the later landing
    )
