"""A session merged into one training sample, on the rank that ran it.

``tokens`` = first prompt + every turn's generated tokens + every observation, in order;
``loss_mask`` is 1 exactly on generated tokens; ``rollout_logprobs`` is aligned to ``tokens`` (0.0
where the mask is 0). Responses are not decoded unless asked: ``response = ""`` and
``response_decoded = False``. A turn whose prompt does not extend the accumulated tokens is caught
(:class:`NonPrefixTurn`) and the sample marked failed, never silently merged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.errors import ToolkitError
from toolkit.protocol import Result

SAMPLE_STATUSES = ("completed", "truncated", "aborted", "failed")


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
    replicas: set[str] = field(default_factory=set)
    groups: set[str] = field(default_factory=set)
    response: str = ""
    response_decoded: bool = False
    error: str = ""

    @classmethod
    def start(cls, index: int, session_id: str, prompt: list[int]) -> Sample:
        return cls(index, session_id, list(prompt), [0] * len(prompt), [0.0] * len(prompt), len(prompt))

    @property
    def response_length(self) -> int:
        """Tokens after the first prompt: generations and observations."""
        return len(self.tokens) - self.prompt_length

    def add_turn(self, prompt: list[int], result: Result) -> None:
        """Merge one generation whose request carried ``prompt``."""
        n = len(self.tokens)
        if len(prompt) < n or prompt[:n] != self.tokens:
            at = next((i for i, (a, b) in enumerate(zip(prompt, self.tokens, strict=False)) if a != b), min(len(prompt), n))
            raise NonPrefixTurn(
                f"turn {self.num_turns} of {self.session_id}: its prompt ({len(prompt)} tokens) does not extend "
                f"the {n} accumulated tokens (first difference at position {at})"
            )
        extra = prompt[n:]
        self.extend_observation(extra)
        out = result.output_token_ids
        lps = result.logprobs if len(result.logprobs) == len(out) else [0.0] * len(out)
        self.tokens.extend(out)
        self.loss_mask.extend([1] * len(out))
        self.rollout_logprobs.extend(lps)
        self.num_turns += 1
        self.generated_tokens += len(out)
        self.cached_tokens += result.cached_tokens
        if result.weight_version not in self.weight_versions:
            self.weight_versions.append(result.weight_version)
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
