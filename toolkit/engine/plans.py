"""What a sim engine answers a request: its tokens, logprobs and finish reason, a pure function of the
request (:func:`plan_output`), drawn from a generator seeded by the prompt, so a request gets the same
ones in every process, on any replica and after a move. Output lengths are lognormal, correlated within
a session and between a prompt's siblings as configured (docs/engines.md#the-sim-engine)."""

from __future__ import annotations

import functools
import math
from typing import Any

import msgspec
import numpy as np

from toolkit.config import SimEngineConfig
from toolkit.core.draws import POOL, id_window, seeded, window
from toolkit.core.errors import ToolkitError
from toolkit.core.protocol import Generate, Sampling, Structured
from toolkit.engine.structured import instance_text
from toolkit.model.tokenizer import Tokenizer


@functools.lru_cache(maxsize=1)
def _logprob_pool() -> list[float]:
    """:data:`POOL` logprobs: minus an exponential with mean 0.7, float32 values as an engine's are, from a
    fixed seed, their objects together as :func:`~toolkit.core.draws.id_pool`'s."""
    return (-np.random.Generator(np.random.PCG64(0x10C9)).exponential(0.7, size=POOL)).astype(np.float32).tolist()


def draw_output(rng: np.random.Generator, vocab_size: int, n: int) -> tuple[list[int], list[float]]:
    """``n`` tokens and their logprobs from one draw of ``rng`` (:func:`~toolkit.core.draws.id_window`; the
    logprobs from the same place of their pool). Two outputs start alike 1 in ``POOL * (vocab_size - 1) ** 2``:
    siblings of one prompt sample apart, and no two share a cached block. Both lists hold the pools'
    objects: a twin holds millions of tokens (a new int per token, ``ndarray.tolist``: 1.32 GB at the peak
    of a 16,384-session step, against 0.99)."""
    if n <= 0:
        return [], []
    tokens, start = id_window(rng, vocab_size, n)
    return tokens, window(_logprob_pool(), start, n)


def sampling_error(s: Sampling) -> str:
    """Why vLLM refuses these sampling parameters (``SamplingParams``' own checks), or "": the sim refuses
    what vLLM refuses, so that what passes on it passes on vLLM."""
    if s.max_tokens < 1:
        return f"max_tokens must be at least 1, got {s.max_tokens}"
    if not math.isfinite(s.temperature) or s.temperature < 0:
        return f"temperature must be a finite number >= 0, got {s.temperature}"
    if not 0 < s.top_p <= 1:
        return f"top_p must be in (0, 1], got {s.top_p}"
    if s.n < 1:
        return f"n must be at least 1, got {s.n}"
    if s.n > 1 and s.temperature == 0:
        return f"n must be 1 when using greedy sampling, got {s.n}"
    return ""


def output_len(cfg: SimEngineConfig, z: Any) -> Any:
    """The output length(s), before any cut, for standard normal draw(s) ``z`` (a float or an array):
    lognormal with median ``output_len_median`` and sigma ``output_len_sigma``, at least one token."""
    if isinstance(z, float):
        return max(1, math.ceil(cfg.output_len_median * math.exp(cfg.output_len_sigma * z)))
    return np.maximum(1, np.ceil(cfg.output_len_median * np.exp(cfg.output_len_sigma * np.asarray(z))))


def plan_output(cfg: SimEngineConfig, req: Generate,
                tokenizer: Tokenizer | None = None) -> tuple[list[int], list[float], str]:
    """The tokens, logprobs and finish reason this request will get: a pure function of the request.

    A request that moved (``resumed_tokens``) gets the rest of what it was planned to say where it
    started: the same total length and tokens, so moving it changes where it runs, not what it is.
    A structured request needs ``tokenizer`` (``engine.tokenizer``); ToolkitError for one it cannot serve.
    """
    k = req.resumed_tokens
    if k > 0:
        origin = msgspec.structs.replace(
            req, prompt_token_ids=req.prompt_token_ids[:-k], resumed_tokens=0,
            sampling=msgspec.structs.replace(req.sampling, max_tokens=req.sampling.max_tokens + k))
        tokens, logprobs, finish = plan_output(cfg, origin, tokenizer)
        return tokens[k:], logprobs[k:], finish
    prompt = req.prompt_token_ids
    # Greedy decoding does not read the seed (vLLM's outputs at temperature 0 are the same for every seed).
    seed = b"greedy" if req.sampling.temperature == 0 else str(req.sampling.seed).encode()
    share, pshare = cfg.output_len_session_share, cfg.output_len_prompt_share
    correlated = (share > 0 or pshare > 0) and req.session_id and req.sampling.structured is None
    if correlated:  # drawn first: the request's own generator below is the same one, seeded again
        shared = float(seeded(0, req.session_id.encode(), seed).standard_normal())
        of_prompt = float(seeded(0, b"prompt", (req.prompt_key or req.session_id).encode(), seed).standard_normal())
    # The prompt by Python's hash of its tuple: the same in every process (no hash seed enters ints and
    # tuples of them; core/blocks.py relies on it too), and a quarter of the cost of hashing its bytes.
    material = [seed]
    if req.sampling.seed is None and req.sampling.temperature > 0 and req.prompt_key:
        material.append(req.session_id.encode())  # siblings sample apart (the same prompt, other sessions)
    rng = seeded(hash(tuple(prompt)), *material)
    budget = max(0, min(req.sampling.max_tokens, cfg.max_model_len - len(prompt)))
    if req.sampling.structured is not None:
        return _plan_structured(cfg, req.sampling.structured, tokenizer, rng, budget)
    z = float(rng.standard_normal())
    if correlated:
        z = (math.sqrt(pshare) * of_prompt + math.sqrt(share) * shared
             + math.sqrt(max(0.0, 1 - share - pshare)) * z)
    natural = int(output_len(cfg, z))
    n = min(natural, budget)
    finish = "stop" if natural <= budget else "length"
    tokens, logprobs = draw_output(rng, cfg.vocab_size, n)
    return tokens, logprobs, finish


PLAN_FIELDS = ("max_model_len", "vocab_size", "output_len_median", "output_len_sigma", "output_len_session_share",
               "output_len_prompt_share")
"""The engine settings :func:`plan_output` reads: engines that agree on them plan every request alike."""


def _plan_structured(cfg: SimEngineConfig, structured: Structured, tokenizer: Tokenizer | None,
                     rng: np.random.Generator, budget: int) -> tuple[list[int], list[float], str]:
    """The encoded instance, cut at ``budget``; its logprobs are drawn for the whole of it, so a cut
    (or a continuation elsewhere) keeps the same prefix."""
    if tokenizer is None:
        raise ToolkitError("a structured request (sampling.structured) needs a tokenizer on a sim engine: "
                           "set engine.tokenizer (as workload.tokenizer)")
    tokens = list(tokenizer.encode(instance_text(structured, rng)))
    if tokens and (min(tokens) < 0 or max(tokens) >= cfg.vocab_size):
        raise ToolkitError(f"engine.tokenizer encodes the structured output with token ids outside "
                           f"engine.vocab_size {cfg.vocab_size} (ids {min(tokens)}..{max(tokens)})")
    logprobs = draw_output(rng, cfg.vocab_size, len(tokens))[1]
    finish = "stop" if len(tokens) <= budget else "length"
    return tokens[:budget], logprobs[:budget], finish
