"""The outbox: a stored job's task reaches the broker after the job's transaction
commits, and a job whose task never got there (Redis away, or the web process died
between the commit and the send) is sent later by the reaper's pass. A job runs once
whichever of its deliveries claims it first (kvops/jobs/job_store.py)."""
from __future__ import annotations

import logging
import uuid
from datetime import timedelta

from django.utils import timezone

from kvops.celery import app
from kvops.models import Job
from kvops.routing.routing import SHARED_QUEUE, choose_queue, engine_queue

log = logging.getLogger(__name__)

RUN_JOBS = "kvops.run_jobs"  # the task (kvops/tasks.py), sent by name


def send_tasks(jobs: list[Job], queues: list[str]) -> None:
    """Send the jobs' tasks (one per queue and task id, holding its jobs) and mark those
    the broker took. Never raises: a job whose send failed (Redis away, or this process
    died first) stays queued without dispatched_at, and the reaper sends it (reap: the
    outbox pass). The client's job exists either way."""
    tasks: dict[tuple[str, str], list[int]] = {}
    for job, queue in zip(jobs, queues):
        tasks.setdefault((queue, job.celery_task_id), []).append(job.pk)
    sent = []
    for (queue, task_id), job_ids in tasks.items():
        try:
            app.send_task(RUN_JOBS, args=[job_ids], queue=queue, task_id=task_id)
        except Exception as e:  # noqa: BLE001  (the outbox pass sends it later)
            log.warning("jobs %s: their task could not be sent (%s); the reaper sends it "
                        "later", job_ids, e)
            continue
        sent += job_ids
    if sent:
        try:
            Job.objects.filter(pk__in=sent).update(dispatched_at=timezone.now())
        except Exception as e:  # noqa: BLE001  (then the reaper sends them again: harmless,
            # a job runs once whichever delivery claims it)
            log.warning("jobs %s: could not mark them sent: %s", sent, e)


def dispatch_job(job_id: int) -> None:
    """Route a stored job again and send it a new task (a re-run: the old task id, still
    in the broker perhaps, becomes stale)."""
    job = Job.objects.get(pk=job_id)
    queue, routing = choose_queue(job)
    task_id = str(uuid.uuid4())
    Job.objects.filter(pk=job.pk).update(celery_task_id=task_id, routing=routing,
                                         dispatched_at=None)
    send_tasks([Job(pk=job.pk, celery_task_id=task_id)], [queue])


def send_unsent(older_than_s: float, resend_after_s: float | None = None) -> list[int]:
    """The outbox pass: queued jobs whose task never reached the broker (its send failed,
    or the web process died between the commit and the send) are sent now; with
    resend_after_s, jobs still queued that long after their send get their task sent
    again under the same id (a message the broker lost; if both arrive, the first claim
    wins and the other is skipped). Returns the ids sent."""
    now = timezone.now()
    ids = list(Job.objects.filter(status=Job.Status.QUEUED, dispatched_at__isnull=True,
                                  queued_at__lt=now - timedelta(seconds=older_than_s))
               .values_list("pk", flat=True))
    for job_id in ids:
        log.warning("job %s: its task was never sent; sending it now", job_id)
        dispatch_job(job_id)
    if resend_after_s:
        stale = list(Job.objects.filter(
            status=Job.Status.QUEUED,
            dispatched_at__lt=now - timedelta(seconds=resend_after_s)))
        for job in stale:
            log.warning("job %s: still queued %.0f s after its task was sent; sending it "
                        "again", job.pk, (now - job.dispatched_at).total_seconds())
        send_tasks(stale, [_queue_of(job) for job in stale])
        ids += [job.pk for job in stale]
    return ids


def _queue_of(job: Job) -> str:
    """The queue the job's routing decision named (the shared queue if none)."""
    target = (job.routing or {}).get("engine")
    return engine_queue(target) if target else SHARED_QUEUE


def redispatch_queued(reason: str) -> int:
    """Send every queued job again (the broker lost its messages, e.g. Redis restarted).
    Stale deliveries are ignored by claim_jobs, so a job still in the broker runs once."""
    n = 0
    for job_id in Job.objects.filter(status=Job.Status.QUEUED).values_list("pk", flat=True):
        log.warning("re-dispatching job %s: %s", job_id, reason)
        dispatch_job(job_id)
        n += 1
    return n
