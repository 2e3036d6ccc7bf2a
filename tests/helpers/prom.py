"""Prometheus samples in tests: the sum of a metric's samples whose labels match."""

from __future__ import annotations


def value(metrics: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return sum(v for lab, v in metrics.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))
