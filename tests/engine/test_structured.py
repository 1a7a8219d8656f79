"""Structured output on the real default model: every constrained answer parses and
validates (json schema, any JSON object, a choice, a regex), greedy or sampled, and a
constraint on one request leaves the others in its batch as they are alone."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model.default_model import default_model_dir
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


def test_bad_constraints_end_alone_with_the_reason(engine):
    """A constraint of the wrong shape is refused at once; one xgrammar refuses ends its
    request alone (finish_reason "error", the reason without xgrammar's source paths),
    and the request beside it runs to its end."""
    for spec, words in [({"json": SCHEMA, "regex": "x"}, "exactly one"),
                        ({"choice": []}, "choice")]:
        with pytest.raises(InvalidRequestError, match=words):
            engine.add_request("bad", "x", SamplingParams(structured=spec))
    for spec, words in [({"json": {"type": "nonsense"}}, "structured json: Unsupported type"),
                        ({"regex": "(unclosed"}, "structured regex: Regex parsing error"),
                        ({"grammar": "root ::= "}, "structured grammar: EBNF parser error")]:
        engine.add_request("bad", "x", SamplingParams(structured=spec))
        engine.add_request("free", "x", SamplingParams(max_tokens=3, temperature=0.0))
        ended = {}
        while engine.has_unfinished_requests():
            ended.update({o.request_id: o for o in engine.step() if o.finished})
        assert ended["bad"].finish_reason == "error" and words in ended["bad"].error
        assert ".cc" not in ended["bad"].error and not ended["bad"].output_token_ids
        assert ended["free"].finish_reason == "length"
        assert len(ended["free"].output_token_ids) == 3
        with pytest.raises(InvalidRequestError, match=words):
            engine.generate(["x"], SamplingParams(structured=spec))
        assert not engine.has_unfinished_requests()


def test_the_step_loop_never_waits_for_a_compile(engine):
    """Constraints compile on their own thread: with that thread held, a constrained
    request waits (live, not queued) while a free one runs to its end, then runs once
    its grammar is ready; an abort while it compiles ends it at once."""
    import threading

    structured = engine.input_processor.structured_outputs()
    gate = threading.Event()
    structured._pool.submit(gate.wait)  # the compile thread is busy until the gate opens
    prompt = chat(engine, "Describe an apple as JSON with its name, colour and ripeness.")
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "note": {"type": "string"}}}
    engine.add_request("json", prompt, SamplingParams(max_tokens=60, temperature=0.0,
                                                      structured={"json": schema}))
    engine.add_request("gone", prompt, SamplingParams(max_tokens=5, structured={"regex": "a+"}))
    engine.add_request("free", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    engine.abort("gone")
    ended = {}
    while "free" not in ended:
        ended.update({o.request_id: o for o in engine.step() if o.finished})
    assert ended["gone"].finish_reason == "abort"
    assert list(engine.scheduler.compiling) == ["json"] and "json" not in ended
    (entry,) = [r for r in engine.snapshot()["requests"] if r["request_id"] == "json"]
    assert entry["status"] == "waiting" and entry["block_table"] == []
    gate.set()
    while engine.has_unfinished_requests():
        ended.update({o.request_id: o for o in engine.step() if o.finished})
    assert ended["json"].finish_reason == "stop"
    jsonschema.validate(json.loads(ended["json"].text), schema)


def test_the_simulator_refuses_constraints():
    sim = LLMEngine(EngineConfig(simulate=True, simulate_tokenizer="bytes",
                                 vocab_size=1000, num_gpu_blocks=16))
    with pytest.raises(InvalidRequestError, match="simulated"):
        sim.add_request("r", "x", SamplingParams(structured={"json_object": True}))


def test_a_constrained_fork_shares_its_compiled_grammar(engine):
    """n > 1: the samples make their matchers from the parent's compiled grammar."""
    prompt = chat(engine, "Is the sky blue? Answer yes or no.")
    (out,) = engine.generate([prompt], SamplingParams(
        max_tokens=5, temperature=1.0, seed=3, n=3, structured={"choice": ["yes", "no"]}))
    assert [s.text in ("yes", "no") for s in out.samples] == [True] * 3
    assert all(s.finish_reason == "stop" for s in out.samples)
