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
import socket
from dataclasses import dataclass
from typing import Any

import msgspec

from toolkit.core.protocol import StreamWeights
from toolkit.engine.vllm_receiver import Place, Receiver
from toolkit.weights.wire import Manifest

logger = logging.getLogger(__name__)

BACKEND = "toolkit_gloo"
EXTENSION = "toolkit.engine.vllm_transfer.StreamWorker"
"""``worker_extension_cls``: adds ``toolkit_stream_status`` to vLLM's workers."""
STREAM_ARGS = {"weight_transfer_config": {"backend": BACKEND}, "worker_extension_cls": EXTENSION}
"""The engine arguments that select this backend (``rollout.weights_transport=stream``)."""


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
        prev: int = 0

    class GlooStreamEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            super().__init__(config, vllm_config, device, model)
            self.stream = Receiver()

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            self.stream.hold(init_info.path, init_info.version, self.model)

        def start_weight_update(self) -> None:
            pass  # the model changes only in ``apply``, while the replica has the engine paused

        def finish_weight_update(self) -> None:
            pass

        def receive_weights(self, u: UpdateInfo) -> None:
            if u.phase == "stage":
                # The replica's workers take consecutive ranks of the chain, in vLLM's own order: the
                # first receives the whole update and passes each other worker its share.
                from vllm.distributed.parallel_state import get_world_group

                group = get_world_group()
                self.stream.stage(msgspec.msgpack.decode(u.manifest, type=Manifest), u.master, u.port,
                                  Place(u.rank, group.rank_in_group, group.world_size, u.prev, u.world),
                                  own_host(u.master), u.timeout_s)
            elif u.phase == "apply":
                self.stream.apply(self.model, self.model_config)
            elif u.phase == "discard":
                self.stream.discard()
            else:
                raise ValueError(f"unknown phase {u.phase!r}; valid: stage, apply, discard")

        def shutdown(self) -> None:
            self.stream.discard()

    WeightTransferEngineFactory.register_engine(BACKEND, GlooStreamEngine)


class StreamWorker:
    """vLLM's ``worker_extension_cls``: methods ``collective_rpc`` can call on every worker."""

    def toolkit_stream_status(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "stream"):
            return {"state": "unavailable", "error": f"weight_transfer_config.backend is not {BACKEND}"}
        return dict(engine.stream.status, held=engine.stream.version, held_bytes=engine.stream.held_bytes)


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
    return merged(await llm.collective_rpc("toolkit_stream_status"))


def merged(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Workers' states (``toolkit_stream_status``) as one, as :func:`status` gives it."""
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
            "rank": plan.rank, "world": plan.world, "timeout_s": plan.timeout_s, "prev": plan.prev}
    await llm.start_weight_update()
    try:
        await llm.update_weights(WeightTransferUpdateRequest(info))
        while (st := merged(states := await llm.collective_rpc("toolkit_stream_status")))["state"] == "staging":
            await asyncio.sleep(poll_s)
        if st["state"] != "staged":
            raise RuntimeError(f"staging version {plan.version} failed: {st.get('error') or st}")
        logger.info("streamed weights version %d staged: its workers kept %s of its %d bytes and hold %s",
                    plan.version, [x.get("kept") for x in states], st.get("total", 0), [x.get("held_bytes") for x in states])
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
