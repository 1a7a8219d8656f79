"""Loading a Llama-family HF folder: config.json, *.safetensors (sharded too),
generation_config.json; the tokenizer files are read by engine/text/tokenizer.py.

Every problem a user can fix raises ModelLoadError saying which file or field is wrong
and what to do.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.model.transformer import (SUPPORTED_ROPE_TYPES, Linear, ModelArgs, Transformer,
                          interleave_rope_rows)
from engine.model.ops.torch_ops import ACTIVATIONS

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text",
                         "mixtral", "qwen3_moe")
_GEMMA = ("gemma2", "gemma3_text")
# How often a global layer comes among sliding ones when config.json has no layer_types
_GEMMA_PATTERN = {"gemma2": 2, "gemma3_text": 6}
# Scaling fields each rope type needs (HF names).
_ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor"),
}


@dataclass(frozen=True, slots=True)
class ModelFolder:
    path: Path
    config: dict  # config.json
    args: ModelArgs
    generation_config: dict  # generation_config.json, {} when absent
    weight_files: tuple[Path, ...]
    sliding_window: int | None  # Mistral/Qwen2 window: contexts longer than it are refused

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """generation_config.json's EOS, else config.json's: one id, or several (Llama 3
        chat models stop on <|eot_id|> as well as <|end_of_text|>); () when neither says."""
        eos = self.generation_config.get("eos_token_id", self.config.get("eos_token_id"))
        if eos is None:
            return ()
        return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def read_model_folder(path: str | Path) -> ModelFolder:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    config = _read_json(folder / "config.json", required=True)
    generation_config = _read_json(folder / "generation_config.json", required=False)
    args = model_args_from_config(config, folder)
    return ModelFolder(path=folder, config=config, args=args,
                       generation_config=generation_config,
                       weight_files=_weight_files(folder),
                       sliding_window=_sliding_window(config))


def model_args_from_config(config: dict, folder: Path) -> ModelArgs:
    """HF config.json -> ModelArgs, refusing what the model code does not implement."""
    where = folder / "config.json"
    model_type = config.get("model_type")
    if model_type == "gemma3":
        raise ModelLoadError(f"{where}: model_type 'gemma3' is Gemma 3's vision-language "
                             "model; kvops runs its text model (model_type 'gemma3_text', "
                             "as gemma-3-1b ships)")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{where}: model_type {model_type!r} is not supported; kvops runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    gemma = model_type in _GEMMA
    act = config.get("hidden_activation") or config.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported "
                             f"({', '.join(ACTIVATIONS)} are)")
    try:
        dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        rope = config.get("rope_parameters") or {}
        local_rope = None
        if "full_attention" in rope:  # Gemma 3: a RoPE per layer type
            rope_theta, rope_type, rope_params = _rope(config, where, rope["full_attention"])
            local_rope = _rope(config, where, rope.get("sliding_attention") or {
                "rope_theta": config.get("rope_local_base_freq", 10000.0)})
        else:
            rope_theta, rope_type, rope_params = _rope(config, where)
            if model_type == "gemma3_text":  # the older config.json layout
                local_rope = (float(config.get("rope_local_base_freq", 10000.0)), "default", ())
        attention_bias = bool(config.get("attention_bias", False))
        scalar = config.get("query_pre_attn_scalar") if gemma else None
        return ModelArgs(
            vocab_size=int(config["vocab_size"]),
            dim=dim,
            intermediate_size=int(config["intermediate_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(config.get("head_dim") or dim // n_heads),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta, rope_type=rope_type, rope_params=rope_params,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            activation=act,
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            scale_embeddings=gemma,
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            attn_softcap=_float_or_none(config.get("attn_logit_softcapping")) if gemma else None,
            final_softcap=_float_or_none(config.get("final_logit_softcapping")) if gemma else None,
            layer_windows=_layer_windows(config, model_type),
            local_rope=local_rope,
            **_moe_fields(config, model_type),
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise ModelLoadError(f"{where}: {e}") from None


def _rope(config: dict, where: Path,
          params: dict | None = None) -> tuple[float, str, tuple[tuple[str, float], ...]]:
    """(theta, type, scaling fields) of config.json's RoPE, or of `params` (one layer
    type's entry of Gemma 3's rope_parameters)."""
    # transformers >= 5 writes rope_parameters (with rope_theta inside); older
    # versions write rope_theta and rope_scaling.
    if params is None:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = dict(params)
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{where}: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ModelLoadError(f"{where}: partial_rotary_factor != 1 is not supported")
    missing = [f for f in _ROPE_FIELDS[rope_type] if f not in params]
    if missing:
        raise ModelLoadError(f"{where}: rope type {rope_type!r} needs {', '.join(missing)}")
    fields = [(f, float(params[f])) for f in _ROPE_FIELDS[rope_type] if rope_type != "longrope"]
    if rope_type == "longrope":
        fields = _longrope_fields(config, params, where)
    return theta, rope_type, tuple(fields)


def _longrope_fields(config: dict, params: dict, where: Path) -> list[tuple[str, object]]:
    """Phi-3's LongRoPE: per-frequency short and long factors, the length that divides
    them (original_max_position_embeddings) and the scale of cos and sin
    (attention_factor; by default sqrt(1 + ln(factor) / ln(original)), factor the
    ratio of max_position_embeddings to the original, as transformers computes it)."""
    original = params.get("original_max_position_embeddings",
                          config.get("original_max_position_embeddings"))
    if not original:
        raise ModelLoadError(f"{where}: rope type 'longrope' needs "
                             "original_max_position_embeddings")
    original = int(original)
    factor = params.get("factor") or int(config.get("max_position_embeddings", original)) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (math.sqrt(1 + math.log(factor) / math.log(original))
                            if factor > 1.0 else 1.0)
    half = int(config.get("head_dim") or int(config["hidden_size"]) // int(
        config["num_attention_heads"])) // 2
    short, long = (tuple(float(x) for x in params[f]) for f in ("short_factor", "long_factor"))
    if len(short) != half or len(long) != half:
        raise ModelLoadError(f"{where}: longrope's short_factor and long_factor need "
                             f"head_dim / 2 = {half} entries each")
    return [("short_factor", short), ("long_factor", long),
            ("original_max_position_embeddings", float(original)),
            ("attention_factor", float(attention_factor))]


def _sliding_window(config: dict) -> int | None:
    """Qwen2/Qwen3 with use_sliding_window: contexts are kept within the window, so
    that full attention equals the windowed one (which layers slide depends on
    max_window_layers, not implemented). The other families' windows are applied by
    the attention layers (_layer_windows)."""
    if config.get("model_type") not in ("qwen2", "qwen3", "qwen3_moe") or not config.get(
            "use_sliding_window"):
        return None
    window = config.get("sliding_window")
    return int(window) if window else None


def _layer_windows(config: dict, model_type: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: global): Mistral's and Phi-3's sliding_window
    on every layer; Gemma's on its "sliding_attention" layers (config.json's
    layer_types, or its fixed pattern); () when no layer slides."""
    window = int(config.get("sliding_window") or 0)
    n = int(config["num_hidden_layers"])
    if not window or model_type not in ("mistral", "mixtral", "phi3") + _GEMMA:
        return ()
    if model_type in _GEMMA:
        types = config.get("layer_types") or [
            "full_attention" if (i + 1) % int(config.get("sliding_window_pattern")
                                              or _GEMMA_PATTERN[model_type]) == 0
            else "sliding_attention" for i in range(n)]
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window,) * n


def _moe_fields(config: dict, model_type: str) -> dict:
    """ModelArgs' expert fields: Mixtral routes every layer through its experts and
    renormalises the top-k weights; Qwen3-MoE does so on the layers that
    decoder_sparse_step and mlp_only_layers leave sparse, renormalising when
    norm_topk_prob says."""
    if model_type == "mixtral":
        return dict(n_experts=int(config["num_local_experts"]),
                    n_experts_per_tok=int(config["num_experts_per_tok"]),
                    moe_intermediate_size=int(config["intermediate_size"]))
    if model_type == "qwen3_moe":
        n, step = int(config["num_hidden_layers"]), int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or ())
        # (Hub configs say num_experts; transformers 5 writes num_local_experts)
        return dict(n_experts=int(config.get("num_experts") or config["num_local_experts"]),
                    n_experts_per_tok=int(config["num_experts_per_tok"]),
                    moe_intermediate_size=int(config["moe_intermediate_size"]),
                    moe_renormalize=bool(config.get("norm_topk_prob", False)),
                    moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(n)))
    return {}


def _float_or_none(value) -> float | None:
    return float(value) if value else None


def _weight_files(folder: Path) -> tuple[Path, ...]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, required=True).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards listed in {index.name} are missing: "
                                 f"{', '.join(missing)}")
        return tuple(files)
    files = tuple(sorted(folder.glob("*.safetensors")))
    if not files:
        bins = sorted(p.name for p in folder.glob("*.bin"))
        hint = (f" (found {', '.join(bins)}: convert them to safetensors)" if bins else "")
        raise ModelLoadError(f"{folder}: no *.safetensors weights{hint}")
    return files


def _read_json(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.parent}: missing {path.name}; is this an HF model folder?")
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read it: {e}") from None


def model_identity(folder: ModelFolder, dtype: torch.dtype) -> str:
    """Stable across restarts, different for different weights or dtype: the prefix
    cache must never serve K/V computed by another model."""
    h = hashlib.sha256((folder.path / "config.json").read_bytes())
    for f in folder.weight_files:
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return f"{folder.path.name}:{h.hexdigest()[:16]}:{str(dtype).removeprefix('torch.')}"


# --- weights ---------------------------------------------------------------------------

def load_model(folder: ModelFolder, dtype: torch.dtype, device: torch.device,
               tp=None) -> Transformer:
    """Build the model on `device` with the folder's weights in `dtype`; with tp
    (engine.parallel.TensorParallel), this rank's share of it."""
    from engine.model import parallel

    args = parallel.shard_args(folder.args, tp.size) if tp else folder.args
    with torch.device("meta"):
        model = Transformer(args, tp)
    state = _fused_state_dict(folder, dtype, device)
    if tp:
        state = parallel.shard_state(state, folder.args, tp.rank, tp.size)
    state = _transposed_linears(model, state)
    expected = set(model.state_dict().keys())
    missing = expected - state.keys()
    if missing:
        raise ModelLoadError(f"{folder.path}: weights missing: {', '.join(sorted(missing)[:5])}")
    model.load_state_dict(state, strict=True, assign=True)
    if folder.args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def _transposed_linears(model: Transformer, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """[out, in] `weight` -> [in, out] `weight_t` for the model's Linear layers."""
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            state[f"{name}.weight_t"] = state.pop(f"{name}.weight").t().contiguous()
    return state


def _fused_state_dict(folder: ModelFolder, dtype: torch.dtype,
                      device: torch.device) -> dict[str, torch.Tensor]:
    """Our parameter names -> tensors; q/k/v and gate/up concatenated."""
    hf = _read_safetensors(folder, dtype, device)
    args = folder.args

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ModelLoadError(f"{folder.path}: weight {name!r} not found in "
                                 f"{', '.join(f.name for f in folder.weight_files)}")
        return hf.pop(name)

    def fused_or_split(name: str, parts: tuple[str, ...], sizes: list[int]) -> list[torch.Tensor]:
        """Phi-3 ships q/k/v (and gate/up) as one tensor: split it; others as parts."""
        if name in hf:
            return list(take(name).split(sizes))
        return [take(p) for p in parts]

    q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    gemma = args.sandwich_norms
    state = {"embed_tokens.weight": take("model.embed_tokens.weight"),
             "norm.weight": take("model.norm.weight")}
    if args.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["embed_tokens.weight"]
    else:
        state["lm_head.weight"] = take("lm_head.weight")
    for i in range(args.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        state[dst + "attention_norm.weight"] = take(src + "input_layernorm.weight")
        if gemma:  # Gemma's post_attention_layernorm norms the attention's output
            state[dst + "post_attention_norm.weight"] = take(src + "post_attention_layernorm.weight")
            state[dst + "ffn_norm.weight"] = take(src + "pre_feedforward_layernorm.weight")
            state[dst + "post_ffn_norm.weight"] = take(src + "post_feedforward_layernorm.weight")
        else:
            state[dst + "ffn_norm.weight"] = take(src + "post_attention_layernorm.weight")
        attn = src + "self_attn."
        for part in ("weight", "bias") if args.qkv_bias else ("weight",):
            q, k, v = fused_or_split(f"{attn}qkv_proj.{part}",
                                     tuple(f"{attn}{p}_proj.{part}" for p in "qkv"),
                                     [q_rows, kv_rows, kv_rows])
            state[f"{dst}attention.wqkv.{part}"] = torch.cat([
                interleave_rope_rows(q, args.n_heads), interleave_rope_rows(k, args.n_kv_heads), v])
        if args.qk_norm:  # per head, in the rows' rotary order
            for p in "qk":
                state[f"{dst}attention.{p}_norm.weight"] = interleave_rope_rows(
                    take(f"{attn}{p}_norm.weight"), 1)
        state[dst + "attention.wo.weight"] = take(attn + "o_proj.weight")
        if args.o_bias:
            state[dst + "attention.wo.bias"] = take(attn + "o_proj.bias")
        if args.is_moe_layer(i):
            state.update(_experts(take, hf, args, src, dst + "feed_forward."))
            continue
        mlp = src + "mlp."
        state[dst + "feed_forward.w_gate_up.weight"] = torch.cat(fused_or_split(
            mlp + "gate_up_proj.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
            [args.intermediate_size] * 2))
        state[dst + "feed_forward.w_down.weight"] = take(mlp + "down_proj.weight")
        if args.mlp_bias:
            state[dst + "feed_forward.w_gate_up.bias"] = torch.cat(
                [take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")])
            state[dst + "feed_forward.w_down.bias"] = take(mlp + "down_proj.bias")
    leftover = [k for k in hf if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ModelLoadError(f"{folder.path}: unexpected weights (not a plain Llama-family "
                             f"model?): {', '.join(sorted(leftover)[:5])}")
    _check_shapes(state, args, folder.path)
    return state


def _experts(take, hf: dict, args: ModelArgs, src: str, dst: str) -> dict[str, torch.Tensor]:
    """One layer's router and experts, stacked as engine.model.MoE holds them:
    experts_gate_up [E, dim, 2 * I] (gate then up), experts_down [E, I, dim]. Checkpoints
    name them per expert (Mixtral's block_sparse_moe.experts.<e>.w1/w3/w2, Qwen3-MoE's
    mlp.experts.<e>.gate_proj/up_proj/down_proj) or stacked as transformers 5 holds them
    (experts.gate_up_proj [E, 2 * I, dim], experts.down_proj [E, dim, I])."""
    mixtral = src + "block_sparse_moe.gate.weight" in hf
    base = src + ("block_sparse_moe." if mixtral else "mlp.")
    state = {dst + "router.weight": take(base + "gate.weight")}
    if base + "experts.gate_up_proj" in hf:
        state[dst + "experts_gate_up"] = take(base + "experts.gate_up_proj").transpose(1, 2)
        state[dst + "experts_down"] = take(base + "experts.down_proj").transpose(1, 2)
    else:
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        gate_up, down = [], []
        for e in range(args.n_experts):
            g, u, d = (take(f"{base}experts.{e}.{n}.weight") for n in names)
            gate_up.append(torch.cat([g, u]).t())
            down.append(d.t())
        state[dst + "experts_gate_up"], state[dst + "experts_down"] = torch.stack(gate_up), torch.stack(down)
    for name in ("experts_gate_up", "experts_down"):
        state[dst + name] = state[dst + name].contiguous()
    inter, expected = args.moe_intermediate_size, {
        "experts_gate_up": (args.n_experts, args.dim, 2 * args.moe_intermediate_size),
        "experts_down": (args.n_experts, args.moe_intermediate_size, args.dim)}
    for name, shape in expected.items():
        if tuple(state[dst + name].shape) != shape:
            raise ModelLoadError(f"{src}: the experts' {name} is {tuple(state[dst + name].shape)}, "
                                 f"config.json implies {shape} (intermediate size {inter})")
    return state


def _read_safetensors(folder: ModelFolder, dtype: torch.dtype,
                      device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    tensors = {}
    for f in folder.weight_files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    tensors[name] = st.get_tensor(name).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f}: cannot read safetensors: {e}") from None
    return tensors


def _check_shapes(state: dict[str, torch.Tensor], args: ModelArgs, path: Path) -> None:
    qkv_rows = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    expected = {
        "embed_tokens.weight": (args.vocab_size, args.dim),
        "lm_head.weight": (args.vocab_size, args.dim),
        "layers.0.attention.wqkv.weight": (qkv_rows, args.dim),
        "layers.0.attention.wo.weight": (args.dim, args.n_heads * args.head_dim),
        "layers.0.feed_forward.w_gate_up.weight": (2 * args.intermediate_size, args.dim),
        "layers.0.feed_forward.w_down.weight": (args.dim, args.intermediate_size),
    }
    for name, shape in expected.items():
        if name in state and tuple(state[name].shape) != shape:  # (an MoE layer has no MLP)
            raise ModelLoadError(f"{path}: {name} has shape {tuple(state[name].shape)}, "
                                 f"config.json implies {shape}")
