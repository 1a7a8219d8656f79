"""An engine worker started with KVOPS_ENGINE_KV_CACHE_DTYPE=fp8_e4m3 (as `make run`
passes its configuration) on a tiny Llama, through the real stack: its jobs answer as
the same fp8 engine does in-process, its registered configuration and /metrics say how
it stores K/V, and a disk tier straight below its GPU pool serves a prompt it let go."""
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.text.tokenizer import HFTokenizer
from tests.models.tiny import SPECS, build_tiny_model
from tests.support.stack import Stack

pytestmark = pytest.mark.stack

CONFIG = dict(device="cpu", dtype="float32", attention_backend="torch", block_size=8,
              num_gpu_blocks=24, num_cpu_blocks=0, max_num_seqs=8, kv_cache_dtype="fp8_e4m3")


@pytest.fixture(scope="module")
def fp8_stack(tmp_path_factory):
    folder = build_tiny_model(SPECS["gqa16"], Path(tmp_path_factory.mktemp("models")))
    disk = tmp_path_factory.mktemp("disk")
    s = Stack(Path(tmp_path_factory.mktemp("fp8-stack")))
    try:
        s.start_web()
        s.start_engine("fp8", model=str(folder), disk_cache_dir=str(disk), **CONFIG)
        s.model_folder = folder
        yield s
    finally:
        s.stop()


def prompt(seed: int) -> str:
    return " ".join(f"w{(seed * 37 + i * 11) % 150 + 3}" for i in range(40))


def test_an_fp8_engine_through_the_service(fp8_stack):
    s = fp8_stack
    engine = s.api("GET", "/api/engines/fp8/").json()["engine"]
    config = engine["config"]
    assert config["kv_cache_dtype"] == "fp8_e4m3" and config["kv_cache_scales"] == "tensor"
    assert config["kv_format"].startswith("float8_e4m3fn/tensor:")
    assert config["disk_cache_dir"] and config["num_cpu_blocks"] == 0
    # a quarter of float32's bytes: layers x K,V x block x heads x dim x 1 byte
    spec = SPECS["gqa16"]
    head_dim = spec.hidden_size // spec.num_heads
    assert config["kv_bytes_per_block"] == spec.num_layers * 2 * 8 * spec.num_kv_heads * head_dim
    metrics = s.api("GET", "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("kvops:cache_config_info{")
                and 'engine="fp8"' in x)
    assert 'cache_dtype="fp8_e4m3"' in line

    # the job's tokens are those of the same fp8 engine run here
    first = prompt(1)
    r = s.api("POST", "/api/jobs/", json={"prompt": first, "max_tokens": 8, "temperature": 0,
                                          "ignore_eos": True})
    assert r.status_code == 201, r.text
    job = s.wait_job(r.json()["id"], timeout_s=120)
    assert job["status"] == "finished", job["error"]
    local = LLMEngine(EngineConfig(model=str(s.model_folder), **CONFIG))
    ids = HFTokenizer.from_folder(s.model_folder).encode(first)
    want = local.generate([ids], SamplingParams(max_tokens=8, temperature=0.0,
                                                ignore_eos=True))[0].output_token_ids
    assert job["output_token_ids"] == want

    # asked for again (so the disk takes it), then pushed off the 24-block GPU pool by
    # others: it comes back from the disk below the GPU
    again = s.wait_job(s.api("POST", "/api/jobs/", json={
        "prompt": first, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()["id"])
    assert again["num_cached_tokens"] > 0
    for seed in range(2, 6):
        other = s.wait_job(s.api("POST", "/api/jobs/", json={
            "prompt": prompt(seed), "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}).json()["id"])
        assert other["status"] == "finished", other["error"]
    back = s.wait_job(s.api("POST", "/api/jobs/", json={
        "prompt": first, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()["id"])
    assert back["output_token_ids"] == want and back["num_cached_tokens"] >= 32
    # (the GPU may still hold its first blocks: the disk serves those it let go)
    s.wait(lambda: (s.api("GET", "/api/engines/fp8/").json()["engine"]["metrics"]
                    .get("disk_prefix_cache_hits") or 0) > 0, "disk hits in the metrics", 30)
    m = s.api("GET", "/api/engines/fp8/").json()["engine"]["metrics"]
    assert m["disk_tier_below"] == "gpu"
