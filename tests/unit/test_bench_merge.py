"""The merge benchmark's records merge into the session they describe (its runs: tests/integration)."""

from __future__ import annotations

from toolkit.bench.merge import TURNS, merge_records, session_records


def test_records_merge_into_the_session_they_describe() -> None:
    recs = session_records(7)
    assert len(recs) == TURNS
    s = merge_records(recs)
    s.check()
    last = recs[-1]
    assert s.tokens == last["prompt_token_ids"] + last["output_token_ids"]
    assert s.generated_tokens == sum(len(r["output_token_ids"]) for r in recs)
    assert session_records(7) == recs  # deterministic per session
