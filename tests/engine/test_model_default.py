"""The real default model (SmolLM2-135M-Instruct, converted by `make setup`): a chat
prompt gives the same greedy text through kvops as through transformers."""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model.default_model import default_model_dir

MAX_TOKENS = 20
FOLDER = default_model_dir()

pytestmark = pytest.mark.skipif(
    not (FOLDER / "config.json").is_file(),
    reason=f"default model not converted at {FOLDER} (run `make setup`)")


def test_chat_prompt_matches_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    engine = LLMEngine(EngineConfig(model=None, device="cpu", dtype="float32",
                                    attention_backend="torch", num_gpu_blocks=64))
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))

    hf_tok = AutoTokenizer.from_pretrained(FOLDER)
    assert prompt == hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    hf_ids = hf_tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert out.prompt_token_ids == hf_ids[0].tolist()
    model = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    with torch.inference_mode():
        gen = model.generate(hf_ids, attention_mask=torch.ones_like(hf_ids),
                             max_new_tokens=MAX_TOKENS, do_sample=False)
    expected = gen[0, hf_ids.shape[1]:].tolist()
    assert out.output_token_ids == expected
    assert out.text == hf_tok.decode(expected, skip_special_tokens=True)
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its answer with <|im_end|>, the EOS
