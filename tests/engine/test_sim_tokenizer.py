"""The simulator's tokenizer: by default the default model's, so that the token counts a
client computes with that tokenizer are the engine's (issue: clients work unchanged)."""
import pytest

from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from engine.model.default_model import default_model_dir
from engine.text.detokenizer import SimTokenizer
from engine.text.tokenizer import HFTokenizer
from engine.model.simulated_runner import _SEED, digest, next_token, reference_generate

PROMPT = "The quick brown fox jumps over the lazy dog, twice: once for luck."


def run(engine: LLMEngine, prompt, max_tokens: int):
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def test_the_default_is_the_default_models_tokenizer_and_the_stand_in_never_says_eos():
    hf = HFTokenizer.from_folder(default_model_dir())
    engine = LLMEngine(EngineConfig(simulate=True, num_gpu_blocks=64))
    described = engine.describe_config()
    assert described["tokenizer_path"] == str(default_model_dir())
    assert engine.runner.vocab_size == hf.vocab_size == described["vocab_size"]
    assert hf.eos_token_ids, "the default model's tokenizer names its EOS"

    out = run(engine, PROMPT, 64)
    ids = hf.encode(PROMPT)
    assert out.prompt_token_ids == ids and len(ids) < len(PROMPT.encode())
    avoid = frozenset(hf.eos_token_ids)
    assert out.output_token_ids == reference_generate(ids, 64, hf.vocab_size, avoid)
    assert len(out.output_token_ids) == 64  # not ended by an EOS
    assert out.text == hf.decode(out.output_token_ids)
    # ids the tokenizer can give are valid prompts (the vocabulary is the tokenizer's)
    assert run(LLMEngine(EngineConfig(simulate=True, num_gpu_blocks=64)),
               [hf.vocab_size - 1], 2) is not None

    # a one-token prompt after which the plain stand-in would say EOS: it goes on
    prompt = next([t] for t in range(hf.vocab_size)
                  if digest(_SEED, t) % hf.vocab_size in avoid)
    out = run(LLMEngine(EngineConfig(simulate=True, num_gpu_blocks=64)), prompt, 3)
    assert out.finish_reason == "length" and len(out.output_token_ids) == 3
    assert not avoid & set(out.output_token_ids)


def test_bytes_and_a_named_folder():
    engine = LLMEngine(EngineConfig(simulate=True, simulate_tokenizer="bytes",
                                    vocab_size=1000, num_gpu_blocks=64))
    assert isinstance(engine.tokenizer, SimTokenizer)
    assert engine.describe_config()["tokenizer_path"] is None
    out = run(engine, "héllo", 3)
    assert out.prompt_token_ids == list("héllo".encode())
    with pytest.raises(InvalidRequestError):  # the byte stand-in keeps vocab_size
        engine.add_request("big", [1000], SamplingParams(max_tokens=1))

    named = LLMEngine(EngineConfig(simulate=True, num_gpu_blocks=64,
                                   simulate_tokenizer=str(default_model_dir())))
    assert named.describe_config()["tokenizer_path"] == str(default_model_dir())


def test_next_token_steps_past_the_avoided_ids():
    assert next_token(10, 7) == 3
    assert next_token(10, 7, frozenset({3})) == 4
    assert next_token(13, 7, frozenset({6, 0})) == 1  # wraps, and past 0 as well
