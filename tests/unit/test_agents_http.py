"""The built-in agents' HTTP client: retries 429 and 5xx with backoff, never a 4xx; harness stdout rewards."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from toolkit.rollout.agents import AgentFailed, _reward_from_stdout, post_json, session_root


async def _serve(statuses: list[int]) -> tuple[web.AppRunner, str, list[int]]:
    seen: list[int] = []

    async def handle(request: web.Request) -> web.Response:
        status = statuses[min(len(seen), len(statuses) - 1)]
        seen.append(status)
        return web.json_response({"ok": status < 400, "error": {"message": "no"}}, status=status)

    app = web.Application()
    app.router.add_post("/x", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/x", seen


@pytest.mark.parametrize(("statuses", "ok", "calls"), [([503, 429, 200], True, 3), ([400, 200], False, 1),
                                                        ([500, 500, 500], False, 3)])
def test_post_json_retries_429_and_5xx_only(statuses: list[int], ok: bool, calls: int) -> None:
    async def body() -> None:
        runner, url, seen = await _serve(statuses)
        try:
            async with aiohttp.ClientSession() as http:
                if ok:
                    assert (await post_json(http, url, {}, retries=2, backoff_s=0.01))["ok"]
                else:
                    with pytest.raises(AgentFailed, match=f"HTTP {statuses[-1] if calls > 1 else 400}"):
                        await post_json(http, url, {}, retries=2, backoff_s=0.01)
            assert len(seen) == calls
        finally:
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_harness_rewards_and_session_urls() -> None:
    assert _reward_from_stdout(b"working...\n0.5\n") == 0.5
    assert _reward_from_stdout(b'log\n{"reward": 2}\n\n') == 2.0
    assert _reward_from_stdout(b"no reward here\n") is None and _reward_from_stdout(b"true\n") is None
    assert session_root("http://h:1/sessions/0-3-ab/v1") == "http://h:1/sessions/0-3-ab"
