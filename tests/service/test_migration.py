"""Moving running requests between engines on the real stack (web, two engine workers,
their cores talking over ZMQ): an operator's move keeps the client's /v1 stream whole
(no gap, no repeat, one [DONE]) and the job records both engines; the API's refusals;
a drain by migration moves eight running requests, none started again."""
from __future__ import annotations

import threading
import uuid
from pathlib import Path

import openai
import pytest

from tests.service.test_jobs_api import expected_text
from tests.support.stack import Stack

MODEL = "simulated-v1"
SIM = dict(simulate=1, vocab_size=32000, block_size=16, num_gpu_blocks=512, num_cpu_blocks=0,
           max_num_seqs=16, simulate_step_ms=20)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("migration")))
    try:
        s.start_web()
        for name in ("a", "b"):
            s.start_engine(name, **SIM)
        yield s
    finally:
        s.stop()


def engine_row(stack, name: str) -> dict:
    return next(e for e in stack.api("GET", "/api/engines/").json()
                if e["name"] == name)


def streaming_job(stack, prompt: str, tokens: int) -> dict:
    """Alice's job of this prompt, once it runs and has made `tokens` tokens."""
    job: dict = {}

    def streaming() -> bool:
        jobs = stack.api("GET", "/api/jobs/", user="alice").json()["results"]
        job.update(next((j for j in jobs if j["prompt"] == prompt), {}))
        return job.get("status") == "running" and job.get("num_output_tokens", 0) >= tokens

    stack.wait(streaming, f"its job to make {tokens} tokens", 30)
    return job


def other(name: str) -> str:
    return "b" if name == "a" else "a"


def test_an_operators_move_keeps_the_clients_stream_whole(stack):
    prompt, n = "A request that moves between engines while it streams. " * 3, 150
    chunks: list[str] = []
    finishes: list[str | None] = []
    done = threading.Event()
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.tokens["alice"],
                                   max_retries=0, timeout=120)
            for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                                   temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True}):
                chunks.append(chunk.choices[0].text)
                finishes.append(chunk.choices[0].finish_reason)
        except BaseException as e:  # noqa: BLE001  (the test reads it)
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=stream, daemon=True).start()
    job = streaming_job(stack, prompt, 20)
    source, rid = job["engine"], job["request_id"]
    r = stack.api("POST", f"/api/engines/{source}/requests/{rid}/migrate/",
                  json={"to": other(source)}, headers={"Idempotency-Key": uuid.uuid4().hex})
    assert r.status_code == 200, r.text
    moved = r.json()["result"]
    assert moved["moved"] and moved["to"] == other(source) and moved["blocks_sent"] >= 4
    assert moved["blocks_at_stop"] <= 3  # the rest went while it ran
    assert done.wait(60) and not errors, errors
    text = "".join(chunks)
    assert text == expected_text(prompt, n)  # no gap, no repeat
    assert [f for f in finishes if f] == ["length"]
    final = stack.wait_job(job["id"], user="alice")
    assert final["output_text"] == text and final["attempts"] == 1
    assert final["engine"] == other(source)
    assert [(e["engine"], e["reason"]) for e in final["engines"]] == \
        [(source, "start"), (other(source), "migration")]
    story = stack.api("GET", f"/api/jobs/{job['id']}/kv/", user="alice").json()
    [hop] = story["moves"]
    assert hop["from"] == source and hop["blocks_sent"] >= 1 and story["preemptions"] == []
    assert story["engine"] == other(source)
    log = stack.api("GET", "/api/actions/").json()["results"]
    assert any(a["action"] == "migrate" and a["target"] == rid and a["ok"] for a in log)


def test_a_fork_moves_with_its_samples_and_each_stream_stays_whole(stack):
    """n=3: the three samples move in one commit; each choice's stream goes on."""
    prompt, n = "Three samples that move together. " * 3, 120
    texts = {i: "" for i in range(3)}
    finishes: list[tuple[int, str]] = []
    done = threading.Event()
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.tokens["alice"],
                                   max_retries=0, timeout=120)
            for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                                   n=3, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True}):
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
                    if choice.finish_reason:
                        finishes.append((choice.index, choice.finish_reason))
        except BaseException as e:  # noqa: BLE001  (the test reads it)
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=stream, daemon=True).start()
    job = streaming_job(stack, prompt, 10)
    source = job["engine"]
    r = stack.api("POST", f"/api/engines/{source}/requests/{job['request_id']}/migrate/",
                  json={"to": other(source)})
    assert r.status_code == 200, r.text
    assert r.json()["result"]["staged"] is False  # (a fork moves in one stop-and-copy)
    assert done.wait(60) and not errors, errors
    for i in range(3):
        assert texts[i] == expected_text(prompt, n), i
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]
    final = stack.wait_job(job["id"], user="alice")
    assert [s["text"] for s in final["samples"]] == [expected_text(prompt, n)] * 3
    assert [e["engine"] for e in final["engines"]] == [source, other(source)]


def run_long(stack, prompt: str, engine: str, n: int = 200) -> dict:
    r = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": n,
                                              "engine": engine, "ignore_eos": True})
    assert r.status_code == 201, r.text
    return r.json()


def test_a_raw_stream_through_a_move_has_one_done(stack):
    """The bytes on the wire: every chunk in order, the text whole, one finish and one
    `data: [DONE]`, however the two producers' updates crossed."""
    import json

    import requests
    prompt, n = "Raw bytes through a move. " * 3, 100
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "stream": True, "ignore_eos": True}
    lines: list[str] = []

    def read() -> None:
        with requests.post(f"{stack.url}/v1/completions", json=body, stream=True, timeout=120,
                           headers={"Authorization": f"Bearer {stack.tokens['alice']}"}) as r:
            lines.extend(line for line in r.iter_lines(decode_unicode=True) if line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    job = streaming_job(stack, prompt, 10)
    r = stack.api("POST", f"/api/engines/{job['engine']}/requests/{job['request_id']}/migrate/",
                  json={"to": other(job["engine"])})
    assert r.status_code == 200, r.text
    reader.join(60)
    assert not reader.is_alive()
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(prompt, n)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] \
        == ["length"]


def test_what_cannot_move_is_refused_with_the_reason(stack):
    job = run_long(stack, "a long one to refuse moves of", "a", n=300)
    rid = stack.wait_running(job["id"])
    url = f"/api/engines/a/requests/{rid}/migrate/"
    assert stack.api("POST", "/api/engines/zz/requests/x/migrate/",
                     json={"to": "b"}).status_code == 404
    r = stack.api("POST", "/api/engines/a/requests/nope/migrate/", json={"to": "b"})
    assert r.status_code == 404, r.text
    r = stack.api("POST", url, json={})
    assert r.status_code == 400 and "to" in r.json()["error"]["fields"]
    r = stack.api("POST", url, json={"to": "zz"})
    assert r.status_code == 400 and "no engine is named" in r.json()["error"]["message"]
    r = stack.api("POST", url, json={"to": "a"})
    assert r.status_code == 400 and "already runs" in r.json()["error"]["message"]
    assert stack.api("POST", url, json={"to": "b"}, user="alice").status_code == 403
    assert stack.api("POST", "/api/engines/b/pause/").status_code == 200
    try:
        r = stack.api("POST", url, json={"to": "b"})
        assert r.status_code == 409 and "paused" in r.json()["error"]["message"], r.text
    finally:
        assert stack.api("POST", "/api/engines/b/resume/").status_code == 200
    # an Idempotency-Key: the move happens once, the retry gets the first answer
    key = {"Idempotency-Key": uuid.uuid4().hex}
    first = stack.api("POST", url, json={"to": "b"}, headers=key)
    again = stack.api("POST", url, json={"to": "b"}, headers=key)
    assert first.status_code == again.status_code == 200, first.text
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.json() == first.json()
    # moved: on b now, and not on a
    r = stack.api("POST", f"/api/engines/a/requests/{rid}/migrate/", json={"to": "b"})
    assert r.status_code == 409 and "moved to another engine" in r.json()["error"]["message"], r.text
    assert stack.api("POST", f"/api/jobs/{job['id']}/cancel/").status_code in (200, 202)
    final = stack.wait_job(job["id"])
    assert final["status"] == "cancelled" and final["engine"] == "b"


def test_a_drain_by_migration_moves_every_running_request(stack):
    prompts = [f"drain me {i}: " + "words to carry over " * (1 + i % 3) for i in range(8)]
    jobs = [run_long(stack, p, "a", n=120) for p in prompts]
    for job in jobs:
        stack.wait_running(job["id"])
    stack.wait(lambda: all(stack.api("GET", f"/api/jobs/{j['id']}/").json()["num_output_tokens"]
                           >= 5 for j in jobs), "all eight to stream", 30)
    r = stack.api("POST", "/api/engines/a/drain/", json={"mode": "migrate"})
    assert r.status_code == 200, r.text
    assert r.json()["result"]["mode"] == "migrate" and r.json()["result"]["to"] == ["b"]
    try:
        finals = [stack.wait_job(j["id"], timeout_s=90) for j in jobs]
        for prompt, final in zip(prompts, finals):
            assert final["status"] == "finished" and final["attempts"] == 1
            assert final["output_text"] == expected_text(prompt, 120), prompt
            assert [e["engine"] for e in final["engines"]] == ["a", "b"]
            story = stack.api("GET", f"/api/jobs/{final['id']}/kv/").json()
            assert len(story["moves"]) == 1 and story["moves"][0]["from"] == "a"
        stack.wait(lambda: engine_row(stack, "a")["state"] == "drained", "a drained", 30)
        log = stack.api("GET", "/api/actions/").json()["results"]
        drained = [a for a in log if a["action"] == "migrate" and a["params"].get("by") == "drain"]
        assert {a["target"] for a in drained if a["ok"]} >= {f["request_id"] for f in finals}
    finally:
        assert stack.api("POST", "/api/engines/a/undrain/").status_code == 200


def test_a_drain_with_a_bad_mode_or_nowhere_to_go_is_refused(stack):
    r = stack.api("POST", "/api/engines/a/drain/", json={"mode": "sideways"})
    assert r.status_code == 400
    r = stack.api("POST", "/api/engines/a/drain/", json={"mode": "wait", "to": "b"})
    assert r.status_code == 400
    r = stack.api("POST", "/api/engines/a/drain/", json={"mode": "migrate", "to": "zz"})
    assert r.status_code == 400, r.text
    assert engine_row(stack, "a")["state"] == "ready"  # refused before it drained


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """A prefill engine and a decode engine (KVOPS_ENGINE_ROLE)."""
    s = Stack(Path(tmp_path_factory.mktemp("prefill-decode")))
    try:
        s.start_web()
        s.start_engine("p", role="prefill", **SIM)
        s.start_engine("d", role="decode", **SIM)
        yield s
    finally:
        s.stop()


def test_a_prefill_engine_hands_each_request_to_a_decode_engine(split):
    """The router sends the job to the prefill engine and pairs it with the decode engine;
    its first token comes from the one, the rest from the other, in one whole stream."""
    client = openai.OpenAI(base_url=f"{split.url}/v1", api_key=split.tokens["alice"],
                           max_retries=0, timeout=120)
    prompts = [f"prefill here, decode there ({i}). " * 4 for i in range(3)]
    for prompt in prompts:
        text, finishes = "", []
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=60,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text
            finishes.append(chunk.choices[0].finish_reason)
        assert text == expected_text(prompt, 60)
        assert [f for f in finishes if f] == ["length"]
    jobs = split.api("GET", "/api/jobs/", user="alice").json()["results"][:3]
    for job in jobs:
        assert job["routing"]["engine"] == "p" and job["routing"]["decode_engine"] == "d"
        assert [(e["engine"], e["reason"]) for e in job["engines"]] == \
            [("p", "start"), ("d", "decode")], job["engines"]
        assert job["engine"] == "d" and job["attempts"] == 1
    # the decode engine takes no routed job while the prefill engine runs
    r = split.api("POST", "/api/jobs/", json={"prompt": "routed", "max_tokens": 3})
    assert split.wait_job(r.json()["id"])["routing"]["engine"] == "p"
