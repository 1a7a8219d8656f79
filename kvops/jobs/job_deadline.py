"""A job's deadline: KVOPS_JOB_TIMEOUT_S after its attempt started (Job.started_at, set
by its claim), on the wall clock. One definition, watched wherever the attempt runs: by
its task on the engine that claimed it (kvops/tasks.py) and, after a move, on the engine
it moved to (kvops/operators/moves.py, watch_moved_in); a job that moves keeps its deadline,
and a task that starts waiting late does not give its job more time."""
from __future__ import annotations

import time

from django.conf import settings

from kvops.jobs import job_store
from kvops.models import Job


def deadline(job: Job) -> float:
    """When the job's attempt runs out of time (Unix seconds)."""
    if job.started_at is None:
        raise ValueError(f"job {job.pk} has no start: only a claimed attempt has a deadline")
    return job.started_at.timestamp() + settings.KVOPS_JOB_TIMEOUT_S


def wait_or_end(client, processor, job: Job, handle) -> str:
    """The attempt's outcome (handle.wait's), waited for until the job's deadline; past
    it, the job ends here: its request untracked and aborted, the job failed, and the
    outcome is "timeout"."""
    outcome = handle.wait(max(0.0, deadline(job) - time.time()))
    if outcome is not None:
        return outcome
    processor.untrack(job.request_id)
    client.abort_quietly(job.request_id)
    job_store.fail_job(job.pk, f"request {job.request_id} ran past "
                               f"{settings.KVOPS_JOB_TIMEOUT_S:.0f} s", job.request_id)
    return "timeout"
