"""Limits per user on job submission, applied to the REST API and /v1 alike:
  * a rate (KVOPS_JOB_RATE, DRF's "N/s|min|hour|day"): over it, a 429 with Retry-After;
  * a cap on jobs queued or running at once (KVOPS_MAX_JOBS_PER_USER): over it, a 429.
Staff (operators, benchmarks) are exempt from both. The rate's counts live in the cache,
which is Redis (shared by every web process); if Redis is away, calls are let through
rather than refused (the rest of the job path says what is wrong)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from django.conf import settings
from redis.exceptions import RedisError
from rest_framework.throttling import UserRateThrottle

from kvops.models import Job

log = logging.getLogger(__name__)

ACTIVE = (Job.Status.QUEUED, Job.Status.RUNNING)


class TooManyJobs(Exception):
    """The user has KVOPS_MAX_JOBS_PER_USER jobs queued or running (HTTP 429)."""


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


def check_job_cap(owner, extra: int = 0) -> None:
    """TooManyJobs if `owner` has the cap of jobs queued or running (counting `extra`
    more accepted but not yet stored)."""
    cap = settings.KVOPS_MAX_JOBS_PER_USER
    if not cap or owner.is_staff:
        return
    active = Job.objects.filter(owner=owner, status__in=ACTIVE).count() + extra
    if active >= cap:
        raise TooManyJobs(f"you have {active} jobs queued or running, the most allowed at "
                          f"once (KVOPS_MAX_JOBS_PER_USER={cap}); wait for some to end")
