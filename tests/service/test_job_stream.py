"""The job stream's parts against a real Redis and database: the worker's output
processor (batched stream entries and database writes, fenced on the attempt), the web
side's hub (demultiplexing, gaps and Redis failures end listeners with an error), and the
text assembler."""
import asyncio
import json

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from engine import EngineConfig, LLMEngine, SamplingParams
from kvops import live
from kvops.jobs import job_store
from engine.outputs import CoreOutput
from kvops.stream.job_stream import (STREAM_KEY, StreamProducer, TextAssembler, decode_entry,
                                     state_update)
from kvops.models import Job
from kvops.worker import output_processor
from kvops.worker.output_processor import OutputProcessor
from kvops.stream.stream_hub import JobStreamHub, StreamError
from tests.support.wait import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def running_job(owner, attempt: int = 1) -> Job:
    job = Job.objects.create(owner=owner, prompt="p", status=Job.Status.RUNNING,
                             attempts=attempt, request_id=f"job-x-{attempt}", engine="e")
    job.request_id = f"job-{job.pk}-{attempt}"
    job.save(update_fields=["request_id"])
    return job


def stream_entries() -> list[dict]:
    return [decode_entry(fields) for _, fields in live.redis_client().xrange(STREAM_KEY)]


def test_text_assembler_places_pieces_from_two_sources():
    t = TextAssembler()
    t.add(1, 0, "hello")
    t.add(1, 9, " and more")  # past a hole
    assert t.text == "hello" and t.has_hole
    t.add(1, 0, "hello, wo")  # the database row, written past the hole
    assert t.text == "hello, wo and more" and not t.has_hole
    t.add(1, 3, "lo")  # a repeat changes nothing
    assert t.text == "hello, wo and more"
    assert not t.add(0, 0, "old attempt")
    t.add(2, 0, "new")  # a re-run starts afresh
    assert (t.attempt, t.text) == (2, "new")


def test_output_processor_streams_and_writes_every_job_in_batches():
    live.redis_client().delete(STREAM_KEY)
    owner = User.objects.create_user("u1")
    engine = LLMEngine(EngineConfig(simulate=True, simulate_tokenizer="bytes",
                                    vocab_size=1000, num_gpu_blocks=256),
                       detokenize=False)
    processor = OutputProcessor("e", StreamProducer(live.redis_client(), "e"),
                                engine.tokenizer, engine.finish_request, db_interval_s=0.05)
    jobs = [running_job(owner) for _ in range(5)]
    handles = [processor.track(j.pk, j.request_id, 1) for j in jobs]
    for i, job in enumerate(jobs):
        engine.add_request(job.request_id, f"prompt {i}", SamplingParams(max_tokens=10 + i))
    steps = 0
    while engine.has_unfinished_requests():
        processor.push(engine.step_core())
        steps += 1
    assert [h.wait(20) for h in handles] == ["finished"] * 5
    processor.close()
    for i, job in enumerate(jobs):
        job.refresh_from_db()
        assert job.status == "finished" and job.num_output_tokens == 10 + i
        assert job.started_at is None or job.first_token_at >= job.started_at
        assert len(job.output_token_ids) == 10 + i and job.first_token_at is not None
    entries = stream_entries()
    assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))
    assert len(entries) < 5 * steps  # batched: not one write per job per step
    for job in jobs:  # each job's pieces, in order, make its stored text
        mine = [u for e in entries for u in e["u"] if u["job"] == job.pk]
        text = TextAssembler()
        for u in mine:
            text.add(u["attempt"], u["offset"], u["text"])
        assert text.text == job.output_text and not text.has_hole
        assert mine[-1]["state"]["finished"] and mine[-1]["state"]["status"] == "finished"


def test_a_first_token_does_not_wait_for_the_flush_gap(monkeypatch, settings):
    """Flushes are spaced by the number of running jobs (here: an hour for one), but a
    job's first token leaves with the step that made it."""
    monkeypatch.setattr(output_processor, "MAX_FLUSH_GAP_S", 3600.0)
    settings.KVOPS_STREAM_UPDATES_PER_S = 1e-4
    live.redis_client().delete(STREAM_KEY)
    owner = User.objects.create_user("u9")
    engine = LLMEngine(EngineConfig(simulate=True, simulate_tokenizer="bytes",
                                    vocab_size=1000, num_gpu_blocks=256),
                       detokenize=False)
    processor = OutputProcessor("e", StreamProducer(live.redis_client(), "e"),
                                engine.tokenizer, engine.finish_request)

    def streamed(job) -> list[int]:  # the job's updates: its output tokens so far
        return [u["n"] for e in stream_entries() for u in e["u"] if u["job"] == job.pk]

    early, late = running_job(owner), running_job(owner)
    try:
        processor.track(early.pk, early.request_id, 1)
        engine.add_request(early.request_id, "one", SamplingParams(max_tokens=50))
        processor.push(engine.step_core())
        wait_until(lambda: streamed(early), "the first job's first token", 20,
                   until=lambda tokens: tokens == [1])
        processor.track(late.pk, late.request_id, 1)
        engine.add_request(late.request_id, "two", SamplingParams(max_tokens=50))
        processor.push(engine.step_core())  # early's second token, late's first
        wait_until(lambda: streamed(late), "the second job's first token", 20,
                   until=lambda tokens: tokens == [1])
        assert streamed(early) == [1, 2]  # its second token went in the same flush
    finally:
        processor.close()


def test_a_forked_job_ends_once_all_its_samples_have_and_a_dead_core_fails_it():
    """n > 1: the samples' outputs ('<request>/<i>') are followed; the job ends when the
    last sample does, with every sample's outcome; a failure reported for the parent's
    id (a core that died before any sample's output) fails the job, once."""
    owner = User.objects.create_user("u5")
    engine = LLMEngine(EngineConfig(simulate=True, simulate_tokenizer="bytes",
                                    vocab_size=1000, num_gpu_blocks=256),
                       detokenize=False)
    processor = OutputProcessor("e", StreamProducer(live.redis_client(), "e"),
                                engine.tokenizer, engine.finish_request, db_interval_s=0.05)
    forked, doomed = running_job(owner), running_job(owner)
    handle = processor.track(forked.pk, forked.request_id, 1, n=3)
    lost = processor.track(doomed.pk, doomed.request_id, 1, n=2)
    engine.add_request(forked.request_id, "fork", SamplingParams(max_tokens=6, n=3))
    engine.step_core()  # the parent's prefill: no output yet
    engine.abort(f"{forked.request_id}/1")  # one sample ends early
    while engine.has_unfinished_requests():
        processor.push(engine.step_core())
    assert handle.wait(20) == "finished"
    processor.fail([doomed.request_id], "the engine core process stopped")
    assert lost.wait(20) == "failed"
    processor.close()
    forked.refresh_from_db()
    doomed.refresh_from_db()
    assert [s["finish_reason"] for s in forked.samples] == ["length", "abort", "length"]
    assert len(forked.samples[0]["token_ids"]) == 6 and forked.num_output_tokens == 6
    assert forked.output_text == forked.samples[0]["text"] != ""
    assert doomed.status == "failed" and "core" in doomed.error


def test_a_stale_attempt_writes_nothing():
    owner = User.objects.create_user("u2")
    job = running_job(owner, attempt=2)
    fenced, unstored = job_store.record_progress([
        job_store.ProgressDelta(job.pk, f"job-{job.pk}-1", "stale", 5, 3, 0, 0),
        job_store.ProgressDelta(job.pk, job.request_id, "", 0, 3, 0, 0)])
    assert fenced == {f"job-{job.pk}-1"} and not unstored  # the stale attempt is told
    first = timezone.now()
    job_store.record_progress([job_store.ProgressDelta(job.pk, job.request_id, "fre", 1,
                                                     3, 0, 0, first)])
    job_store.record_progress([job_store.ProgressDelta(job.pk, job.request_id, "sh", 2,
                                                     3, 0, 0, timezone.now())])
    final = job_store.FinalState(job.pk, f"job-{job.pk}-1", "stale end", [1, 2], 3, 0, 0,
                                "length", None)
    assert job_store.finish_jobs([final]) == []
    job.refresh_from_db()
    assert (job.status, job.output_text, job.num_output_tokens) == ("running", "fresh", 2)
    assert job.first_token_at == first  # kept from the first write


def test_an_attempt_that_lost_its_job_stops_its_engine_request():
    """The job ran again elsewhere (this worker was thought dead): the next progress write
    finds the row fenced, and the processor stops the request and wakes its task."""
    owner = User.objects.create_user("u4")
    job = running_job(owner, attempt=1)
    stopped: list[str] = []
    processor = OutputProcessor("e", StreamProducer(live.redis_client(), "e"),
                                LLMEngine(EngineConfig(simulate=True, simulate_tokenizer="bytes",
                                                       vocab_size=1000,
                                                       num_gpu_blocks=64)).tokenizer,
                                stopped.append, db_interval_s=0.05)
    handle = processor.track(job.pk, job.request_id, 1, None)
    Job.objects.filter(pk=job.pk).update(request_id=f"job-{job.pk}-2", attempts=2)
    processor.push([CoreOutput(job.request_id, [5, 6], False, None, 3, 0, 0)])
    assert handle.wait(20) == "fenced"
    processor.close()
    assert stopped == [job.request_id]
    job.refresh_from_db()
    assert job.output_text == "" and job.request_id.endswith("-2")


@pytest.mark.asyncio
async def test_hub_delivers_in_order_and_ends_listeners_on_a_gap():
    from django.conf import settings
    hub = JobStreamHub(settings.REDIS_URL)
    a, b = await hub.subscribe(101), await hub.subscribe(102)
    producer = StreamProducer(live.redis_client(), "e1")
    await asyncio.to_thread(producer.send, [
        {"job": 101, "attempt": 1, "offset": 0, "text": "x", "n": 1},
        {"job": 102, "attempt": 1, "offset": 0, "text": "y", "n": 1}])
    await asyncio.to_thread(producer.send, [
        {"job": 101, "attempt": 1, "offset": 1, "text": "z", "n": 2}])
    got = []
    while len(got) < 2:
        got += await a.next_batch(10)
    assert [u["text"] for u in got] == ["x", "z"]
    assert [u["text"] for u in await b.next_batch(10)] == ["y"]
    producer.seq += 1  # an entry that never arrived
    await asyncio.to_thread(producer.send, [
        {"job": 102, "attempt": 1, "offset": 1, "text": "w", "n": 2}])
    with pytest.raises(StreamError, match="lost"):
        await b.next_batch(10)
    assert hub.num_gaps == 1
    a.close()
    b.close()
    assert hub.num_listeners == 0
    hub._task.cancel()


@pytest.mark.asyncio
async def test_a_listener_that_stops_reading_is_cut_off_and_its_owner_told():
    """Updates keep coming for a listener that has not asked for any in longer than the
    stall limit (its client's socket is full): it is cut off with an error and its
    on_cut_off runs once; a listener that keeps reading is not touched."""
    from django.conf import settings
    now = [0.0]
    hub = JobStreamHub(settings.REDIS_URL, stall_s=30, clock=lambda: now[0])
    stuck, reader = await hub.subscribe(201), await hub.subscribe(202)
    cut = []
    stuck.on_cut_off = lambda: cut.append(stuck.job_id)
    reader.on_cut_off = lambda: cut.append(reader.job_id)
    producer = StreamProducer(live.redis_client(), "e1")

    async def send(offset: int) -> None:
        await asyncio.to_thread(producer.send, [
            {"job": job, "attempt": 1, "offset": offset, "text": "x", "n": offset + 1}
            for job in (201, 202)])
        assert [u["offset"] for u in await reader.next_batch(10)] == [offset]

    for offset in range(3):  # the stuck one has updates waiting, but only 20 s went by
        await send(offset)
        now[0] += 10
    assert cut == [] and stuck.error is None
    now[0] += 11  # 31 s since it last asked
    await send(3)
    assert cut == [201]
    with pytest.raises(StreamError, match="read nothing for 30 s"):
        await stuck.next_batch(10)
    await send(4)  # nothing more is queued for it, and it is not told twice
    assert cut == [201] and reader.error is None
    stuck.close()
    reader.close()
    hub._task.cancel()


def test_a_stop_string_ends_the_job_in_the_worker_and_stops_the_engine_request():
    owner = User.objects.create_user("u3")
    config = EngineConfig(simulate=True, simulate_tokenizer="bytes",
                          vocab_size=1000, num_gpu_blocks=256)
    reference = LLMEngine(config).generate(["stop here"], SamplingParams(max_tokens=40))[0]
    stop = reference.text[22:27]  # a piece of what the request will say
    cut = reference.text[:reference.text.index(stop)]
    engine = LLMEngine(config, detokenize=False)
    stopped: list[str] = []
    processor = OutputProcessor("e", StreamProducer(live.redis_client(), "e"),
                                engine.tokenizer, stopped.append, db_interval_s=0.05)
    job = running_job(owner)
    handle = processor.track(job.pk, job.request_id, 1, [stop])
    engine.add_request(job.request_id, "stop here", SamplingParams(max_tokens=40, stop=[stop]))
    while engine.has_unfinished_requests():
        processor.push(engine.step_core())
        for request_id in stopped:  # between two steps, as the engine's loop does
            engine.finish_request(request_id)
        stopped.clear()
    assert handle.wait(20) == "finished"
    processor.close()
    job.refresh_from_db()
    assert (job.output_text, job.finish_reason) == (cut, "stop")
    assert job.num_output_tokens < 40  # cut at the stop, whatever the engine ran on to
    assert job.output_token_ids == reference.output_token_ids[:job.num_output_tokens]


def test_a_move_in_is_followed_only_from_the_engine_its_job_ran_on_and_fails_alone():
    """The destination's processor follows a request that moved in only if its job's row
    is the attempt that ran on the engine it came from (a claim of another engine's job is
    stopped, not followed); an arrival it cannot follow (its logprobs malformed) is
    stopped alone: another job's tokens in the same flush are streamed."""
    live.redis_client().delete(STREAM_KEY)
    owner = User.objects.create_user("u-moved")
    engine = LLMEngine(EngineConfig(simulate=True, simulate_tokenizer="bytes",
                                    vocab_size=1000, num_gpu_blocks=256), detokenize=False)
    stopped: list[str] = []
    processor = OutputProcessor("b", StreamProducer(live.redis_client(), "b"),
                                engine.tokenizer, stopped.append)
    bystander, claimed, broken = running_job(owner), running_job(owner), running_job(owner)

    def arrival(job, source: str, logprobs: list) -> CoreOutput:
        return CoreOutput(job.request_id, [7], False, None, 3, 0, 0, migration={
            "from": source, "job_id": str(job.pk), "output_token_ids": [5, 6],
            "output_logprobs": logprobs})

    def streamed(job) -> list[int]:
        return [u["n"] for e in stream_entries() for u in e["u"] if u["job"] == job.pk]

    try:
        processor.track(bystander.pk, bystander.request_id, 1)
        engine.add_request(bystander.request_id, "one", SamplingParams(max_tokens=50))
        processor.push([*engine.step_core(), arrival(claimed, "x", []),
                        arrival(broken, "e", [["not", "an entry"]])])
        wait_until(lambda: streamed(bystander), "the bystander's token", 20,
                   until=lambda tokens: tokens == [1])
        wait_until(lambda: sorted(stopped), "both arrivals stopped", 20,
                   until=lambda ids: ids == sorted([claimed.request_id, broken.request_id]))
        assert streamed(claimed) == [] and streamed(broken) == []
    finally:
        processor.close()


@pytest.mark.asyncio
async def test_a_stream_waits_for_a_rerun_to_catch_up_and_fails_only_if_it_departs():
    """A job that runs again (its engine died, in the middle of a move too) starts its text
    over. Its stream waits while the new text is a prefix of what it sent, sends only what
    goes beyond it, and ends cleanly; a re-run whose text departs from what was sent is
    the one case that ends the stream with an error."""
    from django.conf import settings
    from kvops.openai.sse import job_events
    from kvops.jobs import job_listener
    from kvops.jobs.job_listener import JobListener
    owner = await asyncio.to_thread(User.objects.create_user, "u-rerun")

    async def wait_for(condition) -> None:
        for _ in range(3000):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("condition not met")

    async def stream(rerun_text: str) -> str:
        job = await asyncio.to_thread(running_job, owner)
        hub = JobStreamHub(settings.REDIS_URL)
        listener = JobListener(await hub.subscribe(job.pk), job)
        producer = StreamProducer(live.redis_client(), "e1")
        events = job_events(listener, "cmpl-1", "m", 0, chat=False)
        body = []

        async def read() -> None:
            async for event in events:
                body.append(event)

        reader = asyncio.ensure_future(read())
        await asyncio.to_thread(producer.send, [
            {"job": job.pk, "attempt": 1, "offset": 0, "text": "Hello wor", "n": 3}])
        await wait_for(lambda: b"Hello wor" in b"".join(body))
        # the re-run: its first text is a prefix of what was sent, and the stream sees it
        # (a listener's updates are checked as soon as they are applied)
        await asyncio.to_thread(producer.send, [
            {"job": job.pk, "attempt": 2, "offset": 0, "text": rerun_text[:5], "n": 1}])
        await wait_for(lambda: listener.text.attempt == 2)
        await asyncio.to_thread(producer.send, [
            {"job": job.pk, "attempt": 2, "offset": 5, "text": rerun_text[5:], "n": 4}])
        job.attempts, job.output_text = 2, rerun_text
        job.status, job.finish_reason = Job.Status.FINISHED, "length"
        await asyncio.to_thread(producer.send, [
            state_update(job.pk, 2, job_store.job_payload(job))])
        await asyncio.wait_for(reader, 30)
        hub._task.cancel()
        return b"".join(body).decode()

    body = await stream("Hello world!")
    assert '"error"' not in body and body.endswith("data: [DONE]\n\n")
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in body.split("\n\n")
             if line.startswith("data: {")]
    assert "".join(texts) == "Hello world!" and texts[-1] == ""  # the finish chunk
    body = await stream("Hello there")  # departs after "Hello "
    assert "differs from what was streamed" in body and body.endswith("data: [DONE]\n\n")
    await asyncio.gather(*job_listener._background)  # its client was told: it is cancelled
    job = await asyncio.to_thread(Job.objects.filter(owner=owner).order_by("-pk").first)
    assert job.cancel_requested
