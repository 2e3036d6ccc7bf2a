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

__all__ = ["MARKER", "CheckpointExists", "WeightsTimeout", "checkpoint_dir", "latest", "publish", "published",
           "versions", "wait_for_version"]
