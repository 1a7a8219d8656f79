"""Tiny random Llama-family models saved as complete HF folders (config.json,
model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json),
and the transformers greedy reference the engine must match."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

EOS_ID = 2  # the tiny tokenizer's </s>


@dataclass(frozen=True)
class TinySpec:
    name: str
    vocab_size: int = 211
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_layers: int = 2
    intermediate_size: int = 96
    tie_word_embeddings: bool = False
    model_type: str = "llama"  # an HF model_type
    rope: dict | None = None  # rope_parameters beyond rope_theta, e.g. {"rope_type": "linear", ...}
    attention_bias: bool = False
    max_position_embeddings: int = 512
    seed: int = 0
    extra: dict = field(default_factory=dict)


SPECS = {
    "gqa16": TinySpec("gqa16"),
    "mha32": TinySpec("mha32", vocab_size=307, hidden_size=64, num_heads=2, num_kv_heads=2,
                      head_dim=32, tie_word_embeddings=True, seed=1),
    "gqa64": TinySpec("gqa64", vocab_size=509, hidden_size=96, num_heads=6, num_kv_heads=2,
                      head_dim=64, num_layers=3, intermediate_size=160, seed=2,
                      rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": TinySpec("qwen2", vocab_size=257, hidden_size=48, num_heads=3, num_kv_heads=1,
                      head_dim=16, model_type="qwen2", seed=3),
    "linear": TinySpec("linear", vocab_size=199, num_heads=4, num_kv_heads=1, seed=4,
                       rope={"rope_type": "linear", "factor": 2.0}, attention_bias=True),
    "mistral": TinySpec("mistral", vocab_size=233, hidden_size=64, num_heads=8, num_kv_heads=2,
                        head_dim=8, model_type="mistral", seed=5,
                        extra={"sliding_window": None}),
    # Qwen3: a per-head q/k RMSNorm, and heads * head_dim wider than hidden_size
    "qwen3": TinySpec("qwen3", vocab_size=241, hidden_size=48, num_heads=4, num_kv_heads=2,
                      head_dim=32, model_type="qwen3", seed=6),
    # a window of 8 tokens on every layer: the prompts of the tests are longer
    "mistral-window": TinySpec("mistral-window", vocab_size=223, hidden_size=64, num_heads=4,
                               num_kv_heads=2, head_dim=16, model_type="mistral", seed=7,
                               extra={"sliding_window": 8}),
    # Phi-3: q/k/v in one tensor, gate/up in another, a window on every layer
    "phi3": TinySpec("phi3", vocab_size=229, hidden_size=64, num_heads=4, num_kv_heads=2,
                     head_dim=16, model_type="phi3", seed=8,
                     extra={"sliding_window": 11, "original_max_position_embeddings": 512}),
    # Phi-3 128k's LongRoPE (short factors below original_max_position_embeddings, cos
    # and sin scaled by sqrt(1 + ln 4 / ln 512)); the tests' sequences stay below 512
    "phi3-longrope": TinySpec(
        "phi3-longrope", vocab_size=227, hidden_size=64, num_heads=4, num_kv_heads=4,
        head_dim=16, model_type="phi3", seed=13, max_position_embeddings=2048,
        rope={"rope_type": "longrope",
              "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
              "long_factor": [1.0, 1.5, 2.2, 3.0, 4.1, 5.5, 7.0, 9.0]},
        extra={"original_max_position_embeddings": 512, "sliding_window": None}),
    # (Gemma ties its embeddings; tied, these tiny models' embeddings, scaled by
    # sqrt(hidden), outweigh the layers and the output repeats the input)
    # Gemma 2: sandwich norms (1 + w), GELU, scaled embeddings, soft-capped scores and
    # logits, a sliding layer (window 6) then a global one
    "gemma2": TinySpec("gemma2", vocab_size=251, hidden_size=64, num_heads=4, num_kv_heads=2,
                       head_dim=16, model_type="gemma2", seed=9,
                       extra={"sliding_window": 6, "query_pre_attn_scalar": 24,
                              "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                              "hidden_activation": "gelu_pytorch_tanh"}),
    # Gemma 3: q/k norms, and the sliding layers' own RoPE base; 3 layers, the last
    # global, with a linear-scaled RoPE
    "gemma3": TinySpec("gemma3", vocab_size=263, hidden_size=64, num_heads=4, num_kv_heads=1,
                       head_dim=32, num_layers=3, model_type="gemma3_text", seed=10,
                       rope={"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                       extra={"sliding_window": 7, "query_pre_attn_scalar": 32,
                              "layer_types": ["sliding_attention", "sliding_attention",
                                              "full_attention"]}),
    # Mixtral: 4 experts, top 2 renormalised, on every layer
    "mixtral": TinySpec("mixtral", vocab_size=269, hidden_size=48, num_heads=4, num_kv_heads=2,
                        head_dim=16, model_type="mixtral", seed=11,
                        extra={"num_local_experts": 4, "num_experts_per_tok": 2,
                               "sliding_window": None}),
    # Qwen3-MoE: 6 experts, top 2 not renormalised (norm_topk_prob off), q/k norms, the
    # middle layer a dense MLP
    "qwen3moe": TinySpec("qwen3moe", vocab_size=271, hidden_size=48, num_heads=4, num_kv_heads=2,
                         head_dim=16, num_layers=3, model_type="qwen3_moe", seed=12,
                         extra={"num_experts": 6, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 40, "norm_topk_prob": False,
                                "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
}


# Wider random MoE models for tests/engine/test_moe_parity.py (kept out of SPECS, which
# every family test runs in every KV situation): per family several seeds, the
# renormalised top-k of Mixtral and of Qwen3-MoE's norm_topk_prob, more experts and a
# larger k, a dense middle layer. Their tests run longer prompts and generations than
# SPECS' (a small error in the experts shows only after some tokens).
MOE_SPECS = {spec.name: spec for spec in [
    TinySpec("mixtral-e4k2", vocab_size=269, hidden_size=64, num_heads=4, num_kv_heads=2,
             head_dim=16, model_type="mixtral", seed=21,
             extra={"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    TinySpec("mixtral-e4k2-b", vocab_size=241, hidden_size=64, num_heads=4, num_kv_heads=2,
             head_dim=16, model_type="mixtral", seed=26,
             extra={"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    TinySpec("mixtral-e8k3", vocab_size=251, hidden_size=64, num_heads=4, num_kv_heads=1,
             head_dim=16, intermediate_size=64, model_type="mixtral", seed=22,
             extra={"num_local_experts": 8, "num_experts_per_tok": 3, "sliding_window": None}),
    TinySpec("qwen3moe-e6k2-norm", vocab_size=271, hidden_size=64, num_heads=4, num_kv_heads=2,
             head_dim=16, model_type="qwen3_moe", seed=23,
             extra={"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
                    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    TinySpec("qwen3moe-e6k2-norm-b", vocab_size=233, hidden_size=64, num_heads=4,
             num_kv_heads=2, head_dim=16, model_type="qwen3_moe", seed=27,
             extra={"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
                    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    TinySpec("qwen3moe-e8k3-norm", vocab_size=257, hidden_size=48, num_heads=4, num_kv_heads=2,
             head_dim=16, num_layers=3, model_type="qwen3_moe", seed=24,
             extra={"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
    TinySpec("qwen3moe-e6k2", vocab_size=263, hidden_size=64, num_heads=4, num_kv_heads=2,
             head_dim=16, model_type="qwen3_moe", seed=25,
             extra={"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                    "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    # The families' own head shapes at hidden 64 (what AutoConfig gives when only the
    # width, depth and experts are set): Mixtral's 32 heads of 2, Qwen3-MoE's 32 of 128
    TinySpec("mixtral-e4k2-heads32", vocab_size=1000, hidden_size=64, num_heads=32,
             num_kv_heads=8, head_dim=2, intermediate_size=512, model_type="mixtral", seed=28,
             extra={"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    TinySpec("qwen3moe-e6k2-heads32", vocab_size=1000, hidden_size=64, num_heads=32,
             num_kv_heads=4, head_dim=128, model_type="qwen3_moe", seed=29,
             extra={"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 768,
                    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
]}


def build_tiny_model(spec: TinySpec, root: Path) -> Path:
    """Save a random model for `spec` under root/spec.name; returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = root / spec.name
    if (folder / "config.json").is_file():
        return folder
    rope = {"rope_theta": 10000.0, "rope_type": "default"}
    rope.update(spec.rope or {})
    if spec.model_type == "gemma3_text":  # a RoPE per layer type
        rope = {"full_attention": rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
    config = AutoConfig.for_model(
        spec.model_type, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, rope_parameters=rope,
        bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0,
        # A wider init than the default 0.02 keeps logits apart, so float rounding
        # differences between two correct implementations do not flip an argmax.
        initializer_range=0.2, **({"attention_bias": spec.attention_bias}
                                  if spec.model_type in ("llama", "qwen3", "qwen3_moe") else {}),
        **spec.extra)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms start at 1 (or 0): make their weights tell heads apart
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(folder)
    _save_tokenizer(folder, spec.vocab_size)
    return folder


def _save_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer: "w17" is token 17; ids 0-2 are <unk>, <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS_ID}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}{{ '<s>' + m['role'] + ' ' + m['content'] + ' </s> ' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant ' }}{% endif %}",
    }))


def hf_greedy(folder: Path, prompts: list[list[int]], max_tokens: int,
              **generate_kwargs) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (float32, one at a time so no
    padding is involved), never stopping early at EOS; generate_kwargs go to generate
    (its logits processors: repetition_penalty, sequence_bias...)."""
    from transformers import AutoModelForCausalLM

    # Gemma 2's soft-capped scores need transformers' eager attention (SDPA has no cap)
    gemma2 = json.loads((folder / "config.json").read_text())["model_type"] == "gemma2"
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, **({"attn_implementation": "eager"} if gemma2 else {})).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0, **generate_kwargs)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0,
                   prefix: list[int] | None = None) -> list[list[int]]:
    """Prompts of the given lengths (plus a shared prefix if given), token ids >= 3."""
    g = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(3, vocab_size, (n,), generator=g).tolist()
            for n in lengths]
