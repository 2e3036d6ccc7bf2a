"""The trainer's side of the weights handshake: published checkpoints (``checkpoint``), and weights
streamed over the network into every replica (``wire``: what goes on the wire; ``transport``: how)."""

from toolkit.weights.checkpoint import (
    MARKER,
    CheckpointExists,
    WeightsTimeout,
    checkpoint_dir,
    latest,
    publish,
    published,
    versions,
    wait_for_version,
)
from toolkit.weights.streamer import Streamer, StreamFailed

__all__ = ["MARKER", "StreamFailed", "Streamer", "CheckpointExists", "WeightsTimeout", "checkpoint_dir", "latest", "publish", "published",
           "versions", "wait_for_version"]
