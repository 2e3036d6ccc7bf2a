"""The one factory of ``Generate`` requests for tests."""

from __future__ import annotations

from typing import Any

from toolkit.core.protocol import Generate, Sampling

_SAMPLING = ("temperature", "top_p", "seed", "logprobs", "n", "ignore_eos", "structured")


def gen(rid: str, prompt: list[int] | None = None, max_tokens: int = 32, *, step: int = 0, session: str | None = None,
        group: str | None = None, job: str = "j", **kw: Any) -> Generate:
    """A request ``rid`` of session ``session`` (default: ``rid``) at ``step``; the prompt defaults to
    ``[5, 6, 7, len(rid)]``. Sampling fields (``seed``, ``temperature``...) go to ``Sampling``, any other
    keyword (``deadline``, ``lora``...) to ``Generate``."""
    sampling = {k: kw.pop(k) for k in _SAMPLING if k in kw}
    return Generate(rid, job=job, session_id=rid if session is None else session, step=step,
                    prompt_token_ids=list(prompt) if prompt is not None else [5, 6, 7, len(rid)],
                    sampling=Sampling(max_tokens=max_tokens, **sampling), group=group, **kw)
