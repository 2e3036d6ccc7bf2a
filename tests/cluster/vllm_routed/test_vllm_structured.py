"""Structured outputs on real vLLM (the CPU build) through a router and one replica, on the tiny model:
a JSON schema and a choice constrain the decoded output; a bad schema is a ``client_error`` and the
engine goes on. Fixtures: tests/cluster/conftest.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.helpers.aio import with_client
from tests.helpers.vllm import gen
from toolkit.client import RouterClient
from toolkit.core import protocol as P
from toolkit.launch.stack import LocalStack

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
        "required": ["city", "days"], "additionalProperties": False}


def sgen(rid: str, structured: P.Structured, **kw: Any) -> P.Generate:
    req = gen(rid, max_tokens=kw.pop("max_tokens", 200), **kw)
    return msgspec.structs.replace(req, sampling=msgspec.structs.replace(req.sampling, structured=structured))


@pytest.fixture(scope="module")
def decode(models: dict[str, Path]) -> Any:  # noqa: F811
    """The tiny model's own tokenizer, special tokens (the end-of-sequence token) left out."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models["tiny"]))
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def test_json_schema_and_choice_constrain_the_output_and_a_bad_schema_is_a_client_error(
        routed: LocalStack, decode: Any) -> None:  # noqa: F811
    import jsonschema  # a vLLM dependency

    async def body(c: RouterClient) -> None:
        city = P.Structured(json_schema=json.dumps(CITY))
        outs = await asyncio.gather(*(c.generate(sgen(f"js{i}", city, seed=i)) for i in range(4)))
        for res, _ in outs:
            assert res.status == "ok" and res.finish_reason == "stop", res
            assert len(res.logprobs) == len(res.output_token_ids)
            value = json.loads(decode(res.output_token_ids))
            jsonschema.validate(value, CITY)

        choices = ["yes", "no", "maybe"]
        picked = await asyncio.gather(*(c.generate(sgen(f"ch{i}", P.Structured(choice=choices), seed=i))
                                        for i in range(3)))
        for res, _ in picked:
            assert res.status == "ok" and res.finish_reason == "stop"
            assert decode(res.output_token_ids) in choices

        for rid, bad, words in [("bad1", P.Structured(json_schema='{"type": "nonsense"}'), "nonsense"),
                                ("bad2", P.Structured(json_schema="{nope"), "not JSON"),
                                ("bad3", P.Structured(json_schema='{"$ref": "#/missing"}'), "missing"),
                                ("bad4", P.Structured(), "exactly one")]:
            res, route = await c.generate(sgen(rid, bad))
            assert res.status == "client_error" and words in res.error, res
            assert route is not None and route.dispatches == 1  # not retried elsewhere
        after, _ = await c.generate(sgen("after", city, seed=0))
        assert after.status == "ok" and json.loads(decode(after.output_token_ids))["city"] in ("Paris", "Rome")
        plain, _ = await c.generate(gen("plain"))
        assert plain.status == "ok"

    asyncio.run(with_client(routed.run_dir, body, 120))


def test_the_mapping_to_vllm_structured_outputs() -> None:
    from toolkit.engine.vllm import _vllm, structured_outputs

    v = _vllm()
    assert structured_outputs(v, None) is None
    js = structured_outputs(v, P.Structured(json_schema=json.dumps(CITY)))
    assert isinstance(js, v.StructuredOutputsParams) and json.loads(js.json) == CITY and js.choice is None
    ch = structured_outputs(v, P.Structured(choice=["a", "b"]))
    assert ch.choice == ["a", "b"] and ch.json is None
    for bad, words in [(P.Structured(), "exactly one"), (P.Structured(json_schema="[", choice=["a"]), "exactly one"),
                       (P.Structured(json_schema="{nope"), "not JSON")]:
        with pytest.raises(ValueError, match=words):
            structured_outputs(v, bad)
