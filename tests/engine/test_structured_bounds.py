"""What a structured-output constraint may be (engine/text/structured.py's bounds): over a
bound is an InvalidRequestError naming it, before anything is compiled; constraints
people write pass."""
import json

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.text.structured import (MAX_ALTERNATIVES, MAX_OBJECT_PROPERTIES, MAX_REPEAT,
                               MAX_SCHEMA_PROPERTIES, MAX_SPEC_CHARS, MAX_SPEC_DEPTH,
                               ConstraintTooComplex, check_spec, grammar_of)


def nested(levels: int) -> dict:
    """An object in an object... `levels` deep (two JSON levels each)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def flat(n: int, prefix: str = "p") -> dict:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"}
                                             for i in range(n)}}


ACCEPTED = [
    {"json": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "maxLength": 64, "pattern": "^[A-Z][a-z]{1,20}$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 10}}}},
    {"json": nested(MAX_SPEC_DEPTH // 2 - 1)},
    {"json": flat(MAX_OBJECT_PROPERTIES)},
    {"json": {"enum": list(range(MAX_ALTERNATIVES))}},
    {"json": {"anyOf": [{"const": i} for i in range(1000)]}},
    {"json": {"type": "string", "maxLength": MAX_REPEAT}},
    {"regex": r"[0-9]{3}-[a-z]{2,%d}" % MAX_REPEAT},
    {"choice": [f"c{i}" for i in range(MAX_ALTERNATIVES)]},
    {"grammar": 'root ::= "a"{2,5}'},
    {"json_object": True},
]


@pytest.mark.parametrize("spec", ACCEPTED, ids=range(len(ACCEPTED)))
def test_constraints_people_write_pass(spec):
    assert check_spec(spec) is spec
    grammar_of(spec)  # and xgrammar takes them


REFUSED = [
    ({"json": nested(400)}, f"nested more than {MAX_SPEC_DEPTH} levels"),
    ({"json": nested(MAX_SPEC_DEPTH // 2 + 1)}, f"nested more than {MAX_SPEC_DEPTH} levels"),
    ({"regex": "x", "json": {}}, "exactly one"),
    ({"json": flat(MAX_OBJECT_PROPERTIES + 1)},
     f"an object with {MAX_OBJECT_PROPERTIES + 1} properties"),
    ({"json": {"type": "object", "properties": {
        f"o{k}": flat(MAX_OBJECT_PROPERTIES, f"o{k}-") for k in range(9)}}},
     f"properties in all (at most {MAX_SCHEMA_PROPERTIES}"),
    ({"json": {"oneOf": [{"enum": list(range(MAX_ALTERNATIVES))}, {"const": 1}]}},
     f"{MAX_ALTERNATIVES + 2} alternatives"),
    ({"choice": ["x"] * (MAX_ALTERNATIVES + 1)}, "alternatives"),
    ({"json": {"type": "array", "minItems": MAX_REPEAT + 1}}, f"`minItems` is {MAX_REPEAT + 1}"),
    ({"json": {"type": "string", "pattern": "a{0,99999}"}}, "counted repetition {0,99999}"),
    ({"regex": "(ab){100000}"}, "counted repetition {100000}"),
    ({"grammar": 'root ::= "a"{1,200000}'}, "counted repetition {1,200000}"),
    ({"regex": "a" * (MAX_SPEC_CHARS + 1)}, f"longer than {MAX_SPEC_CHARS} characters"),
]


@pytest.mark.parametrize("spec, words", REFUSED, ids=range(len(REFUSED)))
def test_constraints_over_a_bound_are_refused_naming_it(spec, words):
    with pytest.raises(InvalidRequestError, match=words.replace("{", r"\{").replace(
            "(", r"\(").replace(")", r"\)")):
        check_spec(spec)
    with pytest.raises(InvalidRequestError):  # at SamplingParams, before any engine
        SamplingParams(structured=spec)


def test_a_json_nested_as_deep_as_the_decoder_allows_is_checked_without_recursion():
    deep = json.loads("[" * 900 + "]" * 900)
    with pytest.raises(ConstraintTooComplex, match="nested more than"):
        check_spec({"json": {"enum": deep}})
