"""Agents for the launch tests: real harnesses over HTTP (the ``openai`` SDK), and ones that fail in the
ways real ones do (raise, hang, send malformed JSON)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
from typing import Any

import aiohttp
import openai

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"enum": ["cat", "dog", "fox"]}},
                   "required": ["word"], "additionalProperties": False}}}]


async def openai_tools(base_url: str, task: dict[str, Any], turns: int = 3, tool_latency_s: float = 0.05,
                       check_outsider: bool = False) -> float:
    """``turns - 1`` forced tool calls (each answered after a slow tool), then a free answer.
    ``check_outsider``: first make sure a client without the run's key is turned away (401)."""
    if check_outsider:
        outsider = openai.AsyncOpenAI(base_url=base_url, api_key="guess", timeout=60, max_retries=0)
        try:
            await outsider.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            raise AssertionError("an outsider got in")
        except openai.AuthenticationError:
            pass
    client = openai.AsyncOpenAI(base_url=base_url, timeout=60, max_retries=2)  # key from OPENAI_API_KEY
    messages: list[Any] = [{"role": "user", "content": f"Task {task['index']}: look words up."}]
    for turn in range(turns):
        last = turn == turns - 1
        out = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                   tool_choice="none" if last else "required", max_tokens=64)
        msg = out.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls or []:
            await asyncio.sleep(tool_latency_s)  # the rank's other sessions go on meanwhile
            word = json.loads(call.function.arguments)["word"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{word}: an animal"})
    await client.close()
    return 1.0


def _plainly(fn: Any) -> Any:
    """What many decorators do (a retry, a timer): wrap an async agent in a plain function."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


decorated_openai_tools = _plainly(openai_tools)
"""An async agent that looks sync (``inspect.iscoroutinefunction`` is False): its thread hands back
the coroutine, which the rank awaits."""


async def flaky(base_url: str, task: dict[str, Any]) -> float:
    """Session 3 raises, 5 hangs, 6 sends malformed JSON; the others are real tool-calling sessions."""
    index = task["index"]
    if index == 3:
        raise RuntimeError("agent crashed on session 3")
    if index == 5:
        await asyncio.sleep(3600)
    if index == 6:
        async with aiohttp.ClientSession() as http, http.post(
                f"{base_url}/chat/completions", data=b'{"messages": [{"role": "user", "content": "hi"',
                headers={"content-type": "application/json"}) as r:
            raise ValueError(f"the gateway answered {r.status}: {(await r.json())['error']['message'][:60]}")
    return await openai_tools(base_url, task)


async def carried(base_url: str, task: dict[str, Any], slow: tuple[str, ...] = (), until: str = "") -> float:
    """``openai_tools``; the sessions named in ``slow`` (``"step/index"``) first wait (at most 60 s)
    until the file ``until`` exists, so they are carried past that step (``rollout.close=count``)."""
    if f"{task['step']}/{task['index']}" in slow:
        for _ in range(1200):
            if os.path.exists(until):
                break
            await asyncio.sleep(0.05)
    return await openai_tools(base_url, task, turns=2, tool_latency_s=0.01)
