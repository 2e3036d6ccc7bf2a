"""Requests for the tiny model on real vLLM (tests/cluster)."""

from __future__ import annotations

import functools

from tests.helpers.requests import gen as _gen

PROMPT = [(7 * i) % 500 + 3 for i in range(70)]  # 70 tokens: two full 32-token KV blocks to cache

gen = functools.partial(_gen, prompt=PROMPT, max_tokens=16, job="t")
"""``tests.helpers.requests.gen`` with this prompt, 16 tokens and job ``t`` unless told otherwise."""
