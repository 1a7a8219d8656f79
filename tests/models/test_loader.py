"""Loading HF folders: what works (sharded weights, tied embeddings, Qwen2 biases) and
the typed errors for what does not."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import EngineConfig, EngineError, LLMEngine, SamplingParams
from engine.model.ops.attention import AttentionBackendError
from engine.errors import ModelLoadError
from engine.model.loader import read_model_folder
from engine.model.model_runner import resolve_model_path
from kernels._triton import interpreting
from tests.models.tiny import SPECS, hf_greedy, random_prompts


def engine_for(folder, **kw) -> LLMEngine:
    cfg = dict(model=str(folder), device="cpu", dtype="float32", attention_backend="torch",
               num_gpu_blocks=32)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def copy_of(tiny_model, tmp_path, name="gqa16"):
    dst = tmp_path / name
    shutil.copytree(tiny_model(name), dst)
    return dst


def edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_sharded_weights_load(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_model("gqa16")
    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(folder, max_shard_size="20KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, folder / f)
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(read_model_folder(folder).weight_files) > 1
    prompts = random_prompts(SPECS["gqa16"].vocab_size, [9], seed=3)
    out = engine_for(folder).generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                              ignore_eos=True))
    assert out[0].output_token_ids == hf_greedy(src, prompts, 6)[0]


def test_runner_attributes(tiny_model):
    engine = engine_for(tiny_model("mha32"), num_cpu_blocks=None)
    r = engine.runner
    assert (r.device, r.dtype, r.vocab_size, r.max_model_len) == ("cpu", "float32", 307, 512)
    assert (r.num_gpu_blocks, r.num_cpu_blocks) == (32, 16)
    assert r.model_id.startswith("mha32:") and r.model_id.endswith(":float32")
    assert r.tokenizer.eos_token_id == 2
    assert tuple(r.kv_cache.shape) == (2, 2, 32, 16, 2, 32)


def test_every_eos_id_of_generation_config_stops_a_request(tiny_model, tmp_path):
    """generation_config.json may list several EOS ids (Llama 3 chat models): the
    request stops on whichever comes first, and ignore_eos still runs past them."""
    folder = copy_of(tiny_model, tmp_path)
    prompts = random_prompts(SPECS["gqa16"].vocab_size, [7], seed=5)
    free = engine_for(folder).generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                               ignore_eos=True))[0]
    third = free.output_token_ids[2]
    assert third not in free.output_token_ids[:2] and third != 2
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, third]}))
    engine = engine_for(folder)
    assert engine.tokenizer.eos_token_ids == (2, third) and engine.tokenizer.eos_token_id == 2
    out = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.output_token_ids == free.output_token_ids[:3] and out.finish_reason == "stop"
    past = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                   ignore_eos=True))[0]
    assert past.output_token_ids == free.output_token_ids and past.finish_reason == "length"


def test_model_id_changes_with_dtype_and_config(tiny_model, tmp_path):
    folder = copy_of(tiny_model, tmp_path)
    a = engine_for(folder).runner.model_id
    assert engine_for(folder, dtype="bfloat16").runner.model_id != a
    edit_config(folder, rms_norm_eps=1e-5)
    assert engine_for(folder).runner.model_id != a


def test_kv_pool_sized_from_memory_on_cpu(tiny_model):
    engine = engine_for(tiny_model("gqa16"), num_gpu_blocks=None, kv_cache_memory_bytes=1 << 20)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers x K/V x block_size x kv heads x head_dim x 4 B
    assert engine.runner.num_gpu_blocks == (1 << 20) // block_bytes


def test_bfloat16_runs_on_cpu(tiny_model):
    """Every attention path (padded decodes, shared prefixes, prefill chunks after a
    prefix) in bfloat16; the output stays close to float32's."""
    folder = tiny_model("gqa16")
    prefix = random_prompts(SPECS["gqa16"].vocab_size, [40], seed=5)[0]
    prompts = random_prompts(SPECS["gqa16"].vocab_size, [3, 20, 9], seed=6, prefix=prefix)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for dtype in ("bfloat16", "float32"):
        engine = engine_for(folder, dtype=dtype, max_num_batched_tokens=24, block_size=4,
                            num_gpu_blocks=128)
        engine.generate(prompts[:1], params)
        outs[dtype] = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert engine_for(folder, dtype="bfloat16").runner.kv_cache.dtype == torch.bfloat16
    assert [o[0] for o in outs["bfloat16"]] == [o[0] for o in outs["float32"]]


@pytest.mark.parametrize("change,match", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
     "rope type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 2.0}},
     "needs low_freq_factor"),
    ({"num_attention_heads": 3}, "multiple of n_kv_heads"),
    ({"hidden_size": 80}, "has shape"),
])
def test_config_errors(tiny_model, tmp_path, change, match):
    folder = copy_of(tiny_model, tmp_path)
    edit_config(folder, **change)
    with pytest.raises(ModelLoadError, match=match):
        engine_for(folder)


@pytest.mark.parametrize("missing,match", [
    ("config.json", "missing config.json"),
    ("model.safetensors", "no \\*.safetensors weights"),
    ("tokenizer.json", "missing tokenizer.json"),
])
def test_missing_files(tiny_model, tmp_path, missing, match):
    folder = copy_of(tiny_model, tmp_path)
    (folder / missing).unlink()
    with pytest.raises(ModelLoadError, match=match):
        engine_for(folder)


def test_missing_weight_is_named(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_of(tiny_model, tmp_path)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        engine_for(folder)


def test_unsupported_device_settings(tiny_model):
    folder = tiny_model("gqa16")
    with pytest.raises(ModelLoadError, match="float16.*not supported on CPU"):
        engine_for(folder, dtype="float16")
    with pytest.raises(ModelLoadError, match="max_model_len=1000 exceeds"):
        engine_for(folder, max_model_len=1000)
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            engine_for(folder, device="cuda")
        if not interpreting():  # tests/kernels may have set TRITON_INTERPRET=1
            with pytest.raises(AttentionBackendError, match="needs a CUDA device"):
                engine_for(folder, attention_backend="triton")


def test_errors_are_engine_errors(tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        engine_for(tmp_path / "nope")


def test_default_model_missing_says_make_setup(monkeypatch, tmp_path):
    monkeypatch.setenv("KVOPS_DATA_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match="make setup"):
        resolve_model_path(None)


def test_gemma_layers_slide_by_config(tiny_model, tmp_path):
    """Which Gemma layers slide: config.json's layer_types, else the family's pattern
    (Gemma 2: every other layer; Gemma 3: five of every six, or sliding_window_pattern);
    Mistral and Phi-3 slide on every layer; the window never caps max_model_len."""
    folder = copy_of(tiny_model, tmp_path, "gemma3")
    assert read_model_folder(folder).args.layer_windows == (7, 7, 0)
    config = json.loads((folder / "config.json").read_text())
    del config["layer_types"]
    config["num_hidden_layers"] = 7
    (folder / "config.json").write_text(json.dumps(config))
    assert read_model_folder(folder).args.layer_windows == (7,) * 5 + (0, 7)
    edit_config(folder, sliding_window_pattern=3)
    assert read_model_folder(folder).args.layer_windows == (7, 7, 0, 7, 7, 0, 7)
    edit_config(folder, model_type="gemma2", sliding_window_pattern=None)
    assert read_model_folder(folder).args.layer_windows == (7, 0, 7, 0, 7, 0, 7)
    assert read_model_folder(tiny_model("phi3")).args.layer_windows == (11, 11)
    assert engine_for(tiny_model("mistral-window")).runner.max_model_len == 512


def test_models_that_are_not_served_are_named(tiny_model, tmp_path):
    folder = copy_of(tiny_model, tmp_path)
    edit_config(folder, model_type="gemma3")
    with pytest.raises(ModelLoadError, match="vision-language.*gemma3_text"):
        read_model_folder(folder)
    edit_config(folder, model_type="falcon")
    with pytest.raises(ModelLoadError, match="'falcon' is not supported.*qwen3.*gemma2"):
        read_model_folder(folder)
    edit_config(folder, model_type="llama", hidden_act="relu")
    with pytest.raises(ModelLoadError, match="hidden_act 'relu'"):
        read_model_folder(folder)


def test_longrope_rotates_past_the_original_length_by_the_long_factors(tiny_model):
    """Phi-3's LongRoPE: positions from original_max_position_embeddings on rotate by
    transformers' long-factor frequencies (what it uses once a sequence is that long),
    the earlier ones by the short factors; both scaled by its attention factor."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder = tiny_model("phi3-longrope")
    engine = engine_for(folder)
    table = engine.runner.model.ropes[0]  # [max_model_len, head_dim / 2]
    config = AutoConfig.from_pretrained(folder)
    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, scale = init(config, "cpu")
    long, _ = init(config, "cpu", seq_len=513)
    assert scale != 1.0 and not torch.equal(short, long)
    for pos, inv_freq in [(3, short), (511, short), (512, long), (1500, long)]:
        want = torch.polar(torch.full_like(inv_freq, scale), pos * inv_freq)
        torch.testing.assert_close(table[pos], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load(tiny_model, tmp_path, stored):
    """Checkpoints stored in bfloat16 or float16 (as most on the Hub are) are cast to the
    engine's dtype on load: float32 here gives transformers' tokens on the same file."""
    from transformers import AutoModelForCausalLM

    src = tiny_model("qwen3")
    folder = tmp_path / "half"
    AutoModelForCausalLM.from_pretrained(src, dtype=stored).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, folder / f)
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "pt") as st:
        assert st.get_tensor("model.embed_tokens.weight").dtype == stored
    prompts = random_prompts(SPECS["qwen3"].vocab_size, [9, 4], seed=3)
    out = engine_for(folder).generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                              ignore_eos=True))
    assert [o.output_token_ids for o in out] == hf_greedy(folder, prompts, 6)
