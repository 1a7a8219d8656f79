"""The disk tier on the engine page, in headless Chromium against the real stack
(uvicorn, a simulated engine worker with small GPU and CPU pools and a disk tier in a
temporary folder, Redis, SQLite): a prompt asked for twice, pushed off the GPU and the
CPU tier by other prompts (its blocks go to disk) and asked for once more (they come
back from disk); the page's disk tier panel shows the blocks it holds and its share of
the prompt tokens. Then its files are corrupted: the prompt misses them, and the page
warns of the failed checksums. tests/engine/test_disk_tier.py drives the same traffic
through the engine alone."""
import re
from pathlib import Path

import pytest

from tests.support.stack import Stack

playwright = pytest.importorskip("playwright.sync_api")
ENGINE = "dsk"
# the byte tokenizer: a character is a token; 32 tokens are 8 blocks of 4
PROMPT = "the prompt that goes to disk, ok"
BROKEN = "a prompt whose files go bad, ok!"
assert len(PROMPT) == len(BROKEN) == 32


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = Path(tmp_path_factory.mktemp("disk-tier-browser"))
    s = Stack(workdir)
    try:
        s.start_web()
        s.start_engine(ENGINE, simulate=1, block_size=4, num_gpu_blocks=16, num_cpu_blocks=12,
                       cpu_prefix_cache=1, disk_cache_dir=workdir / "disk",
                       max_num_batched_tokens=64)
        yield s
    finally:
        s.stop()


def run(stack, prompt: str) -> dict:
    r = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": 6,
                                              "engine": ENGINE})
    assert r.status_code == 201, r.text
    job = stack.wait_job(r.json()["id"])
    assert job["status"] == "finished", job
    return job


def metrics(stack) -> dict:
    return stack.api("GET", f"/api/engines/{ENGINE}/").json()["engine"]["metrics"]


def send_to_disk(stack, prompt: str, tag: str) -> None:
    """The prompt asked for twice (so that its blocks may go to disk), then pushed off
    the GPU and the CPU tier by 8 prompts asked for once (never written): its blocks
    are on disk only, written."""
    written = metrics(stack)["disk_cache_stored_blocks"]
    run(stack, prompt)
    run(stack, prompt)
    for i in range(8):
        run(stack, f"one-off prompt {tag}{i}, unrelated".ljust(32, "~"))
    stack.wait(lambda: metrics(stack)["disk_cache_stored_blocks"] >= written + 7,
               "its blocks written to disk", 30)


def test_the_disk_tier_panel_shows_blocks_and_hits(login, stack):
    engine = stack.api("GET", f"/api/engines/{ENGINE}/").json()["engine"]
    assert engine["config"]["disk_cache_dir"], engine["config"]
    send_to_disk(stack, PROMPT, "a")
    run(stack, PROMPT)  # back from disk
    stack.wait(lambda: metrics(stack)["disk_prefix_cache_hits"] > 0,
               "the engine's heartbeat counting disk hits", 30)

    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/{ENGINE}/")
    try:
        page.wait_for_function("""() => {
            const panel = document.querySelector('#disk-tier');
            const share = document.querySelector('#disk-stats [data-figure="hit-share"] b');
            const blocks = /^([\\d,]+) blocks?,/.exec(document.querySelector('#disk-caption').textContent);
            return !panel.hidden && blocks && Number(blocks[1].replace(/,/g, '')) > 0
                && share && parseFloat(share.textContent) > 0; }""")
    except playwright.TimeoutError:
        raise AssertionError("the disk tier panel: " + page.inner_text("#disk-tier")
                             + f"; metrics {metrics(stack)}") from None
    m = metrics(stack)
    caption = page.inner_text("#disk-caption")
    assert re.fullmatch(r"[\d,]+ blocks?, [\d.,]+ (B|KiB|MiB) of 10 GiB", caption), caption
    share = page.inner_text('#disk-stats [data-figure="hit-share"] b')
    want = 100 * m["disk_prefix_cache_hits"] / m["prefix_cache_queries"]
    assert abs(float(share.rstrip("%")) - want) < 0.1, (share, m)
    assert page.inner_text('#disk-stats [data-figure="checksum"] b') == "0"
    assert page.locator("#tier-health").is_hidden()  # (no checksum failure; minutes too few to judge)
    assert not errors, errors


def test_failed_checksums_are_a_warning(login, stack):
    send_to_disk(stack, BROKEN, "b")
    files = sorted((stack.workdir / "disk").glob("**/*.blk"))
    assert files
    for path in files:  # one flipped bit in each block's payload
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    run(stack, BROKEN)  # its first block on disk fails its checksum: computed instead
    stack.wait(lambda: metrics(stack)["disk_cache_checksum_failures"] > 0,
               "the engine's heartbeat counting a failed checksum", 30)
    failures = metrics(stack)["disk_cache_checksum_failures"]

    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/{ENGINE}/")
    warning = page.locator('#tier-health li.checksum[data-tier="disk"]')
    warning.wait_for()
    blocks = "1 block failed its checksum" if failures == 1 else \
        f"{failures:,} blocks failed their checksum"
    assert warning.inner_text() == \
        f"disk tier: {blocks} (misses, deleted): the disk or its files may be going bad"
    assert page.locator("#tier-health").is_visible()
    page.wait_for_function("""(n) => document.querySelector(
        '#disk-stats [data-figure="checksum"] b')?.textContent === n""", arg=f"{failures:,}")
    assert not errors, errors
