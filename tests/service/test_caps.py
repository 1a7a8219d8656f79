"""Per-user caps hold under concurrency: counted where the jobs are stored, in the same
transaction, so a burst of submissions cannot all pass on one count (the audit saw 10
to 18 of 20 accepted under a cap of 3). REST and /v1 alike, and together."""
import threading
from pathlib import Path

import pytest
import requests

from tests.support.stack import Stack

CAP = 3


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("capped")),
              env={"KVOPS_MAX_JOBS_PER_USER": str(CAP)})
    try:
        s.start_web()
        s.start_engine("capped", simulate=1, vocab_size=32000, num_gpu_blocks=256,
                       block_size=16, max_num_seqs=4, simulate_step_ms=50)
        yield s
    finally:
        s.stop()


def _rest(stack, out: list) -> None:
    out.append(stack.api("POST", "/api/jobs/", user="alice",
                         json={"prompt": "hold on", "max_tokens": 2000}))


def _v1(stack, out: list, streams: list) -> None:
    answer = requests.post(f"{stack.url}/v1/completions", stream=True, timeout=60,
                           headers={"Authorization": f"Bearer {stack.tokens['alice']}"},
                           json={"model": "simulated-v1", "prompt": "hold on",
                                 "max_tokens": 2000, "stream": True})
    out.append(answer)
    if answer.status_code == 200:
        streams.append(answer)


def _burst(stack, rest: int, v1: int) -> tuple[list, list]:
    answers, streams = [], []
    threads = [threading.Thread(target=_rest, args=(stack, answers)) for _ in range(rest)]
    threads += [threading.Thread(target=_v1, args=(stack, answers, streams))
                for _ in range(v1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, streams


def _end_all(stack, streams: list) -> None:
    for stream in streams:
        stream.close()  # a client that goes away cancels its job
    for job in stack.api("GET", "/api/jobs/?status=queued&mine=1", user="alice").json()["results"]:
        stack.api("POST", f"/api/jobs/{job['id']}/cancel/", user="alice")
    for job in stack.api("GET", "/api/jobs/?status=running&mine=1", user="alice").json()["results"]:
        stack.api("POST", f"/api/jobs/{job['id']}/cancel/", user="alice")

    def idle() -> bool:
        active = [j for j in stack.api("GET", "/api/jobs/?mine=1", user="alice").json()["results"]
                  if j["status"] in ("queued", "running")]
        return not active

    stack.wait(idle, "alice's jobs ended", 60)


@pytest.mark.parametrize("rest, v1", [(20, 0), (0, 20), (10, 10)])
def test_twenty_concurrent_submissions_under_a_cap_of_three_store_three(capped, rest, v1):
    answers, streams = _burst(capped, rest, v1)
    try:
        codes = sorted(a.status_code for a in answers)
        accepted = [c for c in codes if c in (200, 201)]
        assert len(accepted) == CAP and codes.count(429) == 20 - CAP, codes
        refused = next(a for a in answers if a.status_code == 429)
        assert f"KVOPS_MAX_JOBS_PER_USER={CAP}" in refused.text
        active = [j for j in capped.api("GET", "/api/jobs/?mine=1", user="alice").json()["results"]
                  if j["status"] in ("queued", "running")]
        assert len(active) == CAP
    finally:
        _end_all(capped, streams)
