"""The engine interface a replica serves: token ids in, token ids and logprobs out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolkit.config.backends import ENGINES
from toolkit.core.errors import ToolkitError
from toolkit.core.protocol import Generate, ReplicaStats, Result, StreamWeights
from toolkit.engine.kv_events import KvEventLog

if TYPE_CHECKING:
    from toolkit.engine.node_role import NodeRole



class EngineGone(ToolkitError):
    """The engine died and will not come back in this process: the replica exits so that the cluster
    backend replaces it."""


@dataclass(frozen=True)
class EngineInfo:
    model: str
    max_model_len: int
    vocab_size: int
    kv_block_size: int = 0
    """Tokens per prefix-cache block, for an engine whose KV events it reports (0: none)."""
    kv_capacity_tokens: int = 0
    """Tokens its KV cache holds (0: unknown)."""


class Engine(ABC):
    """One engine instance. All methods run on the replica's asyncio loop."""

    @abstractmethod
    async def start(self) -> EngineInfo:
        """Bring the engine up; return what the router needs to validate requests."""

    @abstractmethod
    async def generate(self, req: Generate) -> Result:
        """Run one request to completion (or abort); never raises for a bad request, returns a status.
        A backend that knows which weights produced which tokens fills ``Result.weight_versions``; if
        it leaves it empty, the replica fills it from the updates it saw while the request ran."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a running or waiting request; its generate() returns ``cancelled`` with partial output."""

    @abstractmethod
    def stats(self) -> ReplicaStats:
        """Load and prefix-cache counters for the heartbeat (a new object each call: the caller keeps it)."""

    @abstractmethod
    async def close(self) -> None:
        """Release the engine (processes, memory)."""

    shutdown_s: float = 5.0
    """How long a replica of this backend may take to close after SIGTERM before teardown kills it."""

    # ---- weights and deaths: defaults for backends that have neither ------------------------
    weight_version: int = 0
    """Version of the loaded weights (0: the model's own); the replica stamps it on every Result."""

    async def load_weights(self, path: str, version: int) -> None:
        """Load the checkpoint directory ``path`` in place as ``version`` and reset the prefix cache.
        The replica calls this only while no request is in the engine (``rollout.update_mode=drain``,
        or a backend without :meth:`update_weights_in_place`)."""
        raise NotImplementedError(f"the {type(self).__name__} backend cannot load weights")

    async def update_weights_in_place(self, path: str, version: int) -> None:
        """Load ``path`` as ``version`` while requests are in the engine (``rollout.update_mode=pause``):
        pause between engine steps, load, reset the prefix cache, resume the same requests; their later
        tokens come from the new weights and their Results list both versions (``Result.weight_versions``).
        Nothing is aborted. The replica holds new requests at its gate meanwhile and never calls this
        concurrently with itself or ``load_weights``.

        This default: not supported. It raises NotImplementedError before it changes anything, and the
        replica falls back to ``load_weights`` once the engine is idle (``drain``), saying so once."""
        raise NotImplementedError(f"the {type(self).__name__} backend cannot update weights while requests run")

    stream_transport: str = ""
    """How it takes streamed updates (``Register.streams``): ``gloo`` (it joins the update's chain),
    ``model`` (it models the link's time), empty: it cannot."""
    stream_ranks: int = 1
    """Ranks it takes in an update's chain (``Register.stream_ranks``): one per worker that holds weights."""

    async def stage_stream(self, msg: StreamWeights) -> None:
        """Receive streamed update ``msg`` (its place in the chain: ``msg.rank``) into a staging area while
        the engine serves; raise if it fails (a delta against another version than the one it holds
        included), the weights in service untouched and nothing left staged. The replica calls
        :meth:`apply_stream` next, which leaves nothing staged either, applied or not."""
        raise NotImplementedError(f"the {type(self).__name__} backend cannot take streamed weights")

    async def apply_stream(self, version: int) -> None:
        """Put the staged update in as ``version``, requests in the engine pausing between steps as in
        :meth:`update_weights_in_place` (the replica holds new ones at its gate). On an error the engine
        serves on the previous weights (or counts as dead if it could not put them back)."""
        raise NotImplementedError(f"the {type(self).__name__} backend cannot take streamed weights")

    async def discard_stream(self) -> None:
        """Drop what :meth:`stage_stream` staged (the replica gave the update up before applying it)."""
        raise NotImplementedError(f"the {type(self).__name__} backend cannot take streamed weights")

    # ---- KV events: what the prefix cache holds, for the router's index (router.policy=kv_aware) --
    def kv_events(self) -> KvEventLog | None:
        """Start recording the prefix cache's stored and dropped blocks (called before :meth:`start`);
        the log they go to, or None for a backend that cannot report them."""
        return None

    def kv_held(self) -> list[int]:
        """Every block the prefix cache holds now (a snapshot, when the router lost some events)."""
        return []

    def dead(self) -> bool:
        """True once the engine can serve nothing more (its process is gone): time to ``restart``."""
        return False

    async def restart(self) -> EngineInfo:
        """Replace a dead engine by a new one with the same weights; raise EngineGone to give up."""
        raise EngineGone(f"the {type(self).__name__} backend does not restart")

    def pids(self) -> list[int]:
        """Processes the engine started (engine core, workers): recorded so teardown stops them by pid
        even when the replica itself is killed."""
        return []

    on_pids: Callable[[list[int]], None] = staticmethod(lambda pids: None)
    """Called (by a backend that starts processes) with their pids as they appear, a boot included: a
    replica stopped or killed while its engine boots leaves none that teardown does not know."""

    @classmethod
    def serve_node_rank(cls, cfg: Any, role: NodeRole, record_pids: Callable[[list[int]], None]) -> bool:
        """Node rank ``role.rank`` > 0 of a replica wider than a node (``toolkit/engine/nodes.py``): run
        this node's share of the engine (its workers) until the replica ends, and return True; or return
        False at once when the backend has nothing to run there (the node is then only held)."""
        return False


def make_engine(cfg: Any) -> Engine:
    """Build the backend named by ``cfg.type`` from its config."""
    engine = ENGINES.impl(cfg.type)(cfg)
    assert isinstance(engine, Engine)
    return engine
