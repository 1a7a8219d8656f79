"""Accepted means it ends: a job whose task could not be sent (the broker away at its
commit, or the web process dead before the send) is stored all the same, and the
reaper's outbox pass sends it. Against a real database and the test session's Redis."""
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from kombu.exceptions import OperationalError

from kvops import live
from kvops.jobs import outbox
from kvops.jobs.admission import create_job
from kvops.intake.intake import NewJob
from kvops.jobs.reaper import reap
from kvops.models import Job

pytestmark = pytest.mark.django_db(transaction=True)


def queued_messages(queue: str) -> list[str]:
    """The raw task messages waiting in a broker queue (kombu keeps a Redis list)."""
    return [raw.decode() for raw in live.redis_client().lrange(queue, 0, -1)]


@pytest.fixture()
def owner():
    return User.objects.create_user("outbox-user", password="x-pass-12345")


@pytest.fixture()
def broker_down(monkeypatch):
    """The broker refuses every send (what kombu raises once its retries are spent)."""
    def refuse(*args, **kwargs):
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    monkeypatch.setattr("kvops.jobs.outbox.app.send_task", refuse)
    return monkeypatch


def test_a_job_whose_send_fails_is_stored_then_sent_by_the_reaper(owner, broker_down):
    queue = "engine.outbox-a"
    live.redis_client().delete(queue)
    job = create_job(NewJob(owner, {"max_tokens": 4}, "hi",
                                             engine="outbox-a"))  # no exception: the job exists
    job.refresh_from_db()
    assert job.status == Job.Status.QUEUED and job.dispatched_at is None
    assert outbox.send_unsent(older_than_s=60) == []  # not due yet

    broker_down.undo()  # the broker is back
    Job.objects.filter(pk=job.pk).update(queued_at=timezone.now() - timedelta(minutes=5))
    assert job.pk in reap()
    job.refresh_from_db()
    assert job.dispatched_at is not None and job.celery_task_id
    assert [m for m in queued_messages(queue) if job.celery_task_id in m]
    assert outbox.send_unsent(older_than_s=0) == []  # sent once, not again


def test_a_sent_job_is_marked_and_left_alone(owner):
    queue = "engine.outbox-b"
    live.redis_client().delete(queue)
    job = create_job(NewJob(owner, {"max_tokens": 4}, "hi",
                                             engine="outbox-b"))
    job.refresh_from_db()
    assert job.dispatched_at is not None
    assert len([m for m in queued_messages(queue) if job.celery_task_id in m]) == 1
    assert outbox.send_unsent(older_than_s=0) == []


def test_a_job_queued_long_after_its_send_is_sent_again_under_the_same_id(owner):
    queue = "engine.outbox-c"
    live.redis_client().delete(queue)
    lost = create_job(NewJob(owner, {"max_tokens": 4}, "hi",
                                               engine="outbox-c"))
    fresh = create_job(NewJob(owner, {"max_tokens": 4}, "ho",
                                                engine="outbox-c"))
    Job.objects.filter(pk=lost.pk).update(dispatched_at=timezone.now() - timedelta(hours=1))
    assert outbox.send_unsent(older_than_s=10, resend_after_s=900) == [lost.pk]
    lost.refresh_from_db()
    assert len([m for m in queued_messages(queue) if lost.celery_task_id in m]) == 2
    assert len([m for m in queued_messages(queue) if fresh.celery_task_id in m]) == 1
    assert timezone.now() - lost.dispatched_at < timedelta(minutes=1)  # not again at once
    assert outbox.send_unsent(older_than_s=10, resend_after_s=900) == []


def test_a_redis_started_afresh_gets_the_queued_jobs_again(owner):
    """The broker's messages went with a Redis started again empty (the private one of a
    `make run` stopped and started): the first reaper pass that finds the queue's mark
    gone sends every queued job again, once, whatever web process it runs in."""
    from kvops.jobs.reaper import QUEUE_MARK, check_broker
    queue = "engine.outbox-d"
    job = create_job(NewJob(owner, {"max_tokens": 4}, "hi", engine="outbox-d"))
    check_broker()  # the mark, as a running web process keeps it
    assert check_broker() == 0  # nothing lost
    live.redis_client().delete(queue, QUEUE_MARK)  # Redis restarted empty
    assert check_broker() == 1 and check_broker() == 0
    job.refresh_from_db()
    assert [m for m in queued_messages(queue) if job.celery_task_id in m]
