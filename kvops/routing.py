"""Which queue a job goes to."""
from __future__ import annotations

from kvops.models import Job


def choose_queue(job: Job) -> tuple[str, dict]:
    """A job naming an engine goes to that engine's queue; others to the shared queue,
    where any engine worker may take it. Returns (queue, the decision for the job page)."""
    from kvops.services import SHARED_QUEUE, engine_queue

    if job.requested_engine:
        return engine_queue(job.requested_engine), {
            "policy": "requested", "engine": job.requested_engine}
    return SHARED_QUEUE, {"policy": "shared-queue", "engine": None}
