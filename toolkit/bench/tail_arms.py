"""The tail bench's workload size and arms: each arm's tail settings, shared by the bench (``tail``) and
its fleet model (``tail_model``)."""

from __future__ import annotations

THRESHOLD = 0.95
"""The count flip's threshold in the arms that flip."""
SESSIONS = 128
"""Sessions per step of the main workload."""
TRADE_MARGIN = 200
"""``age+trade+kv``: tokens of expected work by which a long runner must outrank a tail resident to trade."""

# Moves recompute and nothing trades unless an arm says otherwise (the default fleet's YAML turns both on).
_RECOMPUTE = ("tail.move=recompute", "tail.trade_margin=null")
ARMS: dict[str, tuple[str, ...]] = {
    "off": ("tail.policy=count", "tail.threshold=null", *_RECOMPUTE),
    "steer": ("tail.policy=count", f"tail.threshold={THRESHOLD}", "tail.migrate_inflight=false", *_RECOMPUTE),
    "migrate": ("tail.policy=count", f"tail.threshold={THRESHOLD}", "tail.migrate_inflight=true", *_RECOMPUTE),
    "age": ("tail.policy=age", "tail.threshold=null", "tail.migrate_inflight=false", *_RECOMPUTE),
    "predict": ("tail.policy=predict", "tail.threshold=null", "tail.migrate_inflight=false", *_RECOMPUTE),
    "age+count": ("tail.policy=age", f"tail.threshold={THRESHOLD}", "tail.migrate_inflight=true", *_RECOMPUTE),
    "age+kv": ("tail.policy=age", "tail.threshold=null", "tail.migrate_inflight=false", "tail.move=kv",
               "tail.trade_margin=null"),
    "age+trade+kv": ("tail.policy=age", "tail.threshold=null", "tail.migrate_inflight=false", "tail.move=kv",
                     f"tail.trade_margin={TRADE_MARGIN}"),
}
"""Each arm's tail settings (the rest of the config is the same in every arm)."""
