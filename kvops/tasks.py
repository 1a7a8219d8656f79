"""Celery tasks: thin; they take ids and call services."""
from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

from kvops import services
from kvops.engine_service import EngineError
from kvops.group_commit import GroupCommit
from kvops.tenancy import cache_salt
from kvops.worker import get_engine_service, get_output_processor

log = logging.getLogger(__name__)

# Deliveries that arrive together (a burst of jobs) claim their jobs in one transaction.
claim = GroupCommit(services.claim_jobs)


CLAIM_RETRIES = 5  # a delivery whose claim fails (database away) is sent again this often


@shared_task(bind=True, name="kvops.run_job")
def run_job(self, job_id: int) -> str:
    """Run one job on this worker's engine until it ends.

    The task holds its Celery delivery (acks late) while the job runs, but does no
    per-token work: the output processor streams and stores every job's progress, and
    wakes this thread when the job has ended. Whatever goes wrong once the job is
    claimed, the job ends (failed, with the reason) and its engine request is aborted;
    a claim that fails is tried again (a new delivery under the same task id)."""
    service = get_engine_service()
    try:
        job = claim(services.Claim(job_id, service.name, service.instance,
                                   self.request.id or ""))
    except Exception as e:  # noqa: BLE001  (the database is away: the job is still queued)
        log.warning("job %s could not be claimed: %s", job_id, e)
        if self.request.retries >= CLAIM_RETRIES:
            _fail_quietly(job_id, f"could not be started: {type(e).__name__}: {e}", None)
            return "failed"
        raise self.retry(exc=e, countdown=min(2 ** self.request.retries, 30),
                         max_retries=CLAIM_RETRIES)
    if job is None:
        return "skipped"
    try:
        return _run_claimed(service, job)
    except Exception as e:  # noqa: BLE001  (anything: the job must not stay `running`)
        log.exception("job %s: running it failed", job.pk)
        get_output_processor().untrack(job.request_id)
        _abort_quietly(service, job.request_id)
        _fail_quietly(job.pk, f"{type(e).__name__}: {e}", job.request_id)
        return "failed"


def _run_claimed(service, job) -> str:
    processor = get_output_processor()
    handle = processor.track(job.pk, job.request_id, job.attempts,
                             (job.params or {}).get("stop"))
    try:
        prompt = service.render_chat(job.messages) if job.messages else job.prompt
        service.submit(job.request_id, prompt, job.params, job.priority, str(job.pk),
                       cache_salt=cache_salt(job.owner))
    except EngineError as e:
        processor.untrack(job.request_id)
        services.fail_job(job.pk, str(e), request_id=job.request_id)
        return "rejected"
    # A cancel that came between the claim and the submit found no engine request to
    # abort: look again now that there is one.
    if services.cancel_was_requested(job.pk):
        _abort_quietly(service, job.request_id)
    outcome = handle.wait(settings.KVOPS_JOB_TIMEOUT_S)
    if outcome is None:
        processor.untrack(job.request_id)
        _abort_quietly(service, job.request_id)
        services.fail_job(job.pk, f"request {job.request_id} ran past "
                                  f"{settings.KVOPS_JOB_TIMEOUT_S:.0f} s", job.request_id)
        return "timeout"
    if outcome == "error":  # its end could not be written: try once more, as a failure
        services.fail_job(job.pk, "the job's result could not be stored", job.request_id)
    return outcome


def _abort_quietly(service, request_id: str) -> None:
    try:
        service.command("abort", {"request_id": request_id})
    except Exception:  # noqa: BLE001  (it ended on its own meanwhile, or was never added)
        pass


def _fail_quietly(job_id: int, error: str, request_id: str | None) -> None:
    try:
        services.fail_job(job_id, error, request_id=request_id)
    except Exception:  # noqa: BLE001  (the database is away too: the reaper moves it on)
        log.exception("job %s: could not record its failure", job_id)
