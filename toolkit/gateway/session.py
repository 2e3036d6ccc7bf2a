"""One agent session as the gateway sees it: the token ids so far and the messages they stand for.

A session has a *line*: a :class:`~toolkit.session.sample.Sample` (ids, loss mask, logprobs) and the
canonical messages whose rendering those ids are, the last assistant messages being the engine's
own ids verbatim. A request whose messages extend the line's messages gets as prompt the line's ids
plus the ids of the template's rendering of the new messages only (and the rest of the closing of
the model's last turn, :meth:`ChatTokenizer.glue`). A request that does not extend them (the
harness rewrote or dropped a message, or changed its tools) starts a new line from a fresh
rendering: the old line is kept as its own sample and the new one records why it started. With
``n > 1`` every choice is a candidate line; the one the harness continues with stays, the others
are kept as samples of their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from toolkit.core.protocol import Result
from toolkit.gateway.chat import ChatTokenizer
from toolkit.gateway.types import Choice, Message, json_or
from toolkit.session.sample import Sample


def _norm_arguments(text: str) -> Any:
    return json_or(text, text)


def _same(a: Message, b: Message) -> bool:
    """Whether two canonical messages are the same turn (tool arguments compared as JSON values)."""
    if a.get("role") != b.get("role") or (a.get("content") or "") != (b.get("content") or ""):
        return False
    if a.get("role") == "tool" and a.get("tool_call_id", "") != b.get("tool_call_id", ""):
        return False
    ca, cb = a.get("tool_calls") or [], b.get("tool_calls") or []
    return len(ca) == len(cb) and all(
        x["id"] == y["id"] and x["name"] == y["name"] and _norm_arguments(x["arguments"]) == _norm_arguments(y["arguments"])
        for x, y in zip(ca, cb, strict=True))


def divergence(held: list[Message], sent: list[Message]) -> str | None:
    """Why ``sent`` does not extend ``held``; None if it does."""
    for i, m in enumerate(held):
        if i >= len(sent):
            return f"the request has {len(sent)} messages, the session {len(held)}: earlier messages were dropped"
        if not _same(m, sent[i]):
            return f"message {i} ({m.get('role')}) differs from the one the session holds"
    return None


def assistant_message(choice: Choice) -> Message:
    msg: Message = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in choice.tool_calls]
    return msg


@dataclass
class Line:
    sample: Sample
    messages: list[Message]
    tools: list[dict[str, Any]]
    last_generated: list[int] = field(default_factory=list)
    """The ids of the line's last generation (their end decides the glue)."""
    choice: int = 0
    """Which choice of its last turn this line took (``n > 1``)."""


@dataclass
class Plan:
    """The prompt of one request, and whether it starts a new line (with the reason)."""

    prompt: list[int]
    tools: list[dict[str, Any]]
    """The tools the prompt was rendered with (a call without tools keeps the line's)."""
    branch_reason: str | None = None


class GatewaySession:
    def __init__(self, index: int, session_id: str, chat: ChatTokenizer, record_messages: bool = False) -> None:
        self.index = index
        self.session_id = session_id
        self.chat = chat
        self.record_messages = record_messages
        self.line: Line | None = None
        self.alternatives: list[Line] = []
        """Other choices of the line's last ``n > 1`` turn, until the harness picks one."""
        self._choice_note = ""
        self.finished: list[Sample] = []
        self.branches = 0
        self.turns = 0
        self.reward: float | None = None
        """A reward the harness posted to the session (used when the agent returns None)."""

    # ---- prompts ---------------------------------------------------------------------------
    def plan(self, messages: list[Message], tools: list[dict[str, Any]]) -> Plan:
        """The prompt ids of a request with these messages and tools."""
        if self.line is None:
            return Plan(self._fresh(messages, tools), tools)
        line = self._pick(messages)
        # A call without tools (a final answer, say) continues a line that has them: they stay in
        # the context the engine sees. Other tools than the line's are another context: a branch.
        tools = tools or line.tools
        why = "the tools changed" if line.tools != tools else divergence(line.messages, messages)
        if why is None:
            # The held messages stand for the sent ones (equal as turns, maybe not as text: JSON
            # spacing of tool arguments), so the rendering starts from the held ones.
            text = self.chat.continuation(line.messages, messages[len(line.messages):], tools)
            if text is None:
                why = "the chat template did not render the conversation as an extension of the session's"
            else:
                glue = self.chat.glue(line.last_generated) if line.last_generated else ""
                return Plan(line.sample.tokens + self.chat.encode(glue + text), tools)
        return Plan(self._fresh(messages, tools), tools, why)

    def _fresh(self, messages: list[Message], tools: list[dict[str, Any]]) -> list[int]:
        return self.chat.encode(self.chat.render(messages, tools, True))

    def _pick(self, messages: list[Message]) -> Line:
        """After an ``n > 1`` turn: the choice the harness continues with becomes the line."""
        if self.alternatives and self.line is not None and divergence(self.line.messages, messages) is not None:
            for i, alt in enumerate(self.alternatives):
                if divergence(alt.messages, messages) is None:
                    self.alternatives[i], self.line = self.line, alt
                    break
        return self.line  # type: ignore[return-value]

    # ---- results -----------------------------------------------------------------------------
    def commit(self, plan: Plan, messages: list[Message], results: list[Result], choices: list[Choice]) -> None:
        """Record a turn the engine answered: the line (or a new one) grows by the first choice; the
        other choices become candidate lines."""
        self.turns += 1
        self._settle()
        if self.line is None or plan.branch_reason is not None:
            if self.line is not None:
                self._close(self.line)
                self.branches += 1
            sample = Sample.start(self.index, self.session_id, plan.prompt)
            sample.branch = self.branches
            if plan.branch_reason is not None:
                sample.error = f"branch at turn {self.turns - 1}: {plan.branch_reason}"
            base = Line(sample, [], plan.tools)
        else:
            base = self.line
        # The others share the base's messages and tools (each line's are replaced below, never changed).
        lines = [base if k == len(choices) - 1 else Line(base.sample.copy(), base.messages, base.tools)
                 for k in range(len(choices))]
        for k, (line, result, choice) in enumerate(zip(lines, results, choices, strict=True)):
            line.choice = k
            line.sample.add_turn(plan.prompt, result)
            line.messages = [*messages, assistant_message(choice)]
            line.tools = plan.tools
            line.last_generated = list(result.output_token_ids)
        self.line = lines[0]
        self.alternatives = lines[1:]
        self._choice_note = f"of {len(choices)} at turn {self.turns - 1}, not continued"

    def _settle(self) -> None:
        """Keep the choices the harness did not continue with as samples of their own."""
        for line in self.alternatives:
            self.branches += 1
            line.sample.branch = self.branches
            note = f"choice {line.choice} {self._choice_note}"
            line.sample.error = f"{line.sample.error}; {note}" if line.sample.error else note
            self._close(line)
        self.alternatives = []

    def choose(self, k: int) -> None:
        """The harness names choice ``k`` of the last ``n > 1`` call as the one it went on with (a
        best-of-n agent that ends the session on it: no later call says which it took). Raises
        ValueError if the last call had no choice ``k``."""
        if self.line is not None and self.line.choice == k:
            return
        for i, alt in enumerate(self.alternatives):
            if alt.choice == k:
                self.alternatives[i], self.line = self.line, alt  # type: ignore[assignment]
                return
        have = sorted([*(a.choice for a in self.alternatives), *([self.line.choice] if self.line else [])])
        raise ValueError(f"the session's last call has no choice {k} (it has {have})")

    def _close(self, line: Line) -> None:
        if self.record_messages:
            line.sample.messages = json.dumps(line.messages, ensure_ascii=False)
        self.finished.append(line.sample)

    def samples(self, status: str, error: str, reward: float) -> list[Sample]:
        """Every sample of the session, in the order their lines started, the final line last (it
        carries the reward and the session's outcome); ``branch`` numbers them in that order."""
        self._settle()
        if self.line is None:
            self.line = Line(Sample.start(self.index, self.session_id, []), [], [])
        final = self.line.sample
        final.reward = reward
        if status != "completed":
            final.mark(status, "; ".join(e for e in (final.error, error) if e))
        self._close(self.line)
        self.line = None
        out = sorted(self.finished, key=lambda s: (s is final, s.branch))
        for k, s in enumerate(out):
            s.branch = k
        return out
