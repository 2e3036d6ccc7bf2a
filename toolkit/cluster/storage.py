"""Is a directory on a file system that every node of the cluster sees?

On Slurm the run dir is the run's shared state (config, keys, router address, sentinels, outputs,
logs) and components run on other nodes, so it must be shared. The rule (``cluster.shared_fs_check``):

1. refused: a temporary directory (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run``, ``$TMPDIR``,
   ``$SLURM_TMPDIR``) or a memory file system (tmpfs, ramfs): node-local on every cluster;
2. accepted: a network or parallel file system (NFS, Lustre, GPFS, BeeGFS, CephFS, ...);
3. a local disk file system (ext4, xfs, btrfs, overlay, ...): accepted only when the cluster has a
   single node (a workstation, the dev cluster), refused otherwise.

``cluster.shared_fs_check=false`` turns the check off (e.g. a multi-node partition of which a run
only ever uses one node).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs"})
SHARED_FS = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "cifs", "smb3", "smbfs", "glusterfs",
    "fuse.glusterfs", "wekafs", "pvfs2", "orangefs", "panfs", "fuse.sshfs", "fuse.juicefs", "9p", "virtiofs",
    "afs", "fuse.ceph", "quobyte", "fuse.quobyte", "vast", "dvs",
})


def temp_dirs(env: dict[str, str] | None = None) -> list[str]:
    env = dict(os.environ) if env is None else env
    dirs = list(TEMP_DIRS)
    for var in ("TMPDIR", "SLURM_TMPDIR"):
        if env.get(var):
            dirs.append(env[var])
    return dirs


def mount_of(path: Path, mounts: str) -> tuple[str, str]:
    """(mount point, fs type) of the mount holding ``path``, from the text of /proc/mounts."""
    best = ("/", "unknown")
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if _under(path, Path(point)) and len(point) >= len(best[0]):
            best = (point, parts[2])
    return best


def _under(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def node_local_reason(path: Path, mounts: str, temps: list[str], nodes: int) -> str | None:
    """Why ``path`` (absolute, resolved) is node-local, or None if it may be shared."""
    for t in temps:
        tp = Path(os.path.realpath(t))
        if _under(path, tp):
            return f"it is under the temporary directory {t}, which is local to each node"
    point, fstype = mount_of(path, mounts)
    if fstype in MEMORY_FS:
        return f"it is on a {fstype} (memory) file system mounted at {point}, local to this node"
    if fstype in SHARED_FS or fstype.startswith("nfs"):
        return None
    if nodes > 1:
        return (f"it is on a local {fstype} file system ({point}) and the cluster has {nodes} nodes; "
                "components on the other nodes would not see it")
    return None


def cluster_nodes(partition: str | None) -> int:
    """Hosts that jobs of ``partition`` (or of any partition) may land on, from ``sinfo``: node hostnames,
    not node names, since several slurmd on one host (emulated nodes) share its disks."""
    args = ["sinfo", "-h", "-N", "-o", "%n"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len(set(out.stdout.split())) if out.returncode == 0 else 0


def check_shared(path: Path, what: str, nodes: int) -> str | None:
    """A message refusing ``path`` if it is node-local, else None."""
    resolved = Path(os.path.realpath(path))
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        mounts = ""
    reason = node_local_reason(resolved, mounts, temp_dirs(), nodes)
    if reason is None:
        return None
    return (f"{what} {path} is on node-local storage: {reason}. On Slurm every component must read and "
            f"write it from its own node: put it on a shared file system (e.g. hydra.run.dir=/shared/...), "
            f"or set cluster.shared_fs_check=false if every component runs on this one node.")
