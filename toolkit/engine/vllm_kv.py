"""vLLM's own KV events, taken into the replica's log as toolkit block hashes.

The engine core publishes them with vLLM's ``ZmqEventPublisher`` (``kv_events_config``) on an ``ipc``
socket of the replica's; a task here subscribes, asks vLLM's replay endpoint for any batch it missed
(its sequence numbers), and maps each stored block onto the toolkit's chain hash from the block's
own token ids and its parent's mapping (``toolkit.core.blocks``). vLLM's hashes depend on its hash
algorithm and ``PYTHONHASHSEED``; the mapping keeps the router free of both, and of vLLM. Blocks of a
LoRA adapter or with extra keys (multimodal, cache salt) are left out: the router's hash of a prompt
does not name them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from toolkit.core.blocks import ROOT, chain_from
from toolkit.engine.kv_events import KvEventLog

logger = logging.getLogger(__name__)

TOPIC = b"kv"
END_SEQ = -1
REPLAY_TIMEOUT_S = 5.0


class VllmKvEvents:
    def __init__(self, log: KvEventLog, ipc_dir: str) -> None:
        """``ipc_dir``: the replica's directory for its engine's ipc sockets (the engine's to remove)."""
        self.log = log
        self.endpoint = f"ipc://{ipc_dir}/pub"
        self.replay_endpoint = f"ipc://{ipc_dir}/replay"
        self.held: dict[Any, int] = {}
        """vLLM block hash -> toolkit block hash, for every block the engine holds."""
        self._next = 0
        """The engine's next batch number."""
        self._ctx = zmq.asyncio.Context()
        self._task: asyncio.Task[None] | None = None
        self._decoder: Any = None

    def config(self, kv_events_config: type) -> Any:
        """vLLM's ``KVEventsConfig`` of the engine: its publisher on this replica's sockets."""
        return kv_events_config(enable_kv_cache_events=True, publisher="zmq", endpoint=self.endpoint,
                                replay_endpoint=self.replay_endpoint, topic=TOPIC.decode())

    def start(self) -> None:
        """Follow the engine's events (a new engine: it numbers its batches from 0 and holds nothing)."""
        from vllm.distributed.kv_events import KVEventBatch  # vLLM is loaded in this replica already

        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.stop()
        if self.held:
            self.held.clear()
            self.log.cleared()
        self._next = 0
        self._task = asyncio.get_running_loop().create_task(self._follow(), name="vllm-kv-events")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def close(self) -> None:
        self.stop()
        self._ctx.destroy(linger=0)

    async def _follow(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(self.endpoint)
        try:
            while True:
                _topic, seq_bytes, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < self._next:
                    continue  # replayed already
                if seq > self._next:
                    await self._replay(seq)
                self._apply(seq, payload)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("vLLM's KV events stopped (the router routes without this replica's index)")
        finally:
            sub.close(linger=0)

    async def _replay(self, upto: int) -> None:
        """Batches ``_next .. upto-1`` from vLLM's replay buffer; what it no longer has is lost, and the
        mapping starts over (the router's index then knows less of this replica, never more)."""
        missed = self._next
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        try:
            await req.send_multipart([b"", missed.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(req.recv_multipart(), REPLAY_TIMEOUT_S)
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ or seq >= upto:
                    break
                if seq == self._next:
                    self._apply(seq, frames[3])
        except (asyncio.TimeoutError, IndexError):
            pass
        finally:
            req.close(linger=0)
        if self._next < upto:
            logger.warning("vLLM's KV events %d..%d are lost; this replica's index starts over", self._next, upto - 1)
            self.held.clear()
            self.log.cleared()
            self._next = upto
        else:
            logger.info("replayed vLLM's KV events %d..%d", missed, upto - 1)

    def _apply(self, seq: int, payload: bytes) -> None:
        self._next = seq + 1
        for ev in self._decoder.decode(payload).events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                self._stored(ev)
            elif kind == "BlockRemoved":
                if getattr(ev, "group_idx", None) not in (None, 0):
                    continue  # another KV-cache group's (a sliding window's): full attention still holds it
                gone = [self.held.pop(h) for h in ev.block_hashes if h in self.held]
                self.log.removed(gone)
            elif kind == "AllBlocksCleared":
                self.held.clear()
                self.log.cleared()

    def _stored(self, ev: Any) -> None:
        if ev.lora_name or ev.lora_id or (ev.extra_keys and any(ev.extra_keys)) or ev.group_idx not in (None, 0):
            return
        if ev.parent_block_hash is None:
            parent = ROOT
        elif ev.parent_block_hash in self.held:
            parent = self.held[ev.parent_block_hash]
        else:
            return  # its parent left (or came before a loss): the chain cannot be named
        hashes = chain_from(parent, ev.token_ids, ev.block_size)
        for h, ours in zip(ev.block_hashes, hashes, strict=False):
            self.held[h] = ours
        self.log.stored(hashes[: len(ev.block_hashes)])
