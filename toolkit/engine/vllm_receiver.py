"""One vLLM worker's side of streamed updates: the bits of the weights it holds, its staging, and how a
staged update goes in (and back out on an error).

A worker holds, of each checkpoint tensor, only what its own loaders read (``vllm_shards.probe``: a
tensor-parallel worker its shard, a pipeline stage its layers; everything when it reads everything), and
keeps only that of an update passing through it on the chain (``toolkit/weights/shards.py``). A worker
that reads every tensor whole receives straight into one reused staging buffer instead.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from toolkit.weights.shards import Keep, Region, Share, Slot
from toolkit.weights.transport import Link
from toolkit.weights.wire import Manifest, Parts, bits, split

logger = logging.getLogger(__name__)

_REGIONS_OUT = msgspec.msgpack.Encoder()
_REGIONS_IN = msgspec.msgpack.Decoder(list[tuple[str, int, int, int, int]])
"""A worker's regions as it sends them to its replica's first worker: (name, offset, rows, cols, stride)."""


def _torch_dtype(name: str) -> Any:
    import torch  # the vllm extra's

    return getattr(torch, name)


def to_torch(b: np.ndarray, dtype: str) -> Any:
    """Bits (as :func:`~toolkit.weights.wire.bits` holds them) as a torch tensor of ``dtype``, no copy."""
    import torch  # the vllm extra's

    return torch.from_numpy(b).view(_torch_dtype(dtype))


def slot_tensor(slot: Slot) -> Any:
    """A slot's full-shaped view (right at its region) as a torch tensor of its dtype, no copy."""
    import torch  # the vllm extra's

    return torch.from_numpy(slot.memory).view(_torch_dtype(slot.dtype)).as_strided(slot.shape, slot.strides, 0)


def _checkpoint(path: str) -> Iterator[tuple[str, Any]]:
    """(name, the open safetensors file holding it) for each tensor of the files in ``path``."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, st


def checkpoint_specs(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape and torch's dtype name, from the files' headers (nothing read)."""
    slices = ((name, st.get_slice(name)) for name, st in _checkpoint(path))
    return {name: (tuple(sl.get_shape()), _dtype_name(sl.get_dtype())) for name, sl in slices}


def checkpoint_tensors(path: str) -> Iterator[tuple[str, np.ndarray, str]]:
    """The tensors of the safetensors files in ``path``, one at a time: name, bits (shaped), torch's dtype name."""
    for name, st in _checkpoint(path):
        t = st.get_tensor(name)
        dtype = str(t.dtype).removeprefix("torch.")
        as_int = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}[t.element_size()]
        yield name, bits(t.contiguous().view(_torch_dtype(as_int)).numpy(), dtype), dtype


def read_checkpoint(path: str) -> dict[str, tuple[np.ndarray, str]]:
    """Every tensor of the safetensors files in ``path``: its bits and torch's name of its dtype."""
    return {name: (b, dtype) for name, b, dtype in checkpoint_tensors(path)}


def _sharded() -> bool:
    """Whether this worker is one of several holding the model (tensor or pipeline parallel)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return get_tp_group().world_size > 1 or get_pp_group().world_size > 1


def _unniced() -> None:
    """The calling thread back at the default priority where the system allows it: a CPU engine's
    processes run niced (``engine.cpu_engine_nice``), and the receive thread would otherwise queue
    behind the engine's own busy threads while the link waits."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 0)
    except (PermissionError, OSError):
        pass  # not allowed (no CAP_SYS_NICE): it receives at the process's priority


@dataclass(frozen=True)
class Place:
    """A worker's place on an update's chain."""

    first: int
    """The rank of its replica's first worker (which receives the whole update from ``prev`` and
    forwards it to the next replica's first worker)."""
    index: int
    """Its place among its replica's workers (0: the first)."""
    workers: int
    """Its replica's workers: ranks ``first .. first + workers - 1``."""
    prev: int
    world: int

    @property
    def rank(self) -> int:
        return self.first + self.index

    @property
    def next(self) -> int | None:
        return self.first + self.workers if self.first + self.workers < self.world else None


class Receiver:
    """One worker's held weights (a :class:`Slot` per tensor, changed in place) and its staging, reused
    from update to update (fresh buffers would fault every page in again)."""

    def __init__(self) -> None:
        self.version = -1
        self.held: dict[str, Slot] = {}
        self.regions: dict[str, Region] = {}
        """The tensors this worker reads a region of (the rest it reads whole)."""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.status: dict[str, Any] = {"state": "idle"}
        self._staging = np.empty(0, np.uint8)
        self._slots: dict[str, Slot] = {}
        """A sharded worker's staged tensors."""
        self._staged: tuple[Manifest, Parts] | None = None
        self._settling: threading.Thread | None = None

    def hold(self, path: str, version: int, model: Any = None) -> None:
        """The engine holds checkpoint ``path`` as ``version`` (a start, a restart, a checkpoint load);
        ``model``: the worker's, to find what of each tensor its loaders read."""
        self._settled()
        self.regions = {}
        if model is not None and _sharded():
            from toolkit.engine.vllm_shards import probe

            try:
                self.regions = probe(model, checkpoint_specs(path))
            except Exception:  # noqa: BLE001 - a loader a region cannot follow: every tensor kept whole
                logger.warning("finding this worker's shards failed: it keeps every tensor whole", exc_info=True)
        self.held = {}
        total = 0
        for name, b, dtype in checkpoint_tensors(path):
            region = self.regions.get(name)
            if region is None:  # kept whole: the tensor just read, as it is
                self.held[name] = Slot(Region.whole(b.size), b.shape, dtype, whole=b)
            else:
                slot = self.held[name] = Slot(region, b.shape, dtype)
                region.gather(b.reshape(-1), slot.bits)
            total += b.nbytes
        if self.regions:
            logger.info("this worker holds %d of the checkpoint's %d bytes (a shard of %d of its %d tensors)",
                        self.held_bytes, total, len(self.regions), len(self.held))
        self.version = version
        self.discard()

    @property
    def held_bytes(self) -> int:
        return sum(s.bits.nbytes for s in self.held.values())

    def stage(self, manifest: Manifest, master: str, port: int, place: Place, host: str, timeout_s: float) -> None:
        """Receive ``manifest``'s payload at ``place`` on the chain, in a thread (``status`` says how it
        went); ``host``: this worker's address for the chain. A replica's first worker receives the whole
        payload and sends every other worker its share (:class:`~toolkit.weights.shards.Share`, from the
        regions each sends it first)."""
        if self._thread is not None and self._thread.is_alive():
            if self.status.get("state") == "staging":
                raise RuntimeError("an update is already being staged")
            self._thread.join()  # the last one staged (or failed) and is closing its link
        self._settled()
        self.discard()
        self.status = {"state": "staging", "version": manifest.version, "received": 0, "total": manifest.total}
        sizes = {k: int(np.prod(v.shape, dtype=np.int64)) for k, v in self.held.items()}

        def run() -> None:
            link: Link | None = None
            try:
                _unniced()
                link = Link(master, port, place.rank, place.world, timeout_s, host=host)
                progress = lambda done: self.status.__setitem__("received", done)  # noqa: E731
                if place.index:
                    link.send_bytes(place.first, _REGIONS_OUT.encode(
                        [(n, r.offset, r.rows, r.cols, r.stride) for n, r in self.regions.items()]))
                    keep = Keep(manifest, self.regions, self._slots)
                    link.receive_share(manifest, place.first, keep, progress)
                    parts, kept = keep.parts(self.version, sizes), keep.kept_bytes
                else:
                    siblings = [(place.first + i, Share(manifest, {n: Region(*r) for n, *r in
                                                                   _REGIONS_IN.decode(link.recv_bytes(place.first + i))}))
                                for i in range(1, place.workers)]
                    if self.regions:
                        keep = Keep(manifest, self.regions, self._slots)
                        link.receive(manifest, None, progress, keep=keep.take, prev=place.prev, next=place.next,
                                     siblings=siblings)
                        parts, kept = keep.parts(self.version, sizes), keep.kept_bytes
                    else:
                        if self._staging.size < manifest.total:
                            self._staging = np.empty(manifest.total, np.uint8)
                        staging = self._staging[:manifest.total]
                        link.receive(manifest, staging, progress, prev=place.prev, next=place.next, siblings=siblings)
                        parts, kept = split(manifest, staging, self.version, sizes), manifest.total
                with self._lock:
                    self._staged = (manifest, parts)
                    self.status = {**self.status, "state": "staged", "kept": kept}
            except Exception as exc:  # noqa: BLE001 - reported through the status, the model untouched
                logger.warning("staging version %d failed: %s", manifest.version, exc)
                self.status = {**self.status, "state": "failed", "error": f"{type(exc).__name__}: {exc}"}
            finally:
                if link is not None:  # its group goes: a worker still waiting on this one hears at once
                    link.close()

        self._thread = threading.Thread(target=run, name=f"stage-v{manifest.version}", daemon=True)
        self._thread.start()

    def discard(self) -> None:
        with self._lock:
            self._staged = None
            if self.status.get("state") in ("staged", "failed", "staging"):
                self.status = {"state": "idle"}

    def _staged_tensor(self, name: str, dense: np.ndarray, dtype: str) -> Any:
        return slot_tensor(self._slots[name]) if self.regions else to_torch(dense, dtype)

    def _load(self, model: Any, model_config: Any, tensors: Iterator[tuple[str, Any]]) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(model)
        try:
            model.load_weights(tensors)
        finally:
            finalize_layerwise_reload(model, model_config)

    def _held_tensors(self) -> Iterator[tuple[str, Any]]:
        for name, slot in self.held.items():
            yield name, slot_tensor(slot)

    def apply(self, model: Any, model_config: Any) -> None:
        """Load what was staged (the engine is paused): deltas patched into the held bits in place (their
        old values kept), dense tensors from the staging, then copied into the held bits. On an error,
        the old values go back and the held weights are loaded again."""
        with self._lock:
            staged = self._staged
        if staged is None:  # nothing changed: the previous version serves, as after a rollback
            error = f"nothing staged to apply (status: {self.status})"
            self.status = {"state": "rolled_back", "error": error, "version": self.version}
            raise RuntimeError(error)
        manifest, parts = staged
        saved: dict[str, tuple[np.ndarray, np.ndarray]] = {}

        def tensors() -> Iterator[tuple[str, Any]]:
            for t in manifest.tensors:
                dense = parts.dense.get(t.name)
                yield t.name, (self._staged_tensor(t.name, dense, t.dtype) if dense is not None
                               else slot_tensor(self.held[t.name]))
            # A dense update that leaves tensors out keeps their values: a reload of a layer loads each
            # of its parameters, and one not given would serve the memory it was allocated with.
            named = {t.name for t in manifest.tensors}
            for name, slot in self.held.items():
                if name not in named:
                    yield name, slot_tensor(slot)

        try:
            for name, (idx, values) in parts.deltas.items():
                slot = self.held[name]
                inside, pos = slot.region.local(idx)
                saved[name] = (pos, slot.bits[pos].copy())
                slot.bits[pos] = values[inside]
            self._load(model, model_config, tensors())
        except BaseException as exc:
            logger.exception("applying version %d failed: putting version %d back", manifest.version, self.version)
            self.status = {"state": "broken", "error": f"{type(exc).__name__}: {exc}"}
            for name, (pos, old) in saved.items():
                self.held[name].bits[pos] = old
            self._load(model, model_config, self._held_tensors())
            self.status = {"state": "rolled_back", "error": f"{type(exc).__name__}: {exc}", "version": self.version}
            self.discard()
            raise
        self.version = manifest.version
        self.discard()
        self.status = {"state": "idle", "version": self.version}
        if parts.dense:  # the held bits catch up off the pause; the next stage waits for them
            dense = {t.name: (parts.dense[t.name], t) for t in manifest.tensors if t.name in parts.dense}
            self._settling = threading.Thread(target=self._settle, args=(dense,), name="settle", daemon=True)
            self._settling.start()

    def _settle(self, dense: dict[str, tuple[np.ndarray, Any]]) -> None:
        """Copy the dense tensors just applied from the staging into the held bits (the staging is the
        next update's)."""
        for name, (new, spec) in dense.items():
            region = self.regions.get(name) or Region.whole(spec.numel)
            held = self.held.get(name)
            if held is None or not held.fits(region, spec.shape, spec.dtype):
                held = self.held[name] = Slot(region, spec.shape, spec.dtype)
            np.copyto(held.bits, new.reshape(-1))

    def _settled(self) -> None:
        if self._settling is not None:
            self._settling.join()
            self._settling = None


def _dtype_name(safetensors_dtype: str) -> str:
    """torch's name of a safetensors dtype code (``BF16`` -> ``bfloat16``)."""
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "U8": "uint8",
             "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool"}
    if safetensors_dtype not in names:
        raise ValueError(f"a checkpoint tensor of dtype {safetensors_dtype} cannot be streamed; valid: {', '.join(names)}")
    return names[safetensors_dtype]
