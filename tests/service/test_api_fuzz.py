"""Schemathesis against /api/schema/ (every operation, authenticated as an operator), and
hand-picked nasty inputs: no 5xx, every refusal a clear 4xx."""
from pathlib import Path

import re
import subprocess
import sys

import pytest
import requests

from tests.support.stack import Stack


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("fuzz")))
    try:
        s.start_web()
        s.start_engine("fuzz", simulate=1, num_gpu_blocks=1024, max_num_seqs=32)
        yield s
    finally:
        s.stop()


def test_schemathesis_finds_no_5xx(fuzz_stack):
    """Every operation of /api/schema/, generated inputs, as an operator: the CLI's
    not_a_server_error check must pass (a 5xx answer fails it)."""
    st = Path(sys.executable).with_name("st")
    out = subprocess.run(
        [str(st), "run", f"{fuzz_stack.url}/api/schema/", "--url", fuzz_stack.url,
         "-H", f"Authorization: Token {fuzz_stack.tokens['admin']}",
         "--checks", "not_a_server_error", "--max-examples", "25",
         "--generation-deterministic", "--request-timeout", "30", "--continue-on-failure"],
        capture_output=True, text=True, timeout=900)
    report = out.stdout + out.stderr
    # The fuzzer called every operation, the engine's pause, drain and limits too: put
    # the engine back as the other tests need it.
    for action, body in (("resume", {}), ("undrain", {}),
                         ("limits", {"max_num_seqs": 32, "max_num_batched_tokens": 2048})):
        answer = fuzz_stack.api("POST", f"/api/engines/fuzz/{action}/", json=body)
        assert answer.status_code == 200, answer.text
    assert out.returncode == 0, report[-4000:]
    cases = re.search(r"(\d+) generated, (\d+) passed", report)
    assert cases and cases.group(1) == cases.group(2) and int(cases.group(1)) > 200, report[-2000:]


NASTY = [
    (b'{"prompt": "\xff\xfe not utf-8"}', "JSON"),
    (b'{"prompt": "' + b"a" * 3_000_000 + b'"}', None),  # over the body size limit
    (b'{"prompt": "x", "max_tokens": -5}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 1e308}', "max_tokens"),
    (b'{"prompt": "x", "seed": 99999999999999999999999999}', "seed"),
    (b'{"prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"prompt": "x", "priority": true}', "priority"),
    (b'[1, 2, 3]', "object"),
    (b'"just a string"', "object"),
    (b'', None),
]


@pytest.mark.parametrize("body, field", NASTY)
def test_nasty_bodies_are_4xx(fuzz_stack, body, field):
    r = requests.post(f"{fuzz_stack.url}/api/jobs/", data=body, timeout=60, headers={
        "Authorization": f"Token {fuzz_stack.tokens['admin']}",
        "Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if field:
        assert field in r.text


@pytest.mark.parametrize("prompt", [
    "\ud7ff\ue000 edges", "🧪 emoji 👩‍👩‍👧", "RTL \u202e txet", "e\u0301 combining",
    "\ufeff BOM", "\U0010ffff last code point", "line\r\nbreaks\ttabs",
])
def test_unicode_edge_cases_run(fuzz_stack, prompt):
    r = fuzz_stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": 3})
    assert r.status_code == 201, r.text
    job = fuzz_stack.wait_job(r.json()["id"])
    assert job["status"] == "finished" and job["prompt"] == prompt


def test_nul_is_refused(fuzz_stack):
    r = fuzz_stack.api("POST", "/api/jobs/", json={"prompt": "nul \u0000 inside"})
    assert r.status_code == 400 and "NUL characters" in r.json()["error"]["message"]


def test_lone_surrogate_is_refused(fuzz_stack):
    # JSON can spell a lone surrogate; no tokenizer can encode it.
    r = requests.post(f"{fuzz_stack.url}/api/jobs/", data=b'{"prompt": "bad \\ud800 half"}',
                      headers={"Authorization": f"Token {fuzz_stack.tokens['admin']}",
                               "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
