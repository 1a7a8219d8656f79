"""Celery tasks: thin; they take ids and call services."""
from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

from kvops import services
from kvops.engine_service import EngineError
from kvops.group_commit import GroupCommit
from kvops.worker import get_engine_service, get_output_processor

log = logging.getLogger(__name__)

# Deliveries that arrive together (a burst of jobs) claim their jobs in one transaction.
claim = GroupCommit(services.claim_jobs)


@shared_task(bind=True, name="kvops.run_job")
def run_job(self, job_id: int) -> str:
    """Run one job on this worker's engine until it ends.

    The task holds its Celery delivery (acks late) while the job runs, but does no
    per-token work: the output processor streams and stores every job's progress, and
    wakes this thread when the job has ended."""
    service = get_engine_service()
    processor = get_output_processor()
    job = claim(services.Claim(job_id, service.name, service.instance, self.request.id or ""))
    if job is None:
        return "skipped"
    handle = processor.track(job.pk, job.request_id, job.attempts,
                             (job.params or {}).get("stop"))
    try:
        prompt = service.render_chat(job.messages) if job.messages else job.prompt
        service.submit(job.request_id, prompt, job.params, job.priority, str(job.pk))
    except EngineError as e:
        processor.untrack(job.request_id)
        services.fail_job(job.pk, str(e), request_id=job.request_id)
        return "rejected"
    except Exception as e:  # anything else: the job fails with the reason, never hangs
        log.exception("job %s could not be submitted", job.pk)
        processor.untrack(job.request_id)
        services.fail_job(job.pk, f"{type(e).__name__}: {e}", request_id=job.request_id)
        return "failed"
    outcome = handle.wait(settings.KVOPS_JOB_TIMEOUT_S)
    if outcome is None:
        processor.untrack(job.request_id)
        try:
            service.command("abort", {"request_id": job.request_id})
        except EngineError:
            pass  # it ended on its own meanwhile; the job fails for its timeout all the same
        services.fail_job(job.pk, f"request {job.request_id} ran past "
                                  f"{settings.KVOPS_JOB_TIMEOUT_S:.0f} s", job.request_id)
        return "timeout"
    if outcome == "error":  # its end could not be written: try once more, as a failure
        services.fail_job(job.pk, "the job's result could not be stored", job.request_id)
    return outcome
