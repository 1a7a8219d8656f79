"""Loading a Llama-family HF folder: config.json, *.safetensors (sharded too),
generation_config.json; the tokenizer files are read by engine/hf_tokenizer.py.

Every problem a user can fix raises ModelLoadError saying which file or field is wrong
and what to do.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import EngineError
from engine.model import (SUPPORTED_ROPE_TYPES, Linear, ModelArgs, Transformer,
                          interleave_rope_rows)
from engine.ops import ACTIVATIONS

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
_GEMMA = ("gemma2", "gemma3_text")
# How often a global layer comes among sliding ones when config.json has no layer_types
_GEMMA_PATTERN = {"gemma2": 2, "gemma3_text": 6}
# Scaling fields each rope type needs (HF names).
_ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


class ModelLoadError(EngineError):
    """The model folder is missing, incomplete, or holds a model the engine cannot run."""


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
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            activation=act,
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            scale_embeddings=gemma,
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            attn_softcap=_float_or_none(config.get("attn_logit_softcapping")) if gemma else None,
            final_softcap=_float_or_none(config.get("final_logit_softcapping")) if gemma else None,
            layer_windows=_layer_windows(config, model_type),
            local_rope=local_rope,
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
    return theta, rope_type, tuple((f, float(params[f])) for f in _ROPE_FIELDS[rope_type])


def _sliding_window(config: dict) -> int | None:
    """Qwen2/Qwen3 with use_sliding_window: contexts are kept within the window, so
    that full attention equals the windowed one (which layers slide depends on
    max_window_layers, not implemented). The other families' windows are applied by
    the attention layers (_layer_windows)."""
    if config.get("model_type") not in ("qwen2", "qwen3") or not config.get("use_sliding_window"):
        return None
    window = config.get("sliding_window")
    return int(window) if window else None


def _layer_windows(config: dict, model_type: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: global): Mistral's and Phi-3's sliding_window
    on every layer; Gemma's on its "sliding_attention" layers (config.json's
    layer_types, or its fixed pattern); () when no layer slides."""
    window = int(config.get("sliding_window") or 0)
    n = int(config["num_hidden_layers"])
    if not window or model_type not in ("mistral", "phi3") + _GEMMA:
        return ()
    if model_type in _GEMMA:
        types = config.get("layer_types") or [
            "full_attention" if (i + 1) % int(config.get("sliding_window_pattern")
                                              or _GEMMA_PATTERN[model_type]) == 0
            else "sliding_attention" for i in range(n)]
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window,) * n


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

def load_model(folder: ModelFolder, dtype: torch.dtype, device: torch.device) -> Transformer:
    """Build the model on `device` with the folder's weights in `dtype`."""
    with torch.device("meta"):
        model = Transformer(folder.args)
    state = _transposed_linears(model, _fused_state_dict(folder, dtype, device))
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
        if tuple(state[name].shape) != shape:
            raise ModelLoadError(f"{path}: {name} has shape {tuple(state[name].shape)}, "
                                 f"config.json implies {shape}")
