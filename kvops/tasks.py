"""Celery tasks: thin; they take ids and call the job store (kvops/jobs/job_store.py)."""
from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

from engine import EngineError, wire
from kvops.intake.prompts import job_prompt_ids
from kvops.jobs import job_deadline, job_store
from kvops.operators import moves
from kvops.routing.tenancy import cache_salt, tenant
from kvops.worker.worker import context

log = logging.getLogger(__name__)

# Job params the service keeps for itself (how to shape the answer), not the engine's.
SERVICE_PARAMS = ("tool_call", "response")

CLAIM_RETRIES = 5  # a delivery whose claim fails (database away) is sent again this often


@shared_task(bind=True, name="kvops.run_jobs")
def run_jobs(self, job_ids: list[int]) -> list[str]:
    """Run jobs on this worker's engine until each ends; one outcome per job.

    Jobs admitted together for one engine travel as one task (kvops/jobs/outbox.py):
    Celery's cost is per delivery, and in a burst of hundreds of streams that cost, on
    the worker's one interpreter, is what delays the first tokens. The task holds its
    delivery (acks late) while its jobs run, but does no per-token work: the output
    processor streams and stores every job's progress, and wakes this thread when a job
    has ended. Whatever goes wrong once the jobs are claimed, each ends (failed, with the
    reason) and its engine request is aborted; a claim that fails is tried again (a new
    delivery under the same task id)."""
    worker = context()
    service = worker.client
    try:
        # Deliveries that arrive together claim their jobs in one transaction (a
        # delivery's own jobs always in the same one: all claimed or none).
        jobs = worker.claim.many([job_store.Claim(job_id, service.name, service.instance,
                                                  self.request.id or "")
                                  for job_id in job_ids])
    except Exception as e:  # noqa: BLE001  (the database is away: the jobs are still queued)
        log.warning("jobs %s could not be claimed: %s", job_ids, e)
        if self.request.retries >= CLAIM_RETRIES:
            for job_id in job_ids:
                _fail_quietly(job_id, f"could not be started: {type(e).__name__}: {e}", None)
            return ["failed"] * len(job_ids)
        raise self.retry(exc=e, countdown=min(2 ** self.request.retries, 30),
                         max_retries=CLAIM_RETRIES) from e
    claimed = [job for job in jobs if job is not None]
    outcomes: dict[int, str] = {}
    try:
        _run_claimed(worker, claimed, outcomes)
    except Exception as e:  # noqa: BLE001  (anything: no job may stay `running`)
        log.exception("jobs %s: running them failed", [job.pk for job in claimed])
        for job in claimed:
            if job.pk not in outcomes:
                worker.processor.untrack(job.request_id)
                service.abort_quietly(job.request_id)
                _fail_quietly(job.pk, f"{type(e).__name__}: {e}", job.request_id)
                outcomes[job.pk] = "failed"
    return [outcomes.get(job_id, "skipped") for job_id in job_ids]


def _run_claimed(worker, jobs: list, outcomes: dict[int, str]) -> None:
    """Submit the claimed jobs in one message to the engine and wait for each to end,
    recording each job's outcome as it is known."""
    if not jobs:
        return
    service, processor = worker.client, worker.processor
    items, handles = [], {}
    for job in jobs:
        params = job.params or {}
        handles[job.pk] = processor.track(job.pk, job.request_id, job.attempts,
                                          params.get("stop"), params.get("min_tokens") or 0,
                                          params.get("n") or 1)
        try:
            prompt = job_prompt_ids(job, service.describe_config(), processor.tokenizer)
        except Exception as e:  # noqa: BLE001  (that job's messages: it alone fails)
            processor.untrack(job.request_id)
            job_store.fail_job(job.pk, f"its chat could not be rendered: {e}", job.request_id)
            outcomes[job.pk] = "rejected"
            continue
        engine_params = {k: v for k, v in params.items() if k not in SERVICE_PARAMS}
        items.append(wire.add_request(job.request_id, prompt, engine_params, job.priority,
                                      str(job.pk), cache_salt(job.owner), tenant(job.owner),
                                      _decode_on(service, job)))
    submitted = [job for job in jobs if job.pk not in outcomes]
    refusals = service.submit_many(items) if items else []
    running = []
    for job, refusal in zip(submitted, refusals, strict=True):
        if isinstance(refusal, EngineError):
            processor.untrack(job.request_id)
            job_store.fail_job(job.pk, str(refusal), request_id=job.request_id)
            outcomes[job.pk] = "rejected"
        else:
            running.append(job)
    # A cancel that came between the claim and the submit found no engine request to
    # abort: look again now that there is one.
    for job_id in job_store.cancels_requested([job.pk for job in running]):
        service.abort_quietly(next(j.request_id for j in running if j.pk == job_id))
    for job in running:
        outcome = job_deadline.wait_or_end(service, processor, job, handles[job.pk])
        if outcome == "error":  # its end could not be written: try once more, as a failure
            job_store.fail_job(job.pk, "the job's result could not be stored", job.request_id)
        outcomes[job.pk] = outcome


def _decode_on(service, job) -> dict | None:
    """Prefill/decode: the decode engine the router chose for the job, if this engine is
    a prefill engine and that one takes requests now ({"address", "to", "ticket"}); else
    None (it decodes here)."""
    name = (job.routing or {}).get("decode_engine")
    if not name or service.describe_config().get("role") != "prefill":
        return None
    try:
        # (the hand-over comes once its prompt is computed: the ticket lasts until the
        # job's deadline)
        return moves.route(service.name, name, job.request_id,
                               job_deadline.deadline(job), str(job.pk))
    except EngineError as e:
        log.info("job %s decodes on %s: %s", job.pk, service.name, e)
        return None


def _fail_quietly(job_id: int, error: str, request_id: str | None) -> None:
    try:
        job_store.fail_job(job_id, error, request_id=request_id)
    except Exception:  # noqa: BLE001  (the database is away too: the reaper moves it on)
        log.exception("job %s: could not record its failure", job_id)


@shared_task(name="kvops.what_if", acks_late=False,
             soft_time_limit=settings.KVOPS_WHAT_IF_TIME_LIMIT_S,
             time_limit=settings.KVOPS_WHAT_IF_TIME_LIMIT_S + 30)
def what_if(run_id: int) -> str:
    """Replay an engine's recent jobs under two configurations (kvops/what_if/what_if.py). Sent
    to the ops queue only, which no engine worker consumes. Acknowledged on receipt: a
    replay that kills its worker (out of memory) is not delivered again to kill the
    next one; the run is marked failed when read (what_if.settle)."""
    from kvops.what_if import what_if as service

    return service.run(run_id)
