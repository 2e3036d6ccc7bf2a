"""The node ranks of a multi-node replica meet at the address and port node rank 0 publishes when it
starts (``toolkit/engine/nodes.py``): a port free then, outside the kernel's ephemeral range (which the
node's other sockets come from until the engine binds it), never one fixed in advance."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

from toolkit.core.sockets import EPHEMERAL_RANGE, reserved_free_port
from toolkit.engine.beacon import knock
from toolkit.engine.node_role import NodeRole
from toolkit.engine.nodes import publish_master, read_master


def test_node_rank_0_publishes_a_free_port_and_the_others_read_address_and_port(tmp_path: Path) -> None:
    path = tmp_path / "replica-throughput-0.77.0.r0.master.json"
    # A port held by another process of the node, as the one a job id would have given.
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        busy = held.getsockname()[1]
        first = NodeRole(0, 2, "gpu7", busy, rendezvous="77.0.r0")
        met: list[NodeRole | None] = []
        reader = threading.Thread(target=lambda: met.append(read_master(NodeRole(1, 2, "gpu7", busy, "77.0.r0"),
                                                                        path, 10, poll_s=0.01)))
        reader.start()  # waits for the file
        published, beacon = publish_master(first, path)
        try:
            reader.join(10)
            assert published.master_port not in (0, busy) and published.master_addr != "gpu7"
            assert published.master_port < int(EPHEMERAL_RANGE.read_text().split()[0])
            with socket.socket() as s:
                s.bind(("", published.master_port))  # free: the engine's rendezvous can bind it
            assert published.beacon_port == beacon.port and knock("127.0.0.1", beacon.port) is True
        finally:
            beacon.close()
    assert met and met[0] is not None
    assert (met[0].master_addr, met[0].master_port, met[0].beacon_port, met[0].rank) == (
        published.master_addr, published.master_port, published.beacon_port, 1)


def test_a_local_replica_keeps_its_loopback_master(tmp_path: Path) -> None:
    role, beacon = publish_master(NodeRole(0, 2, "127.0.0.1", 0, rendezvous="local-1"), tmp_path / "m.json")
    beacon.close()
    assert role.master_addr == "127.0.0.1" and role.one_host and role.master_port > 0


def test_no_address_in_time_is_none(tmp_path: Path) -> None:
    assert read_master(NodeRole(1, 2, "gpu7", 0, "9"), tmp_path / "never.json", 0.05, poll_s=0.01) is None


def test_the_master_port_is_drawn_below_the_ephemeral_range_and_skips_a_held_one() -> None:
    first = int(EPHEMERAL_RANGE.read_text().split()[0])
    port = reserved_free_port(rng=random.Random(5))
    assert 10_000 <= port < first
    with socket.socket() as held:  # another process of the node named it meanwhile
        held.bind(("", port))
        held.listen()
        other = reserved_free_port(rng=random.Random(5))  # the same first draw: taken, so the next
    assert other != port and 10_000 <= other < first
