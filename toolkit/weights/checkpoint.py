"""Published checkpoints: the trainer's side of the checkpoint handshake, and the one reader of ``rollout.weights_dir``.

A trainer publishes the weights for step ``v`` (weight version ``v``) with :func:`publish`; before
step ``s`` rank 0 loads the latest published checkpoint up to ``s`` (:func:`latest`) into every
replica, and with ``rollout.max_staleness = k`` first waits until one of version ``>= s - k`` is
published (:func:`wait_for_version`). The model's own weights are version 0.

Layout under ``weights_dir``::

    step_00003/                   the checkpoint for step 3, as vLLM reloads it (``reload_weights``)
        model.safetensors         the tensors, under the names they were given
        config.json               from ``config=`` or the source directory
        <extra files>             ``files=`` (tokenizer files, ...)
        .published                the completion marker: {"step", "time", "files"}
    .step_00004.tmp-k2j3/         being written: never read

Which directories count as published (:func:`published`): a directory named ``step_`` + digits
that holds the ``.published`` marker; or a directory made by hand (copied, not written by
:func:`publish`: it has no ``.publishing`` file) that holds at least one file. :func:`publish`
writes into a temp directory (``.step_XXXXX.tmp-<random>``, never matched), fsyncs, renames it to
``step_XXXXX`` and only then writes the marker and removes its ``.publishing`` file: a checkpoint
it is still writing, or one whose writer died, is never returned. A hand-made copy counts as soon
as it has a file, so copy under another name and rename it into place (or use :func:`publish`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.core.errors import ToolkitError
from toolkit.core.rundir import atomic_write

__all__ = ["MARKER", "CheckpointExists", "WeightsTimeout", "checkpoint_dir", "latest", "publish", "published",
           "versions", "wait_for_version"]

MARKER = ".published"
"""The completion marker :func:`publish` writes last, inside the checkpoint directory."""
IN_PROGRESS = ".publishing"
"""In every directory :func:`publish` writes until its marker is there: such a directory is never
taken for a hand-made one."""
WEIGHTS_FILE = "model.safetensors"

_NAME = re.compile(r"^step_(\d+)$")
PathLike = str | os.PathLike[str]


class CheckpointExists(ToolkitError):
    """:func:`publish` was asked for a step that already has a checkpoint directory (no overwrite)."""


class WeightsTimeout(ToolkitError):
    """No checkpoint of the version a step needs was published within ``rollout.weights_timeout_s``."""


def checkpoint_dir(weights_dir: PathLike, step: int) -> Path:
    """Where the checkpoint for ``step`` lives: ``<weights_dir>/step_XXXXX``."""
    return Path(weights_dir).expanduser() / f"step_{step:05d}"


def _is_published(path: Path) -> bool:
    try:
        if (path / MARKER).is_file():
            return True
        if (path / IN_PROGRESS).exists():
            return False  # publish() renamed it but has not written its marker (or died before)
        return any(p.is_file() for p in path.iterdir())  # hand-made: counts once it has a file
    except (FileNotFoundError, NotADirectoryError):
        return False


def published(weights_dir: PathLike | None, step: int) -> bool:
    """Whether the checkpoint for ``step`` is published (see the module's rule)."""
    return bool(weights_dir) and _is_published(checkpoint_dir(weights_dir, step))  # type: ignore[arg-type]


def versions(weights_dir: PathLike | None, up_to: int | None = None) -> list[int]:
    """The published versions (steps) in ``weights_dir``, ascending; only those ``<= up_to`` if given."""
    if not weights_dir:
        return []
    root = Path(weights_dir).expanduser()
    try:
        names = os.listdir(root)  # a listing, not a lookup: NFS caches a failed lookup
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [v for v in _candidates(names, up_to) if _is_published(root / f"step_{v:05d}")]


def _candidates(names: list[str], up_to: int | None) -> list[int]:
    """Versions named the way :func:`checkpoint_dir` names them (``step_3`` or ``step_000003`` is
    not ``step_00003``: such a directory is not a checkpoint), ascending."""
    out = []
    for name in names:
        m = _NAME.match(name)
        if m and name == f"step_{int(m.group(1)):05d}" and (up_to is None or int(m.group(1)) <= up_to):
            out.append(int(m.group(1)))
    return sorted(out)


def latest(weights_dir: PathLike | None, up_to: int) -> tuple[Path, int] | None:
    """The highest published checkpoint for a step ``<= up_to`` and its version, or None (none
    published, or no ``weights_dir``). Temp and half-written directories are never returned. It
    looks at the highest-numbered directories first and stops at the first published one."""
    if not weights_dir:
        return None
    root = Path(weights_dir).expanduser()
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return None
    for v in reversed(_candidates(names, up_to)):
        path = root / f"step_{v:05d}"
        if _is_published(path):
            return path, v
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_tensors(weights: Mapping[str, Any], out: Path) -> None:
    """``weights`` as one safetensors file, names kept: numpy arrays, or torch tensors (moved to the
    CPU, contiguous; tensors that share storage, such as tied embeddings or views of one fused tensor,
    are copied, as safetensors wants). Any other value is refused, naming it, before anything is written."""
    for name, v in weights.items():
        if not isinstance(v, np.ndarray) and not type(v).__module__.startswith("torch"):
            raise TypeError(f"weights[{name!r}] is a {type(v).__name__}, not a torch.Tensor or a numpy array")
    if all(isinstance(v, np.ndarray) for v in weights.values()):
        from safetensors.numpy import save_file as save_numpy  # safetensors' torch half needs torch

        save_numpy({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(out))
        return
    # torch: only for a trainer's torch tensors (the vllm extra or the trainer's own).
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, v in weights.items():
        t = torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights[{name!r}] is a {type(t).__name__}, not a torch.Tensor or a numpy array")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    save_file(tensors, str(out), metadata={"format": "pt"})


def _extra_files(files: Iterable[PathLike] | Mapping[str, PathLike | bytes] | None) -> list[tuple[str, PathLike | bytes]]:
    if files is None:
        return []
    items = list(files.items()) if isinstance(files, Mapping) else [(Path(f).name, f) for f in files]
    out = []
    for name, src in items:
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or rel.parts[0] in (MARKER, IN_PROGRESS):
            raise ValueError(f"files: {name!r} is not a plain relative name inside the checkpoint")
        out.append((str(rel), src))
    return out


def publish(weights_dir: PathLike, step: int, weights: Mapping[str, Any] | PathLike, *,
            config: Mapping[str, Any] | None = None,
            files: Iterable[PathLike] | Mapping[str, PathLike | bytes] | None = None) -> Path:
    """Publish the weights for ``step`` (weight version ``step``) as ``<weights_dir>/step_XXXXX``, atomically.

    ``weights``: a state dict (torch tensors, or numpy arrays) written as ``model.safetensors`` under
    the names given; or the path of a model directory (HF layout) whose files are copied.
    ``config``: written as ``config.json`` (over the source directory's one); vLLM reloads tensors
    into the running model, a checkpoint for it needs the same architecture. ``files``: more files,
    a list of paths (copied under their names) or ``{name: path or bytes}``.

    Written into ``.step_XXXXX.tmp-<random>`` (fsynced), renamed to ``step_XXXXX``, then marked
    ``.published``. Returns the directory. A step that already has a directory (published or not) is
    refused with :class:`CheckpointExists`: a checkpoint is never rewritten under a running rollout.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, not {step!r}")
    root = Path(weights_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    if os.path.lexists(final):
        state = ("published" if (final / MARKER).is_file() else
                 "never marked published: an interrupted publish; remove it to publish again"
                 if (final / IN_PROGRESS).exists() else "made by hand")
        raise CheckpointExists(f"step {step} already has a checkpoint, {final} ({state}); a published step is "
                               "never overwritten: publish the next step instead")
    source = None if isinstance(weights, Mapping) else Path(weights).expanduser()
    if source is not None and not source.is_dir():
        raise FileNotFoundError(f"weights: no model directory {source}")
    extra = _extra_files(files)
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step:05d}.tmp-", dir=root))
    try:
        (tmp / IN_PROGRESS).write_text(json.dumps({"step": step, "host": socket.gethostname(), "pid": os.getpid(),
                                                   "started": time.time()}))
        if source is not None:
            shutil.copytree(source, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MARKER, IN_PROGRESS))
        else:
            _save_tensors(weights, tmp / WEIGHTS_FILE)  # type: ignore[arg-type]
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True))
        for name, src in extra:
            dest = tmp / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(src, bytes):
                dest.write_bytes(src)
            else:
                shutil.copyfile(Path(src).expanduser(), dest)
        names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file() and p.name != IN_PROGRESS)
        for sub in sorted({p for p in tmp.rglob("*")}, key=lambda p: len(p.parts), reverse=True):
            if sub.is_file():
                with open(sub, "rb") as f:
                    os.fsync(f.fileno())
            elif sub.is_dir():
                _fsync(sub)
        _fsync(tmp)
        if os.path.lexists(final):
            raise CheckpointExists(f"step {step} already has a checkpoint, {final}: published meanwhile by another "
                                   "writer; a published step is never overwritten")
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(root)
    atomic_write(final / MARKER, json.dumps({"step": step, "time": time.time(), "files": names}))
    (final / IN_PROGRESS).unlink()
    _fsync(final)
    return final


async def wait_for_version(weights_dir: PathLike, version: int, up_to: int, timeout_s: float, *,
                           poll_s: float = 0.5, stop: Callable[[], bool] | None = None,
                           why: str = "") -> tuple[Path, int] | None:
    """Wait (polling in a thread: the event loop runs on) until ``latest(weights_dir, up_to)`` has
    version ``>= version``; returns it, or None once ``stop()`` says to stop waiting. Raises
    :class:`WeightsTimeout` after ``timeout_s``, naming the missing version and ``weights_dir``."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await asyncio.to_thread(latest, weights_dir, up_to)
        if found is not None and found[1] >= version:
            return found
        if stop is not None and await asyncio.to_thread(stop):
            return None
        if time.monotonic() >= deadline:
            have = f"the latest is step_{found[1]:05d}" if found is not None else "none is"
            raise WeightsTimeout(
                f"{why}no checkpoint of weight version >= {version} (step_{version:05d} .. step_{up_to:05d}) "
                f"was published in {Path(weights_dir).expanduser()} within rollout.weights_timeout_s = {timeout_s:g}s "
                f"({have} published); the trainer publishes it with "
                f"toolkit.weights.publish(weights_dir, {version}, state_dict)")
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
