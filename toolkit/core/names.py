"""How the fleet names a replica, in one place: its place ``<group>-<index>`` (what ``launch`` starts,
drains and restarts, and what consistent hashing puts on its ring), its process ``replica-<place>``
(logs, pid files, Slurm job names), and its id ``<place>@<where>`` (a real replica's ``host:pid``, the
twin's ``twin``), from which the router reads the place back."""

from __future__ import annotations


def place(group: str, index: int) -> str:
    """Replica ``index`` of ``group``: ``<group>-<index>``."""
    return f"{group}-{index}"


def process_name(group: str, index: int) -> str:
    """The process (or job) of replica ``index`` of ``group``: ``replica-<group>-<index>``."""
    return f"replica-{place(group, index)}"


def replica_id(group: str, index: int, where: str) -> str:
    """The id a replica registers with: its place and where it runs (``host:pid``; a restarted replica
    gets a new id in the same place)."""
    return f"{place(group, index)}@{where}"


def place_of(rid: str) -> str:
    """The place in a replica id (:func:`replica_id`)."""
    return rid.partition("@")[0]
