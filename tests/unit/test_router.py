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
