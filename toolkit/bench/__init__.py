"""Benchmarks: ``python -m toolkit.bench NAME --json PATH``.

Each benchmark measures the toolkit against a baseline *in the same run* and writes one JSON object
with the fields its issue names. Benchmarks are not tests: nothing asserts on their timings.
Every benchmark's method, fields and results: docs/benchmarks.md.
"""

from __future__ import annotations

BENCHMARKS = {
    "router": "toolkit.bench.router",
    "fairness": "toolkit.bench.fairness",
    "vllm": "toolkit.bench.vllm",
    "merge": "toolkit.bench.merge",
    "tail": "toolkit.bench.tail",
    "tail_model": "toolkit.bench.tail_model",
    "gateway": "toolkit.bench.gateway",
    "loop": "toolkit.bench.loop",
    "partial": "toolkit.bench.partial",
    "weights": "toolkit.bench.weights",
    "twin": "toolkit.bench.twin",
    "kv": "toolkit.bench.kv",
}
