"""An fp8 engine's page in headless Chromium against the real stack (uvicorn, an engine
worker running a tiny Llama with KVOPS_ENGINE_KV_CACHE_DTYPE=fp8_e4m3, Redis, SQLite):
the GPU map's caption says how the engine stores K/V, and the What if panel offers the
K/V dtype lever (a real model's engine; a simulated one has none)."""
from pathlib import Path

import pytest

from tests.models.tiny import SPECS, build_tiny_model
from tests.support.stack import Stack

playwright = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = build_tiny_model(SPECS["gqa16"], Path(tmp_path_factory.mktemp("models")))
    s = Stack(Path(tmp_path_factory.mktemp("fp8-browser")))
    try:
        s.start_web()
        s.start_engine("fp8", model=str(folder), device="cpu", dtype="float32",
                       attention_backend="torch", block_size=8, num_gpu_blocks=32,
                       num_cpu_blocks=0, kv_cache_dtype="fp8_e4m3", kv_cache_scales="head")
        yield s
    finally:
        s.stop()


def test_the_engine_page_says_how_k_v_is_stored(login, stack):
    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/fp8/")
    # 2 layers x K,V x 8 tokens x 2 KV heads x 16 dims x 1 byte
    page.wait_for_function("document.querySelector('#gpu-caption').textContent.includes('K/V')")
    caption = page.inner_text("#gpu-caption")
    assert "32 blocks of 8 tokens · fp8_e4m3 K/V (scales per KV head), 1 KiB a block" in caption
    assert page.locator("#wi-kv-cache-dtype").count() == 1
    assert "fp8_e4m3 (now)" in page.inner_text("#wi-kv-cache-dtype")
    assert not errors, errors
