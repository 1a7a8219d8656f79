"""The Triton attention backend (kernels.reshape_and_cache + kernels.paged_attention)
inside the real model: greedy output equals transformers'. Without a GPU it runs in
Triton's CPU interpreter, which is slow: one small case."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Before triton is first imported: triton.language's helpers are built for one mode.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import SamplingParams
from tests.engine.test_model_parity import make_engine
from tests.models.tiny import SPECS, hf_greedy, random_prompts

pytest.importorskip("triton", reason="the triton package is not installed")


def test_triton_backend_matches_transformers(tiny_model):
    folder = tiny_model("gqa16")
    prompts = random_prompts(SPECS["gqa16"].vocab_size, [7, 13], seed=9)
    engine = make_engine(folder, attention_backend="triton", max_num_batched_tokens=16,
                         device="cuda" if torch.cuda.is_available() else "cpu")
    assert engine.runner.attention.name == "triton"
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prefix_hit = engine.generate(prompts[:1], params)  # then a prompt sharing its blocks
    outs = engine.generate(prompts + [prompts[0] + [5, 6]], params)
    expected = hf_greedy(folder, prompts + [prompts[0] + [5, 6]], 5)
    assert [o.output_token_ids for o in prefix_hit + outs] == expected[:1] + expected
    assert outs[2].num_cached_tokens >= 4


def test_triton_backend_runs_sliding_and_soft_capped_layers(tiny_model):
    """Gemma 2's sliding, soft-capped layers beside its global ones: the Triton backend
    stores their K/V and hands their attention to the windowed torch path."""
    folder = tiny_model("gemma2")
    prompts = random_prompts(SPECS["gemma2"].vocab_size, [9, 3], seed=9)
    engine = make_engine(folder, attention_backend="triton",
                         device="cuda" if torch.cuda.is_available() else "cpu")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert got == hf_greedy(folder, prompts, 4)


def test_triton_ops_run_the_experts_with_the_fused_moe_kernel(tiny_model):
    """Qwen3-MoE on the Triton backend: TritonOps routes its MoE layers through
    kernels.fused_moe (the interpreter here), with transformers' tokens."""
    folder = tiny_model("qwen3moe")
    prompts = random_prompts(SPECS["qwen3moe"].vocab_size, [6, 2], seed=9)
    engine = make_engine(folder, attention_backend="triton",
                         device="cuda" if torch.cuda.is_available() else "cpu")
    assert engine.runner.ops.name == "triton"
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    got = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert got == hf_greedy(folder, prompts, 3)


def test_triton_kernel_skips_the_blocks_a_window_gave_back(tiny_model):
    """Mistral with an 8-token window on the Triton backend: the request's leading
    blocks go back to the pool as it decodes (-1 in its table), and the kernel, reading
    only the window, gives transformers' tokens."""
    folder = tiny_model("mistral-window")
    prompts = random_prompts(SPECS["mistral-window"].vocab_size, [21], seed=9)
    engine = make_engine(folder, attention_backend="triton",
                         device="cuda" if torch.cuda.is_available() else "cpu")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert got == hf_greedy(folder, prompts, 8)
    assert any(e.type == "WindowFreed" for e in engine.take_events())
