"""Structured output on the real default model: every constrained answer parses and
validates (json schema, any JSON object, a choice, a regex), greedy or sampled, and a
constraint on one request leaves the others in its batch as they are alone."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.default_model import default_model_dir
from engine.errors import InvalidRequestError

FOLDER = default_model_dir()

pytestmark = pytest.mark.skipif(
    not (FOLDER / "config.json").is_file(),
    reason=f"default model not converted at {FOLDER} (run `make setup`)")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "colour", "ripe"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "colour": {"enum": ["red", "green", "yellow"]},
                         "ripe": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=None, device="cpu", dtype="float32",
                                  attention_backend="torch", num_gpu_blocks=256))


def chat(engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_constrained_answers_parse_and_validate(engine):
    prompt = chat(engine, "Describe an apple as JSON with its name, colour and ripeness.")
    free = SamplingParams(max_tokens=12, temperature=0.0)
    params = [SamplingParams(max_tokens=80, temperature=0.0, structured={"json": SCHEMA}),
              SamplingParams(max_tokens=80, temperature=1.0, seed=5, structured={"json": SCHEMA}),
              SamplingParams(max_tokens=80, temperature=0.0, structured={"json_object": True}),
              SamplingParams(max_tokens=10, temperature=0.7, seed=1,
                             structured={"choice": ["yes", "no", "maybe"]}),
              SamplingParams(max_tokens=20, temperature=0.0,
                             structured={"regex": r"[0-9]{3}-[a-z]{2}"}),
              free]
    outs = engine.generate([prompt] * len(params), params)
    for out in outs[:2]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert isinstance(json.loads(outs[2].text), dict)
    assert outs[3].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[4].text)
    # The unconstrained request in the same batch is as it is alone.
    (alone,) = engine.generate([prompt], free)
    assert outs[5].output_token_ids == alone.output_token_ids


def test_bad_constraints_are_refused(engine):
    for spec, words in [({"json": {"type": "nonsense"}}, "structured json"),
                        ({"regex": "(unclosed"}, "structured regex"),
                        ({"grammar": "root ::= "}, "structured grammar"),
                        ({"json": SCHEMA, "regex": "x"}, "exactly one"),
                        ({"choice": []}, "choice")]:
        with pytest.raises(InvalidRequestError, match=words):
            engine.add_request("bad", "x", SamplingParams(structured=spec))


def test_the_simulator_refuses_constraints():
    sim = LLMEngine(EngineConfig(simulate=True, vocab_size=1000, num_gpu_blocks=16))
    with pytest.raises(InvalidRequestError, match="simulated"):
        sim.add_request("r", "x", SamplingParams(structured={"json_object": True}))
