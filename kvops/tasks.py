"""Celery tasks: thin; they take ids and call services."""
from __future__ import annotations

import logging
import time

from celery import shared_task
from django.conf import settings

from kvops import services
from kvops.engine_service import EngineError
from kvops.worker import get_engine_service

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.1  # coalesce token updates to at most 10 per second per job


@shared_task(bind=True, name="kvops.run_job")
def run_job(self, job_id: int) -> str:
    """Run one job on this worker's engine, streaming progress, until it ends."""
    service = get_engine_service()
    job = services.claim_job(job_id, service.name, service.instance, self.request.id or "")
    if job is None:
        return "skipped"
    try:
        prompt = service.render_chat(job.messages) if job.messages else job.prompt
        handle = service.submit(job.request_id, prompt, job.params, job.priority, str(job.pk))
    except EngineError as e:
        services.fail_job(job.pk, str(e))
        return "rejected"
    last_sent = 0.0
    progress = None
    try:
        for out in handle.outputs(timeout_s=settings.KVOPS_JOB_TIMEOUT_S):
            progress = services.Progress(
                text=out.text, token_ids=out.output_token_ids,
                num_prompt_tokens=len(out.prompt_token_ids),
                num_cached_tokens=out.num_cached_tokens, num_preemptions=out.num_preemptions,
                finished=out.finished, finish_reason=out.finish_reason)
            now = time.monotonic()
            first = job.first_token_at is None and bool(out.output_token_ids)
            if out.finished:
                break
            if first or now - last_sent >= PROGRESS_INTERVAL_S:
                services.record_progress(job, progress, first_token=first)
                last_sent = now
    except EngineError as e:  # the step computing it failed
        services.fail_job(job.pk, str(e))
        return "failed"
    except TimeoutError as e:
        try:
            service.command("abort", {"request_id": job.request_id})
        except EngineError:
            pass  # it ended on its own meanwhile; the job fails for its timeout all the same
        services.fail_job(job.pk, str(e))
        return "timeout"
    services.finish_job(job, progress)
    return "done"
