"""The same task against the Anthropic Messages API (``anthropic`` SDK), streaming its answers:

    python -m toolkit.launch workload=agent workload.agent._target_=examples.anthropic_agent.solve

``base_url`` ends in ``/v1`` for OpenAI clients; the Anthropic SDK appends ``/v1/messages`` itself.
"""

from __future__ import annotations

from typing import Any

import anthropic

from examples.openai_agent import add

TOOLS = [{"name": "add", "description": "Add two integers.", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"], "additionalProperties": False}}]


async def solve(base_url: str, task: dict[str, Any], max_turns: int = 4) -> float:
    a, b = task["a"], task["b"]
    async with anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), timeout=300, max_retries=3,
                                        http_client=anthropic.DefaultAsyncHttpxClient(verify=False)) as client:
        messages: list[Any] = [{"role": "user", "content": f"What is {a} + {b}? Use the add tool."}]
        for turn in range(max_turns):
            async with client.messages.stream(model="policy", max_tokens=256, tools=TOOLS, messages=messages,
                                              tool_choice={"type": "any"} if turn == 0 else {"type": "auto"}) as s:
                msg = await s.get_final_message()
            messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in msg.content]})
            uses = [block for block in msg.content if block.type == "tool_use"]
            if not uses:
                text = "".join(block.text for block in msg.content if block.type == "text")
                return 1.0 if str(a + b) in text else 0.0
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id,
                 "content": await add(int(u.input.get("a", 0)), int(u.input.get("b", 0)))} for u in uses]})
    return 0.0
