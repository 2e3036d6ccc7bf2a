"""Structured outputs without processes: seeded schema instances (``toolkit/engine/structured.py``) and
the sim engine's structured requests (an encoded instance, ``stop``; cut at the budget, ``length``)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tests.helpers.aio import run
from toolkit.config import SimEngineConfig
from toolkit.core.errors import ToolkitError
from toolkit.core.protocol import Generate, Sampling, Structured
from toolkit.engine.plans import plan_output
from toolkit.engine.sim import SimEngine
from toolkit.engine.structured import instance_text, schema_instance
from toolkit.model.tokenizer import ByteTokenizer

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
        "required": ["city", "days"], "additionalProperties": False}
TREE = {"$defs": {"node": {"type": "object", "required": ["v"], "properties": {
    "v": {"type": "integer", "minimum": -3, "maximum": 3},
    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}},
    "$ref": "#/$defs/node"}
SCHEMAS: dict[str, Any] = {
    "object": {"type": "object", "required": ["a"], "additionalProperties": False,
               "properties": {"a": {"type": "string"}, "b": {"type": "boolean"}, "c": {"type": "null"}}},
    "enum_const": {"type": "object", "required": ["e", "k"],
                   "properties": {"e": {"enum": ["x", 2, None, [1]]}, "k": {"const": {"deep": [1, 2]}}}},
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 10}, {"type": "string", "maxLength": 2}]},
    "oneOf": {"oneOf": [{"type": "boolean"}, {"type": "array", "items": {"type": "null"}}]},
    "oneOf_siblings": {"type": "object", "required": ["kind"],
                       "oneOf": [{"properties": {"kind": {"const": "a"}}}, {"properties": {"kind": {"const": "b"}}}]},
    "array": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "string": {"type": "string", "minLength": 3, "maxLength": 5},
    "integer": {"type": "integer", "minimum": -2, "maximum": 2},
    "integer_exclusive": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3},
    "number": {"type": "number", "minimum": 0.5, "maximum": 0.75},
    "number_exclusive": {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1.001},
    "number_min_only": {"type": "number", "minimum": 1e6},
    "type_list": {"type": ["string", "integer", "null"]},
    "format": {"type": "object", "required": ["t", "d", "u"], "properties": {
        "t": {"type": "string", "format": "date-time"}, "d": {"type": "string", "format": "date"},
        "u": {"type": "string", "format": "uuid"}}},
    "ref_tree": TREE,
    "definitions": {"definitions": {"p": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/definitions/p"}},
    "any": {},
    "true": True,
    "tool_call": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"const": "get_weather"}, "arguments": CITY}},
}


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_instances_are_valid_over_many_seeds(name: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = SCHEMAS[name]
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    seen = set()
    for seed in range(300):
        value = schema_instance(schema, rng(seed))
        errors = list(validator.iter_errors(value))
        assert not errors, (seed, value, errors[0].message)
        assert json.loads(json.dumps(value)) == value  # plain JSON types (no numpy scalars)
        seen.add(json.dumps(value, sort_keys=True))
    if name not in ("enum_const", "format"):
        assert len(seen) > 1, "seeds draw different instances"


def test_instances_cover_the_allowed_range() -> None:
    objs = [schema_instance(SCHEMAS["object"], rng(s)) for s in range(200)]
    assert all("a" in o for o in objs)
    assert 60 < sum("b" in o for o in objs) < 140  # an optional property with p=0.5
    assert {len(schema_instance(SCHEMAS["array"], rng(s))) for s in range(200)} == {2, 3, 4}
    assert {schema_instance(SCHEMAS["integer"], rng(s)) for s in range(200)} == {-2, -1, 0, 1, 2}
    assert {schema_instance(SCHEMAS["integer_exclusive"], rng(s)) for s in range(100)} == {1, 2}
    assert {schema_instance(CITY, rng(s))["city"] for s in range(50)} == {"Paris", "Rome"}
    depths = {json.dumps(schema_instance(TREE, rng(s))).count("[{") for s in range(200)}
    assert max(depths) >= 2  # the recursive schema nests, and ends


def test_draft4_exclusive_flags() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "integer", "minimum": 3, "exclusiveMinimum": True, "maximum": 5, "exclusiveMaximum": True}
    assert {schema_instance(schema, rng(s)) for s in range(50)} == {4}
    jsonschema.Draft4Validator(schema).validate(4)


def test_same_schema_and_seed_same_instance() -> None:
    for schema in SCHEMAS.values():
        assert schema_instance(schema, rng(7)) == schema_instance(schema, rng(7))
    assert instance_text(Structured(json_schema=json.dumps(TREE)), rng(3)) == \
        instance_text(Structured(json_schema=json.dumps(TREE)), rng(3))


@pytest.mark.parametrize(("schema", "words"), [
    ({"type": "string", "pattern": "^a+$"}, "pattern"),
    ({"not": {"type": "null"}}, "not"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
    ({"type": "integer", "multipleOf": 7}, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "minProperties": 2}, "minProperties"),
    ({"type": "string", "format": "hostname"}, "hostname"),
    ({"type": "array", "items": [{"type": "integer"}]}, "items (a list)"),
    # Nested under an optional property that most seeds leave out: refused all the same.
    ({"type": "object", "properties": {"o": {"type": "array", "items": {"type": "string", "pattern": "x"}}}},
     "#/properties/o/items"),
    ({"$ref": "other.json#/a"}, "local"),
    ({"$ref": "#/$defs/missing"}, "does not resolve"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "maxLength"),
    ({"type": "integer", "minimum": 2, "maximum": 1}, "bounds"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "bounds"),
    ({"type": "decimal"}, "decimal"),
    ({"enum": []}, "empty"),
    (False, "false"),
    ({"$defs": {"x": {"type": "object", "required": ["x"], "properties": {"x": {"$ref": "#/$defs/x"}}}},
      "$ref": "#/$defs/x"}, "deeper"),
])
def test_unsupported_or_unsatisfiable_schemas_raise(schema: Any, words: str) -> None:
    for seed in range(5):
        with pytest.raises(ToolkitError, match=words.replace("(", r"\(").replace(")", r"\)")):
            schema_instance(schema, rng(seed))


def test_instance_text() -> None:
    choices = ["yes", "no", "maybe"]
    assert {instance_text(Structured(choice=choices), rng(s)) for s in range(60)} == set(choices)
    text = instance_text(Structured(json_schema=json.dumps(CITY)), rng(1))
    assert json.loads(text) == schema_instance(CITY, rng(1))
    for bad, words in [(Structured(), "exactly one"), (Structured(json_schema="{}", choice=["a"]), "exactly one"),
                       (Structured(json_schema="{nope"), "not JSON"),
                       (Structured(json_schema='{"properties": []}'), "not a usable schema"),
                       (Structured(json_schema='{"type": "object", "required": 5}'), "not a usable schema")]:
        with pytest.raises(ToolkitError, match=words):
            instance_text(bad, rng(0))


# ---- the sim engine -------------------------------------------------------------------------------
def sgen(rid: str, structured: Structured, prompt: list[int] | None = None, max_tokens: int = 256,
         seed: int | None = None) -> Generate:
    return Generate(rid, prompt_token_ids=prompt or [5, 6, 7],
                    sampling=Sampling(max_tokens=max_tokens, seed=seed, structured=structured))


CITY_S = Structured(json_schema=json.dumps(CITY))
TOK = ByteTokenizer()


def test_sim_emits_an_encoded_instance_and_stops() -> None:
    cfg = SimEngineConfig()
    outs = set()
    for i in range(20):
        tokens, logprobs, finish = plan_output(cfg, sgen(f"r{i}", CITY_S, prompt=[i + 1, 2]), TOK)
        value = json.loads(TOK.decode(tokens))
        assert set(value) == {"city", "days"} and value["city"] in ("Paris", "Rome") and value["days"] in (1, 2, 3)
        assert finish == "stop" and len(logprobs) == len(tokens) and all(lp <= 0 for lp in logprobs)
        outs.add(tuple(tokens))
    assert len(outs) > 1  # seeded by the prompt
    again = plan_output(cfg, sgen("x", CITY_S, prompt=[3, 2]), TOK)
    assert again == plan_output(cfg, sgen("y", CITY_S, prompt=[3, 2]), TOK)
    assert again != plan_output(cfg, sgen("z", CITY_S, prompt=[3, 2], seed=5), TOK) or \
        again != plan_output(cfg, sgen("z", CITY_S, prompt=[3, 2], seed=6), TOK)
    tokens, _, finish = plan_output(cfg, sgen("c", Structured(choice=["alpha", "beta"])), TOK)
    assert TOK.decode(tokens) in ("alpha", "beta") and finish == "stop"


def test_sim_cuts_a_structured_output_at_its_budget_and_continues_it() -> None:
    cfg = SimEngineConfig(max_model_len=1000)
    whole, whole_lp, finish = plan_output(cfg, sgen("w", CITY_S), TOK)
    assert finish == "stop" and len(whole) > 12
    cut, cut_lp, finish = plan_output(cfg, sgen("w", CITY_S, max_tokens=10), TOK)
    assert (cut, cut_lp, finish) == (whole[:10], whole_lp[:10], "length")
    # max_model_len is the budget too.
    near, _, finish = plan_output(cfg, sgen("w", CITY_S, prompt=[5] * 995), TOK)
    assert len(near) == 5 and finish == "length"
    # A moved request continues the instance it began.
    k = 9
    cont = Generate("w", prompt_token_ids=[5, 6, 7, *whole[:k]], resumed_tokens=k,
                    sampling=Sampling(max_tokens=256 - k, structured=CITY_S))
    rest, rest_lp, finish = plan_output(cfg, cont, TOK)
    assert whole[:k] + rest == whole and whole_lp[:k] + rest_lp == whole_lp and finish == "stop"


def test_sim_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(ToolkitError, match="engine.tokenizer"):
        plan_output(SimEngineConfig(), sgen("t", CITY_S))
    with pytest.raises(ToolkitError, match="engine.vocab_size 100"):
        plan_output(SimEngineConfig(vocab_size=100), sgen("v", CITY_S), TOK)


def test_sim_engine_structured_requests() -> None:
    async def main() -> None:
        bare = SimEngine(SimEngineConfig(time_scale=0.01))
        await bare.start()
        res = await bare.generate(sgen("a", CITY_S))
        assert res.status == "client_error" and "engine.tokenizer" in res.error
        assert (await bare.generate(Generate("b", prompt_token_ids=[1, 2]))).status == "ok"
        await bare.close()

        spec = {"_target_": "toolkit.model.tokenizer.ByteTokenizer", "offset": 5}
        eng = SimEngine(SimEngineConfig(time_scale=0.01, tokenizer=spec))
        await eng.start()
        res = await eng.generate(sgen("c", CITY_S, seed=3))
        assert res.status == "ok" and res.finish_reason == "stop"
        assert json.loads(TOK.decode(res.output_token_ids))["city"] in ("Paris", "Rome")
        assert len(res.logprobs) == len(res.output_token_ids)
        bad = await eng.generate(sgen("d", Structured(json_schema='{"type": "string", "pattern": "a"}')))
        assert bad.status == "client_error" and "pattern" in bad.error
        assert (await eng.generate(sgen("e", CITY_S, max_tokens=4))).finish_reason == "length"
        await eng.close()

        broken = SimEngine(SimEngineConfig(time_scale=0.01, tokenizer="/nonexistent/tokenizer.json"))
        await broken.start()
        for rid in ("f", "g"):
            res = await broken.generate(sgen(rid, CITY_S))
            assert res.status == "client_error" and "engine.tokenizer" in res.error and "did not load" in res.error
        await broken.close()

    run(main())
