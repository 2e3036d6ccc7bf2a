"""LoRA adapters per request for the ``vllm`` backend. A missing adapter inside an engine step kills
vLLM's engine, so a request's adapter directory is checked on the file system first
(``adapter_config.json``, with a directory listing on a miss for NFS's cached failed lookups), then
added with ``add_lora``, which fails without harm; a request whose adapter is not there waits, and fails
as ``adapter_missing`` only just before its deadline."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from toolkit.config import VllmEngineConfig
from toolkit.core.protocol import Generate, Result

logger = logging.getLogger(__name__)


def adapter_present(path: str) -> bool:
    """``adapter_config.json`` is in ``path``. On a miss, list the directory (or its parent, if the
    directory itself is not there) and look again: an NFS client caches a failed lookup until then."""
    config = os.path.join(path, "adapter_config.json")
    if os.path.exists(config):
        return True
    for d in (path, os.path.dirname(os.path.normpath(path))):
        try:
            os.listdir(d)
            break
        except OSError:
            continue
    return os.path.exists(config)


class Adapters:
    """The adapters of one engine: a stable id per adapter path, the ids the engine has, and the
    requests waiting for one."""

    def __init__(self, cfg: VllmEngineConfig, request_cls: Any) -> None:
        self.cfg = cfg
        self.request_cls = request_cls
        """vLLM's ``LoRARequest``."""
        self.ids: dict[str, int] = {}
        self.added: set[int] = set()
        self.lock = asyncio.Lock()
        self.waits: dict[str, asyncio.Event] = {}

    def forget_loaded(self) -> None:
        """The engine lost its adapters (restart, weight reload): ``add_lora`` validates them again."""
        self.added.clear()

    def cancel(self, request_id: str) -> bool:
        """Wake a request waiting for its adapter (an abort); False if it is not waiting."""
        ev = self.waits.get(request_id)
        if ev is None:
            return False
        ev.set()
        return True

    def cancel_all(self) -> None:
        for ev in self.waits.values():
            ev.set()

    async def get(self, llm: Any, req: Generate) -> Any:
        """The LoRARequest of ``req.lora`` once its directory holds an adapter that the engine took;
        a Result if it never does (``adapter_missing``) or the request is aborted while it waits."""
        rid, path = req.request_id, req.lora
        assert path is not None
        give_up = (req.deadline - self.cfg.adapter_margin_s) if req.deadline else time.time() + self.cfg.adapter_wait_s
        cancel = self.waits[rid] = asyncio.Event()
        why, logged = "no adapter_config.json", False
        try:
            while True:
                if llm is None or llm.errored:
                    return Result(request_id=rid, status="engine_dead", error="the engine died")
                # File system calls can block for seconds on a shared file system: off the loop.
                if await asyncio.to_thread(adapter_present, path):
                    lora, why = await self._add(llm, path)
                    if cancel.is_set():  # aborted while it looked or loaded: the request does not run
                        break
                    if lora is not None:
                        return lora
                elif cancel.is_set():
                    break
                left = give_up - time.time()
                if left <= 0:
                    return Result(request_id=rid, status="adapter_missing", error=f"adapter {path}: {why}")
                if not logged:
                    logger.info("request %s waits for adapter %s (%s)", rid, path, why)
                    logged = True
                try:
                    await asyncio.wait_for(cancel.wait(), min(self.cfg.adapter_poll_s, left))
                    break
                except asyncio.TimeoutError:
                    pass
        finally:
            self.waits.pop(rid, None)
        return Result(request_id=rid, status="cancelled", finish_reason="abort",
                      error=f"aborted while waiting for adapter {path}")

    async def _add(self, llm: Any, path: str) -> tuple[Any, str]:
        lora_id = self.ids.setdefault(path, len(self.ids) + 1)
        lora = self.request_cls(f"adapter-{lora_id}", lora_id, path)
        async with self.lock:
            if lora_id in self.added:
                return lora, ""
            try:
                # Loads and validates it in the workers; unlike a request, a failure here leaves the engine up.
                await llm.add_lora(lora)
            except Exception as exc:
                logger.warning("adapter %s not loadable yet: %s", path, exc)
                return None, f"not loadable: {exc}"
            self.added.add(lora_id)
        return lora, ""
