"""Rollout toolkit: Hydra + submitit launch, a ZeroMQ router for engine groups, MPI rollout ranks."""

__version__ = "0.1.0"
