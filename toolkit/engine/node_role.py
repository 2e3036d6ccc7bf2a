"""One process's role among the node ranks of a replica wider than a node (``toolkit/engine/nodes.py``):
its rank, how many there are, and where node rank 0 is reached."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeRole:
    rank: int
    nnodes: int
    master_addr: str
    """Where node rank 0 is reached; with ``rendezvous``, node rank 0 publishes it in the run dir."""
    master_port: int
    """0 until node rank 0 has picked it (with ``rendezvous``: when it starts, see ``nodes.publish_master``)."""
    beacon_port: int = 0
    """Where node rank 0's beacon listens (``toolkit/engine/beacon.py``), published with its address."""
    rendezvous: str = ""
    """A key the node ranks of one replica share (the Slurm job and step): node rank 0 writes its own
    address under it (``RunDir.node_master``) and the others wait for it. Node names in a job's node
    list need not be addresses (emulated nodes, sites whose node names do not resolve)."""

    def env(self) -> dict[str, str]:
        return {"TOOLKIT_NODE_RANK": str(self.rank), "TOOLKIT_NNODES": str(self.nnodes),
                "TOOLKIT_MASTER_ADDR": self.master_addr, "TOOLKIT_MASTER_PORT": str(self.master_port)}

    @classmethod
    def from_env(cls) -> NodeRole | None:
        """This process's role, if it is one node rank of a multi-node replica."""
        nnodes = int(os.environ.get("TOOLKIT_NNODES", "1"))
        if nnodes <= 1:
            return None
        return cls(int(os.environ.get("TOOLKIT_NODE_RANK", "0")), nnodes, os.environ["TOOLKIT_MASTER_ADDR"],
                   int(os.environ["TOOLKIT_MASTER_PORT"]))

    @property
    def one_host(self) -> bool:
        """Every node rank on this host (a local run): they split its CPUs and talk over loopback."""
        return self.master_addr.startswith("127.") or self.master_addr == "localhost"

    def cpus(self, available: list[int]) -> list[int]:
        """The CPUs of this node rank: all of the node's, or its share when the ranks share a host."""
        if not self.one_host:
            return available
        per = max(1, len(available) // self.nnodes)
        return available[self.rank * per:(self.rank + 1) * per] or available[-per:]
