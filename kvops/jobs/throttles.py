"""Limits per user on job submission, applied to the REST API and /v1 alike:
  * a rate (KVOPS_JOB_RATE, DRF's "N/s|min|hour|day"): over it, a 429 with Retry-After;
  * caps on jobs and on sequences (a job with `n` counts n) queued or running at once
    (KVOPS_MAX_JOBS_PER_USER, KVOPS_MAX_SEQS_PER_USER): over one, a 429. They are
    counted where the jobs are stored, in the same transaction (over_caps).
Staff (operators, benchmarks) are exempt from both. The rate's counts live in the cache,
which is Redis (shared by every web process); if Redis is away, calls are let through
rather than refused (the rest of the job path says what is wrong)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db.models import Count, IntegerField, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce
from redis.exceptions import RedisError
from rest_framework.throttling import UserRateThrottle

from kvops.models import Job

log = logging.getLogger(__name__)

ACTIVE = (Job.Status.QUEUED, Job.Status.RUNNING)


class TooManyJobs(Exception):
    """The job would take its owner past a cap (HTTP 429)."""


class JobSubmitThrottle(UserRateThrottle):
    scope = "jobs"

    def allow_request(self, request, view) -> bool:
        if request.user.is_staff:
            return True
        try:
            return super().allow_request(request, view)
        except (RedisError, OSError) as e:
            log.warning("job rate limit not applied (the cache is unreachable: %s)", e)
            return True


def allow_submission(user) -> float | None:
    """None if the user may submit a job now, else the seconds to wait (Retry-After)."""
    throttle = JobSubmitThrottle()
    request = SimpleNamespace(user=user)  # what the throttle reads of a request
    return None if throttle.allow_request(request, None) else (throttle.wait() or 1.0)


def over_caps(jobs: list[Job], lock: bool = True) -> list[TooManyJobs | None]:
    """Per job about to be stored, the TooManyJobs that keeps it out, or None: a job
    that would take its owner past KVOPS_MAX_JOBS_PER_USER jobs, or past
    KVOPS_MAX_SEQS_PER_USER sequences (a job with `n` counts n), queued or running.
    Jobs are taken in order, each counting the ones before it.

    Call it inside the transaction that stores them. It locks the owners' rows first
    (PostgreSQL; SQLite's IMMEDIATE transactions let one writer in at a time anyway), so
    that two submissions cannot both pass on the same count. lock=False: a first look,
    outside a transaction, which only refusals may be taken from."""
    job_cap = settings.KVOPS_MAX_JOBS_PER_USER
    seq_cap = settings.KVOPS_MAX_SEQS_PER_USER
    owners = sorted({job.owner.pk for job in jobs if not job.owner.is_staff})
    if not owners or not (job_cap or seq_cap):
        return [None] * len(jobs)
    if lock:  # in one order: no deadlock
        list(get_user_model().objects.select_for_update().filter(pk__in=owners)
             .order_by("pk").values_list("pk", flat=True))
    held = {row["owner_id"]: [row["jobs"], row["seqs"]] for row in (
        Job.objects.filter(owner_id__in=owners, status__in=ACTIVE).values("owner_id")
        .annotate(jobs=Count("id"), seqs=Sum(Coalesce(Cast(KT("params__n"), IntegerField()),
                                                      1))))}
    out: list[TooManyJobs | None] = []
    for job in jobs:
        if job.owner.is_staff:
            out.append(None)
            continue
        counts = held.setdefault(job.owner.pk, [0, 0])
        n = int((job.params or {}).get("n") or 1)
        if job_cap and counts[0] + 1 > job_cap:
            out.append(TooManyJobs(
                f"you have {counts[0]} jobs queued or running, the most allowed at once "
                f"(KVOPS_MAX_JOBS_PER_USER={job_cap}); wait for some to end"))
        elif seq_cap and counts[1] + n > seq_cap:
            out.append(TooManyJobs(
                f"this job's {n} sequences would make {counts[1] + n} queued or running, "
                f"more than allowed at once (KVOPS_MAX_SEQS_PER_USER={seq_cap}; a job "
                "with `n` counts n); wait for some to end"))
        else:
            counts[0] += 1
            counts[1] += n
            out.append(None)
    return out
