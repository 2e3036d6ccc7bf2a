"""Setup checks of the ``sim`` engine beyond its fields' declared bounds (``SimEngineConfig``)."""

from __future__ import annotations

from toolkit.config import SimEngineConfig
from toolkit.core.errors import FieldError
from toolkit.model.tokenizer import tokenizer_problem


def check(e: SimEngineConfig, prefix: str, fields: set[str]) -> list[FieldError]:
    """``e`` is ``engine`` or a group's version of it (``prefix``); only ``fields`` are its own to report."""
    errors = []
    share = 1 - e.output_len_session_share
    prompt = e.output_len_prompt_share
    # The two shares of the log-length variance add up to at most 1 (each one's bounds are declared).
    if "output_len_prompt_share" in fields and 0 <= prompt <= 1 and prompt > share:
        errors.append(FieldError(f"{prefix}.output_len_prompt_share", prompt,
                                 f"in [0, 1 - output_len_session_share = {share:g}]"))
    if "tokenizer" in fields and (why := tokenizer_problem(e.tokenizer)) is not None:
        errors.append(FieldError(f"{prefix}.tokenizer", e.tokenizer, why))
    return errors
