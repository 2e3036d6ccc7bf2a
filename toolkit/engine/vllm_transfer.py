"""The toolkit's weight-transfer backend inside vLLM's workers: streamed updates staged while the engine
serves, then applied in one short pause.

vLLM 0.32 picks a worker's weight-transfer engine by ``weight_transfer_config.backend`` from
``WeightTransferEngineFactory``; this module registers ``toolkit_gloo`` there (from the toolkit's
``vllm.general_plugins`` entry point, which vLLM runs in every one of its processes, spawned workers
included). vLLM's own engines broadcast over NCCL and need a GPU; this one moves the payload over
torch.distributed's gloo chain (``toolkit/weights/transport.py``), so the same path runs on CPUs.

The engine's ``update_weights`` takes a ``phase``:

- ``stage``: join the update's chain and receive the payload into a staging buffer in a thread of the
  worker, then decode it against the weights it holds (a delta against another base is refused).
  The engine goes on serving meanwhile; nothing in the model changes. ``toolkit_stream_status``
  (the worker extension, through ``collective_rpc``) says when it is staged, or why it failed.
- ``apply`` (the replica has paused the engine): put the staged tensors in through vLLM's layerwise
  reload, which rebuilds each layer's packed kernels (on CPUs linear weights live only in oneDNN's
  packed copies: a plain ``copy_`` reaches nothing). On an error the previous weights are put back the
  same way, so a replica never serves half an update.
- ``discard``: drop what was staged.

The worker keeps the bits of the weights it holds (read from the checkpoint it loaded, then each
applied update) to apply deltas to and to roll back to: one copy of the model in host memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from toolkit.core.protocol import StreamWeights
from toolkit.weights.transport import Link
from toolkit.weights.wire import Manifest, Parts, bits, split

logger = logging.getLogger(__name__)

BACKEND = "toolkit_gloo"
EXTENSION = "toolkit.engine.vllm_transfer.StreamWorker"
"""``worker_extension_cls``: adds ``toolkit_stream_status`` to vLLM's workers."""
STREAM_ARGS = {"weight_transfer_config": {"backend": BACKEND}, "worker_extension_cls": EXTENSION}
"""The engine arguments that select this backend (``rollout.weights_transport=stream``)."""


def _torch_dtype(name: str) -> Any:
    import torch  # the vllm extra's

    return getattr(torch, name)


def to_torch(b: np.ndarray, dtype: str) -> Any:
    """Bits (as :func:`~toolkit.weights.wire.bits` holds them) as a torch tensor of ``dtype``, no copy."""
    import torch  # the vllm extra's

    return torch.from_numpy(b).view(_torch_dtype(dtype))


def read_checkpoint(path: str) -> dict[str, tuple[np.ndarray, str]]:
    """Every tensor of the safetensors files in ``path``: its bits and torch's name of its dtype."""
    from safetensors.torch import load_file  # torch: the vllm extra's

    out: dict[str, tuple[np.ndarray, str]] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            dtype = str(t.dtype).removeprefix("torch.")
            width = t.element_size()
            as_int = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}[width]
            out[name] = (bits(t.contiguous().view(_torch_dtype(as_int)).numpy(), dtype), dtype)
    if not out:
        raise FileNotFoundError(f"no safetensors files in {path}")
    return out


def register() -> None:
    """Make ``toolkit_gloo`` a weight-transfer backend in this process (idempotent)."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND in WeightTransferEngineFactory._registry:
        return

    @dataclass(kw_only=True)
    class InitInfo(WeightTransferInitInfo):
        path: str
        """The checkpoint the engine holds (its model directory, or the last one it loaded)."""
        version: int

    @dataclass(kw_only=True)
    class UpdateInfo(WeightTransferUpdateInfo):
        phase: str
        manifest: bytes = b""
        master: str = ""
        port: int = 0
        rank: int = 0
        world: int = 0
        timeout_s: float = 300.0

    class GlooStreamEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            super().__init__(config, vllm_config, device, model)
            self.stream = Receiver()

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            self.stream.hold(init_info.path, init_info.version)

        def start_weight_update(self) -> None:
            pass  # the model changes only in ``apply``, while the replica has the engine paused

        def finish_weight_update(self) -> None:
            pass

        def receive_weights(self, u: UpdateInfo) -> None:
            if u.phase == "stage":
                # Every worker of the replica is a rank of the chain, in vLLM's own order: each receives
                # the whole update and vLLM's weight loaders take its shard of each tensor.
                from vllm.distributed.parallel_state import get_world_group

                rank = u.rank + get_world_group().rank_in_group
                self.stream.stage(msgspec.msgpack.decode(u.manifest, type=Manifest), u.master, u.port, rank,
                                  u.world, own_host(u.master), u.timeout_s)
            elif u.phase == "apply":
                self.stream.apply(self.model, self.model_config)
            elif u.phase == "discard":
                self.stream.discard()
            else:
                raise ValueError(f"unknown phase {u.phase!r}; valid: stage, apply, discard")

        def shutdown(self) -> None:
            self.stream.discard()

    WeightTransferEngineFactory.register_engine(BACKEND, GlooStreamEngine)


def _unniced() -> None:
    """The calling thread back at the default priority where the system allows it: a CPU engine's
    processes run niced (``engine.cpu_engine_nice``), and the receive thread would otherwise queue
    behind the engine's own busy threads while the link waits."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 0)
    except (PermissionError, OSError):
        pass  # not allowed (no CAP_SYS_NICE): it receives at the process's priority


class Receiver:
    """One worker's side of streamed updates: the bits of the weights it holds (its own arrays, changed
    in place), and one staging buffer, reused (a fresh one per update would fault every page in again)."""

    def __init__(self) -> None:
        self.version = -1
        self.state: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, str] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.status: dict[str, Any] = {"state": "idle"}
        self._staging = np.empty(0, np.uint8)
        self._staged: tuple[Manifest, Parts] | None = None
        self._settling: threading.Thread | None = None

    def hold(self, path: str, version: int) -> None:
        """The engine holds checkpoint ``path`` as ``version`` (a start, a restart, a checkpoint load)."""
        self._settled()
        tensors = read_checkpoint(path)
        self.state = {k: v for k, (v, _) in tensors.items()}
        self.dtypes = {k: d for k, (_, d) in tensors.items()}
        self.version = version
        self.discard()

    def stage(self, manifest: Manifest, master: str, port: int, rank: int, world: int, host: str,
              timeout_s: float) -> None:
        """Receive ``manifest``'s payload as rank ``rank`` of the chain, in a thread (``status`` says how
        it went); ``host``: this worker's address for the chain."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("an update is already being staged")
        self._settled()
        self.discard()
        self.status = {"state": "staging", "version": manifest.version, "received": 0, "total": manifest.total}
        if self._staging.size < manifest.total:
            self._staging = np.empty(manifest.total, np.uint8)
        staging = self._staging[:manifest.total]

        def run() -> None:
            try:
                _unniced()
                link = Link(master, port, rank, world, timeout_s, host=host)
                link.receive(manifest, staging, lambda done: self.status.__setitem__("received", done))
                link.close()
                parts = split(manifest, staging, self.version, {k: v.size for k, v in self.state.items()})
                with self._lock:
                    self._staged = (manifest, parts)
                    self.status = {**self.status, "state": "staged"}
            except Exception as exc:  # noqa: BLE001 - reported through the status, the model untouched
                logger.warning("staging version %d failed: %s", manifest.version, exc)
                self.status = {**self.status, "state": "failed", "error": f"{type(exc).__name__}: {exc}"}

        self._thread = threading.Thread(target=run, name=f"stage-v{manifest.version}", daemon=True)
        self._thread.start()

    def discard(self) -> None:
        with self._lock:
            self._staged = None
            if self.status.get("state") in ("staged", "failed", "staging"):
                self.status = {"state": "idle"}

    def _load(self, model: Any, model_config: Any, tensors: dict[str, np.ndarray], dtypes: dict[str, str]) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        def named() -> Any:
            for name, b in tensors.items():
                yield name, to_torch(b, dtypes[name])

        initialize_layerwise_reload(model)
        try:
            model.load_weights(named())
        finally:
            finalize_layerwise_reload(model, model_config)

    def apply(self, model: Any, model_config: Any) -> None:
        """Load what was staged (the engine is paused): deltas patched into the held bits in place (their
        old values kept), dense tensors from the staging buffer, then copied into the held bits. On an
        error, the old values go back and the held weights are loaded again."""
        with self._lock:
            staged = self._staged
        if staged is None:
            raise RuntimeError(f"nothing staged to apply (status: {self.status})")
        manifest, parts = staged
        dtypes = {**self.dtypes, **{t.name: t.dtype for t in manifest.tensors}}
        saved: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        try:
            for name, (idx, values) in parts.deltas.items():
                flat = self.state[name].reshape(-1)
                saved[name] = (idx, flat[idx].copy())
                flat[idx] = values
            self._load(model, model_config, {t.name: parts.dense.get(t.name, self.state.get(t.name))
                                             for t in manifest.tensors}, dtypes)
        except BaseException as exc:
            logger.exception("applying version %d failed: putting version %d back", manifest.version, self.version)
            self.status = {"state": "broken", "error": f"{type(exc).__name__}: {exc}"}
            for name, (idx, old) in saved.items():
                self.state[name].reshape(-1)[idx] = old
            self._load(model, model_config, self.state, self.dtypes)
            self.status = {"state": "rolled_back", "error": f"{type(exc).__name__}: {exc}", "version": self.version}
            self.discard()
            raise
        self.dtypes = dtypes
        self.version = manifest.version
        self.discard()
        self.status = {"state": "idle", "version": self.version}
        if parts.dense:  # the held bits catch up off the pause; the next stage waits for them
            self._settling = threading.Thread(target=self._settle, args=(parts.dense,), name="settle", daemon=True)
            self._settling.start()

    def _settle(self, dense: dict[str, np.ndarray]) -> None:
        """Copy the dense tensors just applied from the staging buffer into the held bits (the staging
        buffer is the next update's)."""
        for name, new in dense.items():
            held = self.state.get(name)
            if held is not None and held.shape == new.shape and held.dtype == new.dtype:
                np.copyto(held, new)
            else:
                self.state[name] = new.copy()

    def _settled(self) -> None:
        if self._settling is not None:
            self._settling.join()
            self._settling = None


class StreamWorker:
    """vLLM's ``worker_extension_cls``: methods ``collective_rpc`` can call on every worker."""

    def toolkit_stream_status(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "stream"):
            return {"state": "unavailable", "error": f"weight_transfer_config.backend is not {BACKEND}"}
        return dict(engine.stream.status, held=engine.stream.version)


# ---- the replica's side (its AsyncLLM) --------------------------------------------------------------
def enabled(args: dict[str, Any]) -> bool:
    """Whether engine arguments ``args`` select this backend."""
    wt = args.get("weight_transfer_config") or {}
    return isinstance(wt, dict) and wt.get("backend") == BACKEND


async def hold(llm: Any, path: str, version: int) -> None:
    """Tell the workers which checkpoint the engine holds (after a start, a restart, a checkpoint load)."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    await llm.init_weight_transfer_engine(WeightTransferInitRequest({"path": path, "version": version}))


async def status(llm: Any) -> dict[str, Any]:
    """The workers' states as one: the first failure, else staging until every worker staged."""
    states = await llm.collective_rpc("toolkit_stream_status")
    for want in ("unavailable", "failed", "broken", "rolled_back", "staging"):
        if any(st.get("state") == want for st in states):
            out = next(st for st in states if st.get("state") == want)
            if want == "rolled_back" and not all(st.get("state") == "rolled_back" for st in states):
                return {**out, "state": "broken", "error": f"some workers rolled back, others did not: {states}"}
            return out
    return states[0]


async def stage(llm: Any, plan: StreamWeights, poll_s: float = 0.02) -> None:
    """Receive the update into the workers' staging buffers while the engine serves; raise if it fails
    (the engine's weights untouched)."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    info = {"phase": "stage", "manifest": plan.manifest, "master": plan.master, "port": plan.port,
            "rank": plan.rank, "world": plan.world, "timeout_s": plan.timeout_s}
    await llm.start_weight_update()
    try:
        await llm.update_weights(WeightTransferUpdateRequest(info))
        while (st := await status(llm))["state"] == "staging":
            await asyncio.sleep(poll_s)
        if st["state"] != "staged":
            raise RuntimeError(f"staging version {plan.version} failed: {st.get('error') or st}")
    except BaseException:
        await discard(llm)
        raise


async def discard(llm: Any) -> None:
    """Drop a staged update and end vLLM's weight-update session (the engine serves on, unchanged)."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    await llm.update_weights(WeightTransferUpdateRequest({"phase": "discard"}))
    await llm.finish_weight_update()


def own_host(master: str) -> str:
    """This node's address on the chain: loopback when the trainer is (one host), else its hostname's."""
    return master if master.startswith("127.") or master == "localhost" else socket.gethostbyname(socket.gethostname())


async def apply(llm: Any, version: int) -> None:
    """Put the staged update in (call with the engine paused) and label later outputs ``version``. If
    it fails, the workers have put the previous weights back."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    await llm.update_weights(WeightTransferUpdateRequest({"phase": "apply"}))  # an error ends the session
    await llm.finish_weight_update(weight_version=str(version))
