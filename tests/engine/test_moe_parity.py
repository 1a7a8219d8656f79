"""The mixture-of-experts families (Mixtral, Qwen3-MoE) against transformers, wider
than test_model_parity's one model per family: several random models (tests.models.tiny's
MOE_SPECS: seeds, experts, k, norm_topk_prob both ways, a dense middle layer), prompts of
up to 128 tokens and 32 greedy tokens each. A small error in the routing or the experts
(a weight renormalised or not, a softmax in another order or dtype, gate and up swapped,
an expert's weights loaded for another) moves the logits by less than the gap between
the two best tokens for a while, so the tokens alone may agree over short generations:
the log-probabilities of every prompt and output token must agree too, within float32
noise.

Each MoE block is also checked alone (the same hidden states into the engine's and
transformers' block), and the router against transformers' routers, so that a failure
says where the models part."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model.transformer import Linear, MoE
from engine.model.ops.torch_ops import TorchOps
from tests.models.tiny import MOE_SPECS, hf_greedy, random_prompts

MAX_TOKENS = 32
LENGTHS = [49, 90, 128]
# |engine - transformers| on a log-probability: float32 noise is ~1e-5 on these models;
# errors of the kind that part the greedy tokens only after a while (the routing
# weights rounded to float16, the experts' intermediate to bfloat16) give 5e-4 to 0.2
LOGPROB_ATOL = 1e-4


def make_engine(folder, cpu_kernels: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                  attention_backend="torch", block_size=4, num_gpu_blocks=256,
                                  num_cpu_blocks=0, seed=0, cpu_kernels=cpu_kernels, **kw))


@functools.cache
def _hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@functools.cache
def hf_reference(folder, name: str) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """(prompts, transformers' greedy tokens, per sequence the log-probability of each of
    its tokens after the first: prompt tokens, then the greedy ones), once per model."""
    prompts = random_prompts(MOE_SPECS[name].vocab_size, LENGTHS, seed=MOE_SPECS[name].seed)
    greedy = hf_greedy(folder, prompts, MAX_TOKENS)
    model = _hf_model(folder)
    logprobs = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, greedy):
            seq = torch.tensor([prompt + out])
            lp = model(seq[:, :-1]).logits[0].float().log_softmax(-1)
            logprobs.append(lp.gather(1, seq[0, 1:, None])[:, 0])
    return prompts, greedy, logprobs


@pytest.mark.parametrize("cpu_kernels", ["off", "on"])
@pytest.mark.parametrize("name", sorted(MOE_SPECS))
def test_long_greedy_and_logprobs_match_transformers(tiny_model, name, cpu_kernels):
    folder = tiny_model(name)
    prompts, expected, expected_logprobs = hf_reference(folder, name)
    engine = make_engine(folder, cpu_kernels)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    outs = engine.generate(prompts, params)
    got = [o.output_token_ids for o in outs]
    assert all(len(g) == len(e) == MAX_TOKENS for g, e in zip(got, expected))
    for i, (g, e) in enumerate(zip(got, expected)):
        first = next((j for j, (a, b) in enumerate(zip(g, e)) if a != b), None)
        assert first is None, f"prompt {i} ({len(prompts[i])} tokens): token {first} differs"
    assert any(len(set(g)) > 4 for g in got), "degenerate model: the test would prove little"
    for o, ref in zip(outs, expected_logprobs):
        prompt_lp = [entry[1] for entry in o.prompt_logprobs[1:]]
        mine = torch.tensor(prompt_lp + [entry[0] for entry in o.logprobs])
        diff = (mine - ref).abs()
        assert diff.max().item() < LOGPROB_ATOL, (
            f"{len(o.prompt_token_ids)}-token prompt: log-probabilities differ by up to "
            f"{diff.max().item():.2e}, first beyond {LOGPROB_ATOL} at position "
            f"{int((diff >= LOGPROB_ATOL).nonzero()[0]) + 1} of prompt + output")


@pytest.mark.parametrize("cpu_kernels", ["off", "on"])
@pytest.mark.parametrize("name", ["mixtral-e4k2", "qwen3moe-e6k2"])
def test_prefix_hits_beside_chunked_prefill_match_transformers(tiny_model, name, cpu_kernels):
    """Reported: both families left transformers' tokens with 4-token blocks, a 16-token
    step budget and prefix caching, six prompts of which three share a 29-token prefix;
    so steps mix a request starting past position 0 (its prefix from the cache) with
    another's prefill chunk and decodes. The tokens must agree, and the log-probabilities
    of the output tokens within float32 noise (no prompt_logprobs: they turn the cache
    off for the request)."""
    folder = tiny_model(name)
    vocab = MOE_SPECS[name].vocab_size
    prefix = random_prompts(vocab, [29], seed=7)[0]  # 7 full blocks of 4, and a part
    sharing = random_prompts(vocab, [5, 11, 2], seed=2, prefix=prefix)
    prompts = [sharing[0], *random_prompts(vocab, [9, 23, 37], seed=3), *sharing[1:]]
    engine = make_engine(folder, cpu_kernels, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = engine.generate(prompts, params)
    assert [o.num_cached_tokens for o in outs[-2:]] == [28, 28], "no prefix hit: nothing tested"
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    for i, (o, e) in enumerate(zip(outs, expected)):
        first = next((j for j, (a, b) in enumerate(zip(o.output_token_ids, e)) if a != b), None)
        assert first is None, f"prompt {i} ({len(prompts[i])} tokens): token {first} differs"
    model = _hf_model(folder)
    with torch.inference_mode():
        for o in outs:
            seq = torch.tensor([o.prompt_token_ids + o.output_token_ids])
            lp = model(seq[:, :-1]).logits[0].float().log_softmax(-1)
            ref = lp.gather(1, seq[0, 1:, None])[len(o.prompt_token_ids) - 1:, 0]
            diff = (torch.tensor([entry[0] for entry in o.logprobs]) - ref).abs().max().item()
            assert diff < LOGPROB_ATOL, f"{len(o.prompt_token_ids)}-token prompt: {diff:.2e}"


@pytest.mark.parametrize("cpu_kernels", ["off", "on"])
@pytest.mark.parametrize("name", ["mixtral-e4k2", "qwen3moe-e6k2"])
def test_moe_block_rows_do_not_depend_on_the_batch(tiny_model, name, cpu_kernels):
    """A token's MoE output is its own: the same hidden states through each MoE layer as
    one batch and cut into the pieces a 16-token budget makes (with 1-row decodes)."""
    engine = make_engine(tiny_model(name), cpu_kernels)
    model, ops = engine.runner.model, engine.runner.ops
    x = torch.randn(45, model.args.dim, generator=torch.Generator().manual_seed(1)) * 2
    cuts = [0, 16, 29, 30, 31, 45]
    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            if not isinstance(layer.feed_forward, MoE):
                continue
            whole = layer.feed_forward(x, ops)
            pieces = torch.cat([layer.feed_forward(x[a:b], ops) for a, b in zip(cuts, cuts[1:])])
            err = (pieces - whole).abs().max().item()
            assert err < 1e-5 * max(1.0, whole.abs().max().item()), f"layer {i}: {err:.2e}"


@pytest.mark.parametrize("name", sorted(MOE_SPECS))
def test_each_moe_block_matches_transformers_block(tiny_model, name):
    """The same hidden states (wide ones: many tokens, every expert used) into each MoE
    layer of the engine's model (torch ops) and of transformers': the same output."""
    folder = tiny_model(name)
    engine = make_engine(folder, "off")
    model = engine.runner.model
    hf = _hf_model(folder)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, model.args.dim, generator=g) * 2
    moe_layers = [i for i, layer in enumerate(model.layers) if isinstance(layer.feed_forward, MoE)]
    assert moe_layers
    with torch.inference_mode():
        for i in moe_layers:
            mine = model.layers[i].feed_forward(x, engine.runner.ops)
            theirs = hf.model.layers[i].mlp(x[None])
            theirs = (theirs[0] if isinstance(theirs, tuple) else theirs)[0]
            err = (mine - theirs).abs().max().item()
            assert err < 1e-5 * max(1.0, theirs.abs().max().item()), f"layer {i}: {err:.2e}"


@pytest.mark.parametrize("family,renormalize", [("mixtral", True), ("qwen3_moe", True),
                                                ("qwen3_moe", False)])
@pytest.mark.parametrize("num_experts,top_k", [(4, 2), (6, 2), (8, 3), (5, 1)])
def test_route_matches_transformers_router(family, renormalize, num_experts, top_k):
    """TorchOps.route (the experts and weights of each token) against the router of
    transformers' Mixtral (softmax over all experts in float32, top k, renormalised) and
    Qwen3-MoE (renormalised only with norm_topk_prob)."""
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    dim = 32
    config = AutoConfig.for_model(family, hidden_size=dim, num_experts_per_tok=top_k,
                                  **({"num_local_experts": num_experts} if family == "mixtral"
                                     else {"num_experts": num_experts,
                                           "norm_topk_prob": renormalize}))
    g = torch.Generator().manual_seed(num_experts * 10 + top_k)
    router = (MixtralTopKRouter if family == "mixtral" else Qwen3MoeTopKRouter)(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, dim, generator=g) * 0.2)
    linear = Linear(dim, num_experts, bias=False)
    linear.weight_t = torch.nn.Parameter(router.weight.detach().t().contiguous())
    moe = SimpleNamespace(router=linear, top_k=top_k, renormalize=renormalize)
    x = torch.randn(500, dim, generator=g)
    with torch.inference_mode():
        weights, ids = TorchOps().route(x, moe)
        _, their_weights, their_ids = router(x)
    assert weights.dtype == torch.float32
    assert torch.equal(ids, their_ids)
    torch.testing.assert_close(weights, their_weights.float(), atol=1e-6, rtol=1e-6)
