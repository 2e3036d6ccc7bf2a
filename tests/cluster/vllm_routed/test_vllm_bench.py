"""``bench vllm``'s measurement (``--quick``) on the package's routed stack: the router arm through its
replica, the direct arm on an engine of the same config in this process."""

from __future__ import annotations

import pytest

from toolkit.bench.vllm import measure
from toolkit.launch.stack import LocalStack

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_vllm_benchmark_reports_its_fields(routed: LocalStack) -> None:
    r = measure(routed, quick=True)
    assert r["router_tokens_per_s"] > 0 and r["direct_tokens_per_s"] > 0
    assert r["ratio"] == pytest.approx(r["router_tokens_per_s"] / r["direct_tokens_per_s"], rel=0.01)
    assert len(r["router_rounds"]) == len(r["direct_rounds"]) == r["rounds"] == 1
    assert r["requests"] == 32 and r["engine_args"]["enable_lora"] is True  # the stack's own engine config
