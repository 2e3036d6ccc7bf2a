"""Agents over HTTP: what runs once per session against the rank's gateway (``workload.agent``).

An agent is any ``async def solve(base_url: str, task: dict) -> float | None``: it talks to the
session's base URL with whatever client it likes (the ``openai`` or ``anthropic`` SDK, plain HTTP)
and returns the reward, or None after posting it to ``<base_url without /v1>/reward``. The run's API
key is in ``OPENAI_API_KEY`` and ``ANTHROPIC_API_KEY`` (the SDKs read them), so a harness written
for those APIs runs unchanged. Built-ins:

- :func:`run_command`: a harness that is a program of its own (a CLI agent, a container), started per
  session with ``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL``, ``TOOLKIT_SESSION_URL``,
  ``TOOLKIT_REWARD_URL`` and ``TOOLKIT_TASK`` (the task as JSON) in its environment; its reward is
  the last line of its stdout (a number or ``{"reward": x}``) or what it posted. It is killed (its
  whole process group) when the session times out.
- :func:`add_numbers`: the default task of ``workload=agent``, a multi-turn tool-calling session in
  plain HTTP (aiohttp) with connect/read timeouts and jittered retries on 429/5xx only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
from typing import Any

import aiohttp

from toolkit.core.errors import ToolkitError

logger = logging.getLogger(__name__)


class AgentFailed(ToolkitError):
    """The agent or harness of one session failed (its sample is marked failed, the step goes on)."""


def session_root(base_url: str) -> str:
    """``http://host:port/sessions/<key>`` from the session's OpenAI base URL."""
    return base_url[:-3] if base_url.endswith("/v1") else base_url


def _api_key() -> str:
    return os.environ.get("OPENAI_API_KEY", "toolkit")


async def post_json(http: aiohttp.ClientSession, url: str, body: dict[str, Any], retries: int = 4,
                    backoff_s: float = 0.2) -> dict[str, Any]:
    """POST with the run's key; retries 429 and 5xx (and a dropped connection) with jittered
    exponential backoff, never a 4xx that would fail again."""
    headers = {"authorization": f"Bearer {_api_key()}"}
    for attempt in range(retries + 1):
        try:
            async with http.post(url, json=body, headers=headers) as r:
                if r.status < 400:
                    return await r.json()
                text = await r.text()
                if r.status != 429 and r.status < 500 or attempt == retries:
                    raise AgentFailed(f"{url}: HTTP {r.status}: {text[:500]}")
        except aiohttp.ClientConnectionError as exc:
            if attempt == retries:
                raise AgentFailed(f"{url}: {exc}") from exc
        await asyncio.sleep(backoff_s * (2 ** attempt) * (0.5 + random.random()))
    raise AssertionError("unreachable")


ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}


async def add_numbers(base_url: str, task: dict[str, Any], turns: int = 3, tool_latency_s: float = 0.0,
                      connect_timeout_s: float = 10.0, read_timeout_s: float = 600.0) -> float:
    """Ask for ``a + b``; the model must call ``add`` (``tool_choice=required``) on every turn but the
    last, each call answered by the tool (after ``tool_latency_s``, as a slow tool would), then answer
    in text. Reward: 1 if the answer holds the sum, else 0 (a random model scores ~0)."""
    a, b = int(task.get("a", 2)), int(task.get("b", 3))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful calculator. Use the add tool, then answer."},
        {"role": "user", "content": f"What is {a} + {b}?"}]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for turn in range(turns):
            last = turn == turns - 1
            body = {"model": "policy", "messages": messages, "tools": [ADD_TOOL],
                    "tool_choice": "none" if last else "required"}
            msg = (await post_json(http, f"{base_url}/chat/completions", body))["choices"][0]["message"]
            messages.append({k: v for k, v in msg.items() if k in ("role", "content", "tool_calls") and v})
            if last:
                return 1.0 if str(a + b) in (msg.get("content") or "") else 0.0
            for call in msg.get("tool_calls") or []:
                args = json.loads(call["function"]["arguments"])
                await asyncio.sleep(tool_latency_s)
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": str(int(args.get("a", 0)) + int(args.get("b", 0)))})
    return 0.0


def _reward_from_stdout(out: bytes) -> float | None:
    lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
    if not lines:
        return None
    try:
        value = json.loads(lines[-1])
    except ValueError:
        return None
    if isinstance(value, dict):
        value = value.get("reward")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


PIPE_WAIT_S = 5.0
"""How long a harness's pipes may stay open after it exited (a helper it detached holds them)."""
KEPT_OUTPUT = 64 << 10
"""Bytes of a harness's stdout and of its stderr kept (the last ones): its reward is its last line, its
error its last lines, and a verbose harness must not fill the rank's memory."""


class _Tail:
    """The last ``keep`` bytes of a stream, read as they come."""

    def __init__(self, stream: asyncio.StreamReader, keep: int = KEPT_OUTPUT) -> None:
        self.data = bytearray()
        self.keep = keep
        self.task = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            self.data += chunk
            if len(self.data) > 2 * self.keep:
                del self.data[: len(self.data) - self.keep]

    def text(self) -> bytes:
        return bytes(self.data[-self.keep:])


async def run_command(base_url: str, task: dict[str, Any], command: list[str],
                      env: dict[str, str] | None = None, cwd: str | None = None) -> float | None:
    """Run one harness program for this session (see the module docstring). ``command`` items may
    hold ``{base_url}``, ``{session_url}`` and ``{task_json}``. The harness's process group ends with it."""
    root = session_root(base_url)
    task_json = json.dumps(task)
    args = [a.replace("{base_url}", base_url).replace("{session_url}", root).replace("{task_json}", task_json)
            for a in command]
    environ = {**os.environ, **(env or {}), "OPENAI_BASE_URL": base_url, "ANTHROPIC_BASE_URL": root,
               "TOOLKIT_SESSION_URL": root, "TOOLKIT_REWARD_URL": f"{root}/reward", "TOOLKIT_TASK": task_json}
    proc = await asyncio.create_subprocess_exec(*args, env=environ, cwd=cwd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = _Tail(proc.stdout), _Tail(proc.stderr)
    try:
        try:
            # Not proc.wait(): asyncio answers it only once the pipes close too, which a helper the
            # harness detached (a session of its own, out of reach of its group) may never do.
            while proc.returncode is None:
                await asyncio.sleep(0.05)
        except BaseException:
            for t in (out, err):
                t.task.cancel()
            raise
        finally:
            # Whatever the harness started (a tool server, a sandbox CLI) goes with it, by its process
            # group: when it exits, and when the session times out. Its pipes then close.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            while proc.returncode is None:
                await asyncio.sleep(0.05)
        # A process the harness put in a session of its own escapes its group and may hold the pipes
        # open: what was written by then is the harness's output.
        _, pending = await asyncio.wait([out.task, err.task], timeout=PIPE_WAIT_S)
        for t in pending:
            t.cancel()
    finally:
        # Our ends of the pipes, which such a helper still holds: left open, each session would keep two
        # descriptors (the rank runs out) and the helper would block once it filled them; a timed-out
        # session too. asyncio has no public way to close a child's pipes; its transport's close does.
        proc._transport.close()  # type: ignore[attr-defined]
    if proc.returncode != 0:
        tail = err.text().decode(errors="replace").strip().splitlines()[-5:]
        raise AgentFailed(f"harness {args[0]} exited with {proc.returncode}: " + " | ".join(tail))
    return _reward_from_stdout(out.text())
