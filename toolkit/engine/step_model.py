"""The sim engine's time model: the seconds of one step from the context it reads and the tokens it
prefills, on a replica of ``tensor_parallel_size`` devices. The sim engine, the twin's engines and the
step report's lower bound all read it; its knobs: docs/engines.md#the-sim-engine."""

from __future__ import annotations

from toolkit.config import SimEngineConfig


def tp_speedup(c: SimEngineConfig) -> float:
    """How much faster than one device a replica reads its weights and KV (``tensor_parallel_size``)."""
    return 1 + (c.tensor_parallel_size - 1) * c.tp_efficiency


def step_seconds(c: SimEngineConfig, context_tokens: float, prefill_tokens: float = 0) -> float:
    """Modelled seconds of one engine step (before ``time_scale``): weights and KV read, then prefill. Also the
    step report's lower bound (``toolkit/rollout/bound.py``) reads it."""
    speedup = tp_speedup(c)
    read = c.weight_bytes + context_tokens * c.kv_bytes_per_token
    return c.step_overhead_s + read / (c.hbm_bandwidth * speedup) + prefill_tokens / (c.prefill_tokens_per_s * speedup)
