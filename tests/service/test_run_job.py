"""The job task in this process, on a real engine loop (the simulator, thread core), the
worker's output processor, the database and the test session's Redis: whatever goes
wrong once a job is claimed, it ends and its engine request goes; a cancel that comes
between the claim and the submit is not lost."""
import pytest
from django.contrib.auth.models import User
from django.db import DatabaseError

from engine import EngineConfig
from kvops import live
from kvops.jobs import job_store
from kvops.worker import worker
from kvops.jobs.admission import create_job, create_jobs
from kvops.intake.intake import NewJob
from engine.serve.client import InprocClient
from kvops.intake.prompts import tokenizer_for
from kvops.stream.job_stream import StreamProducer
from kvops.models import Job
from kvops.worker.output_processor import OutputProcessor
from kvops.tasks import run_jobs

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture()
def engine_worker():
    """This process as an engine worker named `inproc` (what kvops.worker sets up, with
    the core on a thread)."""
    config = EngineConfig(name="inproc", simulate=True, simulate_tokenizer="bytes",
                                         vocab_size=1000, num_gpu_blocks=128,
                          simulate_step_ms=5)
    tokenizer = tokenizer_for(config)
    processor = OutputProcessor("inproc", StreamProducer(live.redis_client(), "inproc"),
                                tokenizer, lambda request_id: client.finish_request(request_id),
                                db_interval_s=0.05)
    client = InprocClient(config, processor)
    client.start()
    before = worker.install(worker.WorkerContext(client, processor, "run-job-stack"))
    try:
        yield client
    finally:
        worker.install(before).close()


def new_job(max_tokens: int) -> Job:
    owner, _ = User.objects.get_or_create(username="run-job-user")
    job = create_job(NewJob(owner, {"max_tokens": max_tokens,
                                                      "ignore_eos": True}, "a prompt",
                                              engine="inproc"))
    job.refresh_from_db()
    return job


def run(job: Job) -> str:
    """The task, as a worker runs it for this delivery (same task id)."""
    [outcome] = run_jobs.apply(args=[[job.pk]], task_id=job.celery_task_id).get()
    return outcome


def test_a_job_runs_to_its_end(engine_worker):
    job = new_job(8)
    assert run(job) == "finished"
    job.refresh_from_db()
    assert job.status == Job.Status.FINISHED and job.num_output_tokens == 8


def test_an_unexpected_error_after_the_claim_fails_the_job_and_aborts_its_request(
        engine_worker, monkeypatch):
    def broken(job_ids):  # the first read after the submit fails
        raise DatabaseError("disk I/O error")
    monkeypatch.setattr(job_store, "cancels_requested", broken)
    job = new_job(1000)
    assert run(job) == "failed"
    job.refresh_from_db()
    assert job.status == Job.Status.FAILED and "disk I/O error" in job.error
    # Its engine request was aborted: nothing runs on, no block is held.
    metrics = engine_worker.command("metrics", {})
    assert metrics["running"] == metrics["waiting"] == metrics["swapped"] == 0
    assert metrics["kv_usage"] == 0.0  # every block free again


def test_a_cancel_between_claim_and_submit_is_not_lost(engine_worker, monkeypatch):
    submit_many = engine_worker.submit_many

    def cancel_then_submit(items):
        # The owner cancels now: the job is running but its engine request does not exist
        # yet, so the abort cancel_job asks for has nothing to abort.
        for item in items:
            job_store.cancel_job(Job.objects.get(request_id=item.request_id))
        return submit_many(items)
    monkeypatch.setattr(engine_worker, "submit_many", cancel_then_submit)
    job = new_job(1000)  # seconds of steps, unless cancelled
    assert run(job) == "cancelled"
    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED


def test_jobs_admitted_together_run_as_one_task_and_each_ends_on_its_own(engine_worker):
    """A burst for one engine is one task (one delivery, one claim, one submit message);
    a job the engine refuses fails alone, and each job gets its own outcome."""
    owner, _ = User.objects.get_or_create(username="run-job-user")
    jobs = create_jobs([
        NewJob(owner, {"max_tokens": n, "ignore_eos": True}, prompt, engine="inproc")
        for prompt, n in (("first", 5), ("x" * 5000, 5), ("third", 9))])
    assert len({job.celery_task_id for job in jobs}) == 1
    outcomes = run_jobs.apply(args=[[job.pk for job in jobs]],
                              task_id=jobs[0].celery_task_id).get()
    assert outcomes == ["finished", "rejected", "finished"]
    for job in jobs:
        job.refresh_from_db()
    assert [job.status for job in jobs] == ["finished", "failed", "finished"]
    assert [job.num_output_tokens for job in (jobs[0], jobs[2])] == [5, 9]
    assert "prompt" in jobs[1].error
    # A second delivery of the same task (a redelivery) runs none of them again.
    again = run_jobs.apply(args=[[job.pk for job in jobs]],
                           task_id=jobs[0].celery_task_id).get()
    assert again == ["skipped"] * 3


def test_the_task_watches_the_deadline_from_the_jobs_start_as_a_moved_job_is_watched(
        engine_worker, monkeypatch):
    """One deadline per job (kvops/jobs/job_deadline.py): its start plus KVOPS_JOB_TIMEOUT_S,
    the one a moved-in job is watched to. A task whose wait begins long after its job's
    start (here: the claim's start set back past the timeout) gives it no more time: the
    job ends as timed out at once, its request aborted, instead of running to its end."""
    from datetime import timedelta

    from django.conf import settings

    claim_jobs = job_store.claim_jobs

    def claimed_long_ago(claims):
        jobs = claim_jobs(claims)
        for job in jobs:
            if job is not None:
                job.started_at -= timedelta(seconds=settings.KVOPS_JOB_TIMEOUT_S + 60)
                Job.objects.filter(pk=job.pk).update(started_at=job.started_at)
        return jobs
    monkeypatch.setattr(job_store, "claim_jobs", claimed_long_ago)
    job = new_job(1000)  # seconds of steps
    assert run(job) == "timeout"
    job.refresh_from_db()
    assert job.status == Job.Status.FAILED and "ran past" in job.error
    from kvops.jobs import job_deadline
    assert job_deadline.deadline(job) == job.started_at.timestamp() + settings.KVOPS_JOB_TIMEOUT_S
    metrics = engine_worker.command("metrics", {})
    assert metrics["running"] == metrics["waiting"] == 0 and metrics["kv_usage"] == 0.0
