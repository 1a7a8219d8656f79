"""Streams at an engine's pace: many concurrent /v1 streams on the simulator paced like a
GPU step, through the job stream. Correctness only (every stream ends, in order, equal to
its unstreamed answer); the speed is measured by `python -m benchmarks.bench_serve`."""
import asyncio
import random
import socket
from urllib.parse import urlparse

import openai
import pytest

from tests.support.stack import Stack
from benchmarks.sse_client import completion_request, stream_completion
from tests.service.test_jobs_api import expected_text

STREAMS = 256
MODEL = "simulated-v1"


@pytest.fixture(scope="module")
def gpu_paced(tmp_path_factory):
    """A stack whose simulated engine steps every 10 ms and batches 256 requests."""
    s = Stack(tmp_path_factory.mktemp("paced"))
    try:
        s.start_web()
        s.start_engine("paced", threads=STREAMS + 16, simulate=1, vocab_size=32000,
                       simulate_step_ms=10, max_num_seqs=STREAMS, num_gpu_blocks=16384,
                       max_num_batched_tokens=8192)
        yield s
    finally:
        s.stop()


def prompts(n: int) -> list[tuple[str, int]]:
    rng = random.Random(n)
    return [(f"stream {i}: " + "lorem ipsum " * rng.randint(1, 5), rng.randint(8, 40))
            for i in range(n)]


def test_256_concurrent_streams_each_equal_its_unstreamed_answer(gpu_paced):
    work = prompts(STREAMS)

    async def streamed(client: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, str]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def unstreamed(client: openai.AsyncOpenAI, prompt: str, n: int) -> str:
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                            temperature=0)
        return r.choices[0].text

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{gpu_paced.url}/v1",
                                    api_key=gpu_paced.tokens["alice"], max_retries=0,
                                    timeout=180)
        got = await asyncio.gather(*[streamed(client, p, n) for p, n in work])
        answers = await asyncio.gather(*[unstreamed(client, p, n) for p, n in work])
        await client.close()
        return got, answers

    got, answers = asyncio.run(main())
    for (prompt, n), (text, finish), answer in zip(work, got, answers):
        assert finish == "length"
        assert text == answer == expected_text(prompt, n), prompt


def test_a_client_that_disconnects_cancels_its_job_and_frees_its_blocks(gpu_paced):
    async def main():
        url = urlparse(gpu_paced.url)
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        writer.write(completion_request(gpu_paced.url, gpu_paced.tokens["alice"], {
            "model": MODEL, "prompt": "leave early", "max_tokens": 3000, "ignore_eos": True}))
        await writer.drain()
        seen = b""
        while seen.count(b"data: ") < 3:  # it streams
            seen += await reader.read(4096)
        writer.close()
        return seen

    seen = asyncio.run(main())
    job_id = int(seen.split(b'"id":"cmpl-', 1)[1].split(b'"', 1)[0])
    job = {}

    def ended() -> bool:
        job.update(gpu_paced.api("GET", f"/api/jobs/{job_id}/").json())
        return job["status"] in ("cancelled", "finished", "failed")

    gpu_paced.wait(ended, f"job {job_id} to end", 60)
    assert job["status"] == "cancelled", job
    assert job["num_output_tokens"] < 3000

    def blocks_freed() -> bool:  # the stored snapshot is refreshed about once a second
        snapshot = gpu_paced.api("GET", "/api/engines/paced/").json()["snapshot"]
        return snapshot["seq"] > seq_at_end and not any(
            r["block_table"] for r in snapshot["requests"]
            if r["request_id"] == job["request_id"])

    seq_at_end = gpu_paced.api("GET", "/api/engines/paced/").json()["snapshot"]["seq"]
    gpu_paced.wait(blocks_freed, "the cancelled job's blocks to be freed", 30)


def test_a_client_that_stops_reading_does_not_hold_up_the_others(gpu_paced):
    """One client asks for a long stream and never reads it; the socket buffers take its
    output and the other streams run at full pace. (Once its socket is full and it has
    read nothing for KVOPS_STREAM_STALL_S, it is cut off and its job cancelled: tested on
    the hub in test_job_stream.py, as filling a loopback socket's megabytes takes minutes.)"""
    async def main():
        url = urlparse(gpu_paced.url)
        stuck = socket.create_connection((url.hostname, url.port))
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.sendall(completion_request(gpu_paced.url, gpu_paced.tokens["alice"], {
            "model": MODEL, "prompt": "never read", "max_tokens": 2000, "ignore_eos": True}))
        try:
            others = await asyncio.gather(*[
                stream_completion(gpu_paced.url, gpu_paced.tokens["alice"],
                                  {"model": MODEL, "prompt": p, "max_tokens": n,
                                   "temperature": 0})
                for p, n in prompts(32)])
        finally:
            stuck.close()
        return others

    others = asyncio.run(main())
    for (prompt, n), result in zip(prompts(32), others):
        assert result.error is None and result.done, result.error
        assert result.text == expected_text(prompt, n)
