"""The cluster tests that share one router and one vLLM replica of the tiny model (``routed``, made
once for this package and stopped when its last test ends, before the next vLLM test starts one)."""
