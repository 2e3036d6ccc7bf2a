"""What a real router learns of its replicas' speed, per group (sim replica processes). The rates
themselves: tests/unit/test_speed.py."""

from __future__ import annotations

import asyncio

from tests.helpers.aio import with_client
from toolkit.client import RouterClient, router_status
from toolkit.core.protocol import Generate, Sampling


def test_the_router_reports_what_it_learned_per_group(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run(["router.heartbeat_s=0.1", "engine.time_scale=1.0", "engine.output_len_median=100000"])
    stack.start(timeout_s=30)

    async def body(c: RouterClient) -> None:
        reqs = [Generate(f"r{i}", job="j", session_id=f"s{i}", step=0, prompt_token_ids=[1, 2, i + 3],
                         sampling=Sampling(max_tokens=300)) for i in range(6)]
        running = [asyncio.create_task(c.generate(m)) for m in reqs]
        while True:
            st = await asyncio.to_thread(router_status, stack.frontend, 1.0)
            groups = st.groups if st is not None else {}
            if any(g.tokens_per_s > 0 for g in groups.values()):
                break
            await asyncio.sleep(0.05)
        learned = [g for g in groups.values() if g.tokens_per_s > 0]
        assert all(0 < g.request_tokens_per_s <= g.tokens_per_s for g in learned)
        for res, _ in await asyncio.gather(*running):
            assert res.status == "ok"

    asyncio.run(with_client(rd, body))
