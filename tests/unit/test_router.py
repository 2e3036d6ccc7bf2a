"""The router's link to its address file, without processes (the router with real replica processes:
tests/integration/test_router.py)."""

from __future__ import annotations

import asyncio


def test_a_router_address_file_that_cannot_be_read_leaves_the_link_where_it_is(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """RouterLink.follow runs in the task that reads the socket: if it raised, nothing would read it."""
    import zmq.asyncio

    from toolkit.core.sockets import RouterLink

    async def main() -> list[bool]:
        ctx = zmq.asyncio.Context()
        try:
            unreadable = tmp_path / "router.json"
            unreadable.mkdir()  # reading it raises OSError, as a stale handle on a shared file system does
            link = RouterLink(ctx, unreadable, "frontend")
            link.connect("tcp://127.0.0.1:5999")
            moved = [await link.follow()]
            wrong = tmp_path / "wrong.json"
            for text in ("[1, 2]", '{"backend": "tcp://127.0.0.1:6000"}', '{"frontend": 7}', "{torn"):
                wrong.write_text(text)
                link.address_file = wrong
                moved.append(await link.follow())
            assert link.address == "tcp://127.0.0.1:5999"
            wrong.write_text('{"frontend": "tcp://127.0.0.1:6001"}')
            moved.append(await link.follow())
            assert link.address == "tcp://127.0.0.1:6001"
            link.close()
            return moved
        finally:
            ctx.term()

    assert asyncio.run(main()) == [False, False, False, False, False, True]


def test_the_results_kept_for_duplicates_are_bounded_by_count_and_by_bytes() -> None:
    """``router.result_cache`` and ``result_cache_mb``: the oldest go first, whichever bound is passed; a
    Result larger than the byte bound is not kept rather than dropping every other."""
    from toolkit.router.answered import Answered

    a = Answered(3, 100)
    for rid in ("r1", "r2", "r3"):
        a.keep(rid, bytes(40))
    assert a.result("r1") is None and a.result("r2") == bytes(40) and a.bytes == 80  # 120 > 100 bytes
    a.keep("r4", bytes(5))
    a.keep("r5", bytes(5))
    assert [a.result(r) is not None for r in ("r2", "r3", "r4", "r5")] == [False, True, True, True]  # 4 > 3
    a.keep("big", bytes(101))
    assert a.result("big") is None and a.result("r3") is not None and a.bytes == 50
    a.keep("r3", bytes(1))  # the same id again: counted once, at its new size
    assert a.bytes == 11 and a.result("r3") == bytes(1)
    none = Answered(0, 100)
    none.keep("r1", b"x")
    assert none.result("r1") is None and none.bytes == 0
