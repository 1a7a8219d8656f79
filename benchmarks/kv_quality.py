"""What an fp8 K/V cache costs in quality, and what it buys in blocks.

    python -m benchmarks.kv_quality [--model PATH] [--tokens 64] [--device cpu|cuda]
                                    [--dtype auto|float32|bfloat16]

One engine per K/V configuration (the model's dtype, fp8_e4m3 with scales per layer,
per KV head and of 1, fp8_e5m2 per layer), each run over the same fixed 50 chat
prompts, greedy. Against the model's own dtype it reports:

* greedy agreement: the share of the first --tokens output positions where the token
  equals the baseline's, the mean length of the common prefix, and the prompts whose
  whole output is the same;
* the mean (and largest) absolute difference of the prompt tokens' log-probabilities
  (what the OpenAI API's `echo` + `logprobs` return);
* one block's bytes and blocks per GiB;
* (--dtype float32) on the first --transformers prompts, the fp8_e4m3 run against
  transformers with its K and V sent through fp8 at the engine's scales, and that
  against transformers itself: whether the loss is fp8's or the kernels'.

With --dtype float32, a last row runs the whole model in bfloat16 (what a GPU runs by
default), for scale.

The table is in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import time

TOPICS = ["the water cycle", "binary search", "the French Revolution", "photosynthesis",
          "TCP congestion control", "compound interest", "black holes", "the immune system",
          "sourdough bread", "public-key cryptography"]
TASKS = ["Explain {} to a twelve-year-old in three sentences.",
         "Write a short poem about {}.",
         "List three common misconceptions about {} and correct each.",
         "Summarise the history of {} in one paragraph.",
         "Give a step-by-step example that shows how {} works."]
PROMPTS = [task.format(topic) for topic in TOPICS for task in TASKS]  # 50

CONFIGS = [("model dtype", dict(kv_cache_dtype="auto")),
           ("fp8_e4m3, per layer", dict(kv_cache_dtype="fp8_e4m3", kv_cache_scales="tensor")),
           ("fp8_e4m3, per KV head", dict(kv_cache_dtype="fp8_e4m3", kv_cache_scales="head")),
           ("fp8_e4m3, scale 1", dict(kv_cache_dtype="fp8_e4m3", kv_cache_scales="unit")),
           ("fp8_e5m2, per layer", dict(kv_cache_dtype="fp8_e5m2", kv_cache_scales="tensor"))]


def run(model: str | None, device: str, dtype: str, tokens: int, kv: dict) -> dict:
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=model, device=device, num_gpu_blocks=4096,
                                    max_num_seqs=64, **{"dtype": dtype, **kv}))
    tok = engine.runner.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                          add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=0)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    result = {"tokens": [o.output_token_ids for o in outs], "prompts": prompts,
              "model_path": engine.runner.model_path, "kv_scales": engine.runner.kv_scales,
              "prompt_logprobs": [[e[1] for e in o.prompt_logprobs[1:]] for o in outs],
              "block_bytes": engine.runner.block_bytes, "kv_format": engine.runner.kv_format,
              "dtype": engine.runner.dtype, "seconds": seconds}
    engine.close()
    return result


def transformers_prompt_logprobs(folder, prompts: list[list[int]], fp8=None,
                                 kv_scales=None) -> list[list[float]]:
    """transformers' (float32) log-probabilities of each prompt's tokens after its first;
    with fp8 (a torch float8 dtype), its K (after RoPE) and V sent through fp8 at the
    engine's per-layer scales (kv_scales [n_layers, 2, n_kv_heads], every head alike):
    the reference an fp8 engine is held to (tests/engine/test_fp8_kv.py)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    layer, hooks = [0], []
    rope = modeling_llama.apply_rotary_pos_emb
    if fp8 is not None:
        top = torch.finfo(fp8).max

        def through_fp8(x, which):
            scale = float(kv_scales[layer[0], which, 0])
            return (x / scale).clamp(-top, top).to(fp8).float() * scale

        def rope_then_fp8(q, k, cos, sin, *args, **kwargs):
            q, k = rope(q, k, cos, sin, *args, **kwargs)
            return q, through_fp8(k, 0)

        for i, block in enumerate(model.model.layers):
            hooks.append(block.self_attn.register_forward_pre_hook(
                lambda module, args, kwargs, i=i: layer.__setitem__(0, i), with_kwargs=True))
            hooks.append(block.self_attn.v_proj.register_forward_hook(
                lambda module, args, out: through_fp8(out, 1)))
        modeling_llama.apply_rotary_pos_emb = rope_then_fp8
    try:
        result = []
        with torch.inference_mode():
            for prompt in prompts:
                logits = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
                result.append([logits[i, t].item() for i, t in enumerate(prompt[1:])])
        return result
    finally:
        modeling_llama.apply_rotary_pos_emb = rope
        for hook in hooks:
            hook.remove()


def mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(diffs) / len(diffs)


def compare(base: dict, other: dict) -> dict:
    positions = same = prefix = whole = 0
    for a, b in zip(base["tokens"], other["tokens"]):
        positions += len(a)
        same += sum(x == y for x, y in zip(a, b))
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix += common
        whole += common == len(a)
    diffs = [abs(x - y) for ra, rb in zip(base["prompt_logprobs"], other["prompt_logprobs"])
             for x, y in zip(ra, rb)]
    n = len(base["tokens"])
    return {"agree": same / positions, "prefix": prefix / n, "whole": whole / n,
            "lp_mean": sum(diffs) / len(diffs), "lp_max": max(diffs)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder (default: the default model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="the model's (auto: bfloat16 on a "
                        "GPU, float32 on a CPU)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--transformers", type=int, default=10, metavar="N",
                        help="with --dtype float32: hold the fp8_e4m3 per-layer run to "
                             "transformers with fp8 K/V on the first N prompts (0: not)")
    args = parser.parse_args(argv)
    configs = list(CONFIGS)
    if args.dtype == "float32":  # for scale: what bfloat16 itself moves (a GPU's default)
        configs.append(("bfloat16 model and K/V", dict(dtype="bfloat16")))
    results = [(name, run(args.model, args.device, args.dtype, args.tokens, kv))
               for name, kv in configs]
    base = results[0][1]
    print(f"{len(PROMPTS)} prompts, greedy, {args.tokens} tokens each; against the model's "
          f"dtype ({base['dtype']})\n")
    print("| K/V | block | blocks per GiB | greedy tokens equal | common prefix | "
          "outputs equal | prompt logprob diff, mean | max | s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results:
        c = compare(base, r)
        label = name if name != "model dtype" else f"{base['dtype']} (the model's)"
        print(f"| {label} | {r['block_bytes'] // 1024} KiB | {2 ** 30 // r['block_bytes']:,} | "
              f"{100 * c['agree']:.1f}% | {c['prefix']:.1f} | {100 * c['whole']:.0f}% | "
              f"{c['lp_mean']:.4f} | {c['lp_max']:.3f} | {r['seconds']:.1f} |")
    if args.dtype == "float32" and args.transformers:
        import torch

        fp8 = results[1][1]  # fp8_e4m3, per layer
        n = args.transformers
        prompts = fp8["prompts"][:n]
        exact = transformers_prompt_logprobs(fp8["model_path"], prompts)
        through = transformers_prompt_logprobs(fp8["model_path"], prompts, torch.float8_e4m3fn,
                                               fp8["kv_scales"])
        print(f"\nThe first {n} prompts' log-probabilities, mean |difference| (transformers in "
              "float32, its K and V sent through fp8_e4m3 at the engine's scales or not):")
        print(f"* the engine's fp8_e4m3 run against transformers with fp8 K/V: "
              f"{mean_abs(through, fp8['prompt_logprobs'][:n]):.4f}")
        print(f"* transformers with fp8 K/V against transformers: {mean_abs(through, exact):.4f}")
        print(f"* the engine in float32 against transformers: "
              f"{mean_abs(exact, base['prompt_logprobs'][:n]):.6f}")


if __name__ == "__main__":
    main()
