"""An agent written against the OpenAI API, run by the toolkit once per session:

    python -m toolkit.launch workload=agent workload.agent._target_=examples.openai_agent.solve

It is an ordinary harness: the ``openai`` SDK pointed at ``base_url`` (the session's own URL on the
rank's gateway; the key comes from ``OPENAI_API_KEY``, which the rank sets), chat turns with tools, a
tool that takes its time (``await``: the rank's other sessions run meanwhile), and a reward at the end.
The toolkit records the session as one training sample with the engine's exact token ids.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}]


async def add(a: int, b: int) -> str:
    await asyncio.sleep(0.2)  # a tool that calls out somewhere
    return str(a + b)


async def solve(base_url: str, task: dict[str, Any], max_turns: int = 4) -> float:
    a, b = task["a"], task["b"]
    # The gateway speaks plain HTTP on the node: no TLS context to build (a default client loads the
    # CA store, ~30-40 ms of CPU, which adds up over hundreds of sessions on a rank).
    async with openai.AsyncOpenAI(base_url=base_url, timeout=300, max_retries=3,
                                  http_client=openai.DefaultAsyncHttpxClient(verify=False)) as client:
        messages: list[Any] = [{"role": "system", "content": "Use the add tool, then give the answer."},
                               {"role": "user", "content": f"What is {a} + {b}?"}]
        for turn in range(max_turns):
            # Force a call on the first turn (a random test model could not produce one otherwise).
            out = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                       tool_choice="required" if turn == 0 else "auto")
            msg = out.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                return 1.0 if str(a + b) in (msg.content or "") else 0.0
            for call in msg.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": await add(int(args.get("a", 0)), int(args.get("b", 0)))})
    return 0.0
