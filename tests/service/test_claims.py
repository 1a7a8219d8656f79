"""job_store.claim_jobs: which delivery runs which job. Queued jobs of the delivery's task
are claimed by one UPDATE per task id; every other case is judged row by row. Both must
leave a job in the same state, and the verdicts must hold in a batch that mixes them."""
import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from kvops.jobs import job_store
from kvops.models import Engine, Job

pytestmark = pytest.mark.django_db(transaction=True)

LIVE, DEAD = "worker-live", "worker-dead"


@pytest.fixture
def owner():
    Engine.objects.create(name="live", worker="w@h", instance=LIVE,
                          status=Engine.Status.READY, last_heartbeat=timezone.now())
    return User.objects.create(username="claims")


def job(owner, task_id="task-a", **fields) -> Job:
    return Job.objects.create(owner=owner, prompt="p", params={"max_tokens": 4},
                              celery_task_id=task_id, **fields)


def claim(*pairs) -> list[Job | None]:
    """Claims of (job, task id) by the live worker, in one call."""
    return job_store.claim_jobs([job_store.Claim(j.pk, "eng", LIVE, task_id)
                                for j, task_id in pairs])


def assert_claimed(got: Job | None, expected: Job, attempts: int) -> None:
    assert got is not None and got.pk == expected.pk
    row = Job.objects.get(pk=expected.pk)
    for j in (got, row):
        assert (j.status, j.attempts, j.engine, j.engine_instance, j.request_id) == (
            Job.Status.RUNNING, attempts, "eng", LIVE, f"job-{expected.pk}-{attempts}")
        assert j.started_at is not None and j.first_token_at is None
        assert (j.output_text, j.output_token_ids, j.samples, j.output_logprobs,
                j.prompt_logprobs, j.finish_reason, j.error) == ("", [], [], [], [], "", "")
        assert (j.num_output_tokens, j.num_cached_tokens, j.num_preemptions) == (0, 0, 0)
        assert j.kv_story is None and j.engines == []  # (an earlier attempt's moves)
    assert got.owner.username == "claims"  # loaded: the worker reads its cache salt


def test_queued_jobs_of_the_task_are_claimed_once(owner):
    a, b = job(owner), job(owner)
    got = claim((a, "task-a"), (b, "task-a"), (a, "task-a"))  # a delivered twice
    assert_claimed(got[0], a, 1)
    assert_claimed(got[1], b, 1)
    assert got[2] is None
    assert claim((a, "task-a"), (b, "task-a")) == [None, None]  # a redelivery


def test_a_rerun_starts_clean_whichever_path_claims_it(owner):
    # its previous attempt moved from one engine to another while it ran, told its KV
    # story, and produced output
    leftovers = dict(attempts=1, output_text="old", output_token_ids=[1, 2],
                     finish_reason="length", error="old error", num_output_tokens=2,
                     num_cached_tokens=5, num_preemptions=1, first_token_at=timezone.now(),
                     samples=[{"text": "old"}], output_logprobs=[[1, -0.5, []]],
                     prompt_logprobs=[None], kv_story={"cached_tokens": {"gpu": 16}},
                     engines=[{"engine": "a", "at": "2026-01-01T00:00:00+00:00",
                               "reason": "start"},
                              {"engine": "b", "at": "2026-01-01T00:00:05+00:00",
                               "reason": "migration"}])
    requeued = job(owner, task_id="task-b", **leftovers)  # queued again after a failure
    orphan = job(owner, task_id="task-c", status=Job.Status.RUNNING,
                 engine_instance=DEAD, **leftovers)  # its worker died
    got = claim((requeued, "task-b"), (orphan, "task-c"))
    assert_claimed(got[0], requeued, 2)
    assert_claimed(got[1], orphan, 2)
    # the two paths (one UPDATE for the queued, row by row for the orphan) leave the
    # same row, but for what names the job and its attempt
    own = {"id", "celery_task_id", "request_id", "started_at", "queued_at"}
    rows = [Job.objects.filter(pk=j.pk).values().get() for j in (requeued, orphan)]
    assert {k: v for k, v in rows[0].items() if k not in own} == \
        {k: v for k, v in rows[1].items() if k not in own}


def test_deliveries_that_must_not_run_their_job(owner):
    stale = job(owner, task_id="task-new")  # re-dispatched under a new task id
    running = job(owner, status=Job.Status.RUNNING, engine_instance=LIVE, attempts=1,
                  request_id="r")
    finished = job(owner, status=Job.Status.FINISHED, attempts=1)
    got = claim((stale, "task-old"), (running, "task-a"), (finished, "task-a"))
    assert got == [None, None, None]
    assert Job.objects.get(pk=stale.pk).status == Job.Status.QUEUED
    assert Job.objects.get(pk=running.pk).request_id == "r"
    assert Job.objects.get(pk=finished.pk).status == Job.Status.FINISHED


def test_a_cancelled_job_or_one_out_of_attempts_ends_at_its_claim(owner):
    cancelled = job(owner, cancel_requested=True)
    worn = job(owner, attempts=job_store.MAX_ATTEMPTS)
    fresh = job(owner)
    got = claim((cancelled, "task-a"), (worn, "task-a"), (fresh, "task-a"))
    assert got[:2] == [None, None]
    assert_claimed(got[2], fresh, 1)
    cancelled.refresh_from_db()
    worn.refresh_from_db()
    assert (cancelled.status, cancelled.error) == (Job.Status.CANCELLED,
                                                   "cancelled before it started")
    assert worn.status == Job.Status.FAILED and "gave up" in worn.error
    assert cancelled.finished_at is not None and worn.finished_at is not None


def test_a_delivery_without_a_task_id_claims_its_queued_job(owner):
    a = job(owner, task_id="")
    [got] = claim((a, ""))
    assert_claimed(got, a, 1)


def test_an_unknown_job_is_not_claimed(owner):
    a = job(owner)
    ghost = Job(pk=a.pk + 1000)
    assert claim((ghost, "task-a"), (a, "task-a"))[0] is None


def test_a_job_delivered_twice_to_a_worker_not_yet_live_runs_once(owner):
    a = job(owner)
    got = job_store.claim_jobs([job_store.Claim(a.pk, "eng", "worker-new", "task-a")] * 2)
    assert got[0] is not None and got[1] is None
    assert Job.objects.get(pk=a.pk).attempts == 1
