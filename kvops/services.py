"""Writes: every change to jobs, engines and the operator log goes through here."""
from __future__ import annotations

import logging
import sqlite3
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone
from redis.exceptions import RedisError

from engine.commands import STATE_COMMANDS
from kvops import control, idempotency, live, metrics_store, selectors
from kvops.idempotency import KeyReused
from kvops.models import Engine, Job, OperatorAction
from kvops.routing import SHARED_QUEUE, engine_queue  # (also re-exported)
from kvops.throttles import TooManyJobs, over_caps

log = logging.getLogger(__name__)


class Conflict(Exception):
    """The object is in a state where the change makes no sense (HTTP 409)."""


class Unavailable(Exception):
    """A service the call needs (Redis) is unreachable now; nothing was stored (HTTP 503)."""


# --- jobs, web side -----------------------------------------------------------------------
@dataclass(slots=True)
class NewJob:
    """What a client asked for (create_jobs stores it)."""
    owner: object
    params: dict
    prompt: str = ""
    messages: list | None = None
    priority: int = 0
    engine: str = ""
    source: str = Job.Source.API
    idempotency_key: str = ""


def create_job(new: NewJob) -> Job:
    """Store a job and enqueue it once the transaction commits (never before: the
    worker must find the row). With an idempotency key, a job the owner already
    submitted under it is returned instead, if it asked for the same thing
    (idempotency.KeyReused if not)."""
    if new.idempotency_key:
        prior = prior_job(new)
        if prior is not None:
            return prior
    try:
        with transaction.atomic():
            [result] = create_jobs([new])
    except IntegrityError:
        prior = prior_job(new) if new.idempotency_key else None
        if prior is None:
            raise
        return prior  # a concurrent call with the same key stored it first
    if isinstance(result, TooManyJobs):
        raise result
    return result


def prior_job(new: NewJob) -> Job | None:
    """The job its owner submitted under the same idempotency key, marked `replayed`;
    None if there is none. KeyReused if that job asked for something else."""
    prior = Job.objects.filter(owner=new.owner, idempotency_key=new.idempotency_key).first()
    if prior is None:
        return None
    same = (prior.prompt, prior.messages, prior.params, prior.priority,
            prior.requested_engine) == (new.prompt, new.messages, new.params, new.priority,
                                        new.engine)
    if not same:
        raise KeyReused(f"{idempotency.HEADER} {new.idempotency_key!r} was used for another "
                        f"request (job {prior.pk}); use a new key for a new job")
    prior.replayed = True
    return prior


MAX_JOBS_PER_TASK = 64  # jobs admitted together for one engine travel in one task


def create_jobs(new: list[NewJob], on_stored=None) -> list[Job | TooManyJobs]:
    """Store jobs in one INSERT and send their tasks once the transaction commits.
    Returns, per NewJob, its Job, or the TooManyJobs that kept it out: a job that would
    take its owner past a cap (kvops/throttles.py) is not stored, and the caps are
    counted inside the storing transaction, so concurrent submissions cannot both pass.

    Each job is routed first, so its row holds its queue decision and task id from the
    start (no second write; a worker that takes the task finds the row complete), and a
    routing failure (Redis away) stores nothing. Jobs routed to the same queue share a
    task (up to MAX_JOBS_PER_TASK each): one delivery for a burst. on_stored(results),
    if given, runs inside the transaction with what will be returned (the /v1 path binds
    its listeners there)."""
    from kvops.routing import choose_queues

    every = [Job(owner=n.owner, prompt=n.prompt, messages=n.messages, params=n.params,
                 priority=n.priority, requested_engine=n.engine, source=n.source,
                 idempotency_key=n.idempotency_key) for n in new]
    # Over a cap already: refused before routing counts them on an engine (the count
    # that decides is the one in the transaction below)
    results: list[Job | TooManyJobs] = [r or job for job, r in zip(every, over_caps(every,
                                                                                lock=False))]
    jobs = [r for r in results if isinstance(r, Job)]
    if not jobs:
        return results
    try:
        decisions = choose_queues(jobs)
    except (RedisError, OSError) as e:
        raise Unavailable(f"jobs cannot be routed now (Redis is unreachable: {e}); "
                          "nothing was stored, try again") from None
    queues = [queue for queue, _ in decisions]
    for job, (_, routing) in zip(jobs, decisions):
        job.routing = routing
    per_queue: dict[str, list[Job]] = {}
    for job, queue in zip(jobs, queues):
        per_queue.setdefault(queue, []).append(job)
    for group in per_queue.values():
        for start in range(0, len(group), MAX_JOBS_PER_TASK):
            task_id = str(uuid.uuid4())
            for job in group[start:start + MAX_JOBS_PER_TASK]:
                job.celery_task_id = task_id
    statements = _insert_statements(jobs)  # the Python work, before the write lock
    with transaction.atomic():
        refusals = dict(zip(map(id, jobs), over_caps(jobs)))
        if any(refusals.values()):  # (submissions that raced this one)
            results = [refusals.get(id(r)) or r for r in results]
            kept = [(job, queue) for job, queue in zip(jobs, queues) if not refusals[id(job)]]
            jobs, queues = [job for job, _ in kept], [queue for _, queue in kept]
            statements = _insert_statements(jobs)
        _insert(jobs, statements)
        if on_stored is not None:
            on_stored(results)
        transaction.on_commit(lambda: _send_tasks(jobs, queues))
    return results


def _insert_statements(jobs: list[Job]) -> list[tuple[str, tuple, list[Job]]]:
    """The INSERTs that store new jobs and return their ids, built as the ORM's
    bulk_create builds them (each field's value prepared, auto_now stamped), as few
    statements as the database's parameter limit allows, and each with its jobs.

    bulk_create does this work inside its transaction, and on SQLite a transaction holds
    back every writer: at 1,024 streams the web's insert of 256 jobs, in a thread that
    shares its process with the event loop, held them for 40-300 ms. Built beforehand,
    the transaction only runs the statements (one for a batch of 256 jobs, where
    bulk_create sent nine: each lets the event loop's thread take the interpreter lock)."""
    from django.db.models import sql

    db = transaction.get_connection()  # the wrapper itself: the `connection` proxy
    # looks up this thread's connection at every attribute, thousands of times here
    fields = [f for f in Job._meta.concrete_fields if not f.primary_key]
    per_statement = _rows_per_insert(db, len(fields), len(jobs))
    statements = []
    for start in range(0, len(jobs), per_statement):
        chunk = jobs[start:start + per_statement]
        query = sql.InsertQuery(Job)
        query.insert_values(fields, chunk)
        compiler = query.get_compiler(connection=db)
        compiler.returning_fields = [Job._meta.pk]
        [(statement, params)] = compiler.as_sql()
        statements.append((statement, params, chunk))
    return statements


def _rows_per_insert(db, num_fields: int, num_rows: int) -> int:
    """Rows one INSERT may carry under the database's limit on parameters."""
    if db.vendor == "sqlite":
        db.ensure_connection()
        return max(1, db.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
                   // num_fields)
    if db.vendor == "postgresql":
        return max(1, 65535 // num_fields)  # the protocol's parameter count
    return max(1, db.features.max_query_params // num_fields
               if db.features.max_query_params else num_rows)


def _insert(jobs: list[Job], statements: list[tuple[str, tuple, list[Job]]]) -> None:
    """Run _insert_statements' INSERTs and give each job its id (as bulk_create does)."""
    db = transaction.get_connection()
    with db.cursor() as cursor:
        for statement, params, chunk in statements:
            cursor.execute(statement, params)
            ids = [row[0] for row in cursor.fetchall()]
            if len(ids) != len(chunk):
                raise RuntimeError(f"stored {len(chunk)} jobs, got {len(ids)} ids back")
            for job, pk in zip(chunk, ids):
                job.pk = pk
                job._state.adding = False
                job._state.db = db.alias


def _send_tasks(jobs: list[Job], queues: list[str]) -> None:
    """Send the jobs' tasks (one per queue and task id, holding its jobs) and mark those
    the broker took. Never raises: a job whose send failed (Redis away, or this process
    died first) stays queued without dispatched_at, and the reaper sends it (reap: the
    outbox pass). The client's job exists either way."""
    from kvops.tasks import run_jobs  # the task module imports this one

    tasks: dict[tuple[str, str], list[int]] = {}
    for job, queue in zip(jobs, queues):
        tasks.setdefault((queue, job.celery_task_id), []).append(job.pk)
    sent = []
    for (queue, task_id), job_ids in tasks.items():
        try:
            run_jobs.apply_async(args=[job_ids], queue=queue, task_id=task_id)
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
    from kvops.routing import choose_queue

    job = Job.objects.get(pk=job_id)
    queue, routing = choose_queue(job)
    task_id = str(uuid.uuid4())
    Job.objects.filter(pk=job.pk).update(celery_task_id=task_id, routing=routing,
                                         dispatched_at=None)
    _send_tasks([Job(pk=job.pk, celery_task_id=task_id)], [queue])


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
        _send_tasks(stale, [_queue_of(job) for job in stale])
        ids += [job.pk for job in stale]
    return ids


def _queue_of(job: Job) -> str:
    """The queue the job's routing decision named (the shared queue if none)."""
    target = (job.routing or {}).get("engine")
    return engine_queue(target) if target else SHARED_QUEUE


def cancel_job(job: Job) -> Job:
    """Cancel a queued job at once; ask the engine to abort a running one."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job.pk)
        if job.is_terminal:
            raise Conflict(f"job {job.pk} is already {job.status}")
        job.cancel_requested = True
        if job.status == Job.Status.QUEUED:
            _end(job, Job.Status.CANCELLED, error="cancelled before it started")
        job.save(update_fields=["cancel_requested", *END_FIELDS])
    if job.status == Job.Status.RUNNING and job.engine:
        _flag_cancel(job.pk)  # for a task between its claim and its submit
        engine = Engine.objects.filter(name=job.engine).first()
        if engine is not None:
            # The task sees the abort output and records the cancellation.
            control.send_engine_command(engine.worker, "abort", {"request_id": job.request_id})
    else:
        _publish_job(job)
    return job


END_FIELDS = ["status", "error", "finished_at"]


def _end(job: Job, status: str, error: str = "") -> None:
    job.status = status
    job.error = error
    job.finished_at = timezone.now()


def _publish_job(job: Job) -> None:
    _publish_jobs([job])


def _publish_jobs(jobs: list[Job]) -> None:
    if not jobs:
        return
    try:
        live.publish_job_states([(job.pk, job.attempts, job_payload(job)) for job in jobs])
    except Exception as e:  # Redis away: listeners see the gap and end with an error
        log.warning("could not publish the state of jobs %s: %s", [j.pk for j in jobs], e)


# The fields job_payload() and the latency histograms read
PAYLOAD_FIELDS = ("status", "attempts", "output_text", "num_output_tokens", "finish_reason",
                  "num_prompt_tokens", "error", "engine", "request_id", "num_cached_tokens",
                  "num_preemptions", "samples", "queued_at", "started_at", "first_token_at",
                  "finished_at")


def job_payload(job: Job) -> dict:
    """What a job's websocket and SSE listeners receive: cumulative, so a missed message
    costs nothing."""
    return {"status": job.status, "attempt": job.attempts, "text": job.output_text,
            "num_output_tokens": job.num_output_tokens, "finish_reason": job.finish_reason,
            "num_prompt_tokens": job.num_prompt_tokens,
            "finished": job.is_terminal, "error": job.error, "engine": job.engine,
            "request_id": job.request_id, "num_cached_tokens": job.num_cached_tokens,
            "num_preemptions": job.num_preemptions, "samples": job.samples}


# --- jobs, worker side ------------------------------------------------------------------
MAX_ATTEMPTS = 3  # a job whose workers keep dying is failed, not retried forever


@dataclass(slots=True)
class Claim:
    """A task delivery asking to run its job on this worker."""
    job_id: int
    engine: str
    instance: str
    task_id: str


CLAIM_FIELDS = ["attempts", "status", "engine", "engine_instance", "request_id", "started_at",
                "first_token_at", "output_text", "output_token_ids", "samples", "output_logprobs",
                "prompt_logprobs", "finish_reason", "error", "num_output_tokens",
                "num_cached_tokens", "num_preemptions"]


def claim_jobs(claims: list[Claim]) -> list[Job | None]:
    """Mark jobs running on this worker, in one transaction. Per claim: the job, or None
    if this delivery must not run it: the job ended or was cancelled, or the delivery is
    stale (the job was re-dispatched under a new task id, or it runs on a live worker
    already). A job whose worker died runs again from its prompt.

    The transaction holds back every other writer of the database (on SQLite, the web's
    inserts and the output processor's progress too), so it does as little as it can:
    queued jobs of the delivery's task are claimed by one UPDATE per task id
    (_claim_queued), and only the others (re-runs, cancelled, stale, repeated deliveries)
    are read and judged one by one. The rows are read back once the lock is released."""
    out: list[Job | None] = [None] * len(claims)
    claimed, ended = {}, {}
    live = live_instances()  # (a read: it needs no write lock)
    with transaction.atomic():
        taken = _claim_queued(claims)
        first = {}  # job id -> the claim that took it (the first of its deliveries)
        for i, c in enumerate(claims):
            if c.job_id in taken and c.job_id not in first:
                first[c.job_id] = i
        rest = [i for i, c in enumerate(claims) if c.job_id not in first]  # (a repeated
        # delivery of a job taken here gets None)
        if rest:
            rows = Job.objects.select_for_update(of=("self",)).select_related("owner") \
                .in_bulk([claims[i].job_id for i in rest])  # the owner: its cache salt
            for i in rest:  # in order: a second delivery of a job sees the first's claim
                job = rows.get(claims[i].job_id)
                verdict = None if job is None else _claim(job, claims[i], live)
                if verdict == "run":
                    out[i] = claimed[job.pk] = job
                elif verdict == "ended":
                    ended[job.pk] = job
            if claimed:
                _update_rows(list(claimed.values()), CLAIM_FIELDS)
            if ended:
                _update_rows(list(ended.values()), END_FIELDS)
    if first:
        rows = Job.objects.select_related("owner").in_bulk(list(first))
        for job_id, i in first.items():
            if job_id in rows:  # (else deleted since: nothing to run)
                out[i] = claimed[job_id] = rows[job_id]
    _publish_jobs(list({**ended, **claimed}.values()))
    return out


def _claim_queued(claims: list[Claim]) -> set[int]:
    """Claim, in one UPDATE per task id, the jobs that wait in the queue for that task
    (not cancelled, attempts left): what _claim does to such a job, done by the
    database. Returns their ids."""
    by_task: dict[tuple[str, str, str], list[int]] = {}
    for c in claims:
        if c.task_id:
            by_task.setdefault((c.task_id, c.engine, c.instance), []).append(c.job_id)
    if not by_task:
        return set()
    quote = connection.ops.quote_name
    field = Job._meta.get_field

    def column(name: str) -> str:
        return quote(field(name).column)

    def prep(name: str, value):
        return field(name).get_db_prep_save(value, connection)

    empty = [prep(name, []) for name in ("output_token_ids", "samples", "output_logprobs",
                                          "prompt_logprobs")]
    started_at = prep("started_at", timezone.now())
    taken: set[int] = set()
    with connection.cursor() as cursor:
        for (task_id, engine, instance), job_ids in by_task.items():
            cursor.execute(
                f"UPDATE {quote(Job._meta.db_table)} SET "
                f"{column('attempts')} = {column('attempts')} + 1, {column('status')} = %s, "
                f"{column('engine')} = %s, {column('engine_instance')} = %s, "
                f"{column('request_id')} = 'job-' || {column('id')} || '-' || "
                f"({column('attempts')} + 1), {column('started_at')} = %s, "
                f"{column('first_token_at')} = NULL, {column('output_text')} = '', "
                f"{column('output_token_ids')} = %s, {column('samples')} = %s, "
                f"{column('output_logprobs')} = %s, {column('prompt_logprobs')} = %s, "
                f"{column('finish_reason')} = '', {column('error')} = '', "
                f"{column('num_output_tokens')} = 0, {column('num_cached_tokens')} = 0, "
                f"{column('num_preemptions')} = 0 "
                f"WHERE {column('id')} IN ({', '.join(['%s'] * len(job_ids))}) "
                f"AND {column('status')} = %s AND NOT {column('cancel_requested')} "
                f"AND {column('attempts')} < %s AND {column('celery_task_id')} = %s "
                f"RETURNING {column('id')}",
                [Job.Status.RUNNING, engine, instance, started_at, *empty, *job_ids,
                 Job.Status.QUEUED, MAX_ATTEMPTS, task_id])
            taken.update(job_id for (job_id,) in cursor.fetchall())
    return taken


def _update_rows(jobs: list[Job], fields: list[str]) -> None:
    """One UPDATE per row, run as one executemany: the ORM's bulk_update builds a CASE
    per field over every row, which costs milliseconds of Python per job."""
    table = connection.ops.quote_name(Job._meta.db_table)
    columns = [Job._meta.get_field(name) for name in fields]
    sql = (f"UPDATE {table} SET "
           + ", ".join(f"{connection.ops.quote_name(c.column)} = %s" for c in columns)
           + " WHERE id = %s")
    rows = [[c.get_db_prep_save(getattr(job, c.attname), connection) for c in columns]
            + [job.pk] for job in jobs]
    with connection.cursor() as cursor:
        cursor.executemany(sql, rows)


def _claim(job: Job, c: Claim, live: set[str]) -> str | None:
    """Returns "run" (the job is now this delivery's), "ended" (it ends here: cancelled,
    or out of attempts) or None (not this delivery's to run)."""
    if job.is_terminal:
        return None
    if c.task_id and job.celery_task_id and c.task_id != job.celery_task_id:
        return None
    if job.status == Job.Status.RUNNING and job.engine_instance in live:
        return None
    if job.cancel_requested:
        _end(job, Job.Status.CANCELLED, error="cancelled before it started")
        return "ended"
    if job.attempts >= MAX_ATTEMPTS:
        _end(job, Job.Status.FAILED, error=f"gave up after {job.attempts} attempts: the "
                                           "workers running it stopped each time")
        return "ended"
    job.attempts += 1
    job.status = Job.Status.RUNNING
    job.engine = c.engine
    job.engine_instance = c.instance
    job.request_id = f"job-{job.pk}-{job.attempts}"
    job.started_at = timezone.now()
    job.first_token_at = None
    job.output_text, job.output_token_ids, job.finish_reason, job.error = "", [], "", ""
    job.samples, job.output_logprobs, job.prompt_logprobs = [], [], []
    job.num_output_tokens = job.num_cached_tokens = job.num_preemptions = 0
    return "run"


@dataclass(slots=True)
class ProgressDelta:
    """What one running attempt produced since its last write (the output processor
    batches these)."""
    job_id: int
    request_id: str  # the attempt: a write for another attempt is ignored
    text: str  # appended to the job's output
    num_output_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    first_token_at: datetime | None = None  # set when this delta holds the first token


@dataclass(slots=True)
class FinalState:
    """How an attempt ended, as the output processor hands it to the database."""
    job_id: int
    request_id: str
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    finish_reason: str
    first_token_at: datetime | None
    samples: list[dict] = field(default_factory=list)  # n > 1: every sample's outcome
    logprobs: list[list] = field(default_factory=list)  # if asked: see Job.output_logprobs
    prompt_logprobs: list[list] = field(default_factory=list)


def record_progress(deltas: list[ProgressDelta]) -> set[str]:
    """Append what running jobs produced: one statement run for every job
    (executemany) in one transaction. Each row is matched on its attempt (request id),
    so a stale attempt writes nothing; returns the request ids of such attempts (their
    job runs again elsewhere, or ended: the caller stops them). Plain SQL: the ORM's
    form of this (a CASE per field) costs milliseconds of Python per job, which the
    worker cannot spare."""
    table = connection.ops.quote_name(Job._meta.db_table)
    sql = (f"UPDATE {table} SET output_text = output_text || %s, num_output_tokens = %s, "
           "num_prompt_tokens = %s, num_cached_tokens = %s, num_preemptions = %s, "
           "first_token_at = COALESCE(first_token_at, %s) "
           "WHERE id = %s AND request_id = %s AND status = %s")
    when = connection.ops.adapt_datetimefield_value
    rows = [(d.text, d.num_output_tokens, d.num_prompt_tokens, d.num_cached_tokens,
             d.num_preemptions, when(d.first_token_at), d.job_id, d.request_id,
             Job.Status.RUNNING) for d in deltas]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.executemany(sql, rows)
        if cursor.rowcount == -1 or cursor.rowcount >= len(rows):
            return set()
    # Some row did not match (rare): find which attempts lost their job.
    owned = set(Job.objects.filter(pk__in=[d.job_id for d in deltas], status=Job.Status.RUNNING)
                .values_list("pk", "request_id"))
    return {d.request_id for d in deltas if (d.job_id, d.request_id) not in owned}


def finish_jobs(finals: list[FinalState]) -> list[Job]:
    """Attempts that ended: finished, or aborted (cancelled by their owner or an
    operator). Writes their final state in one transaction and returns the jobs, as
    stored (finished ones with PAYLOAD_FIELDS only), that were still those attempts' (a
    job that ended meanwhile, or runs again elsewhere, is left alone). Plain SQL for the
    finished ones, for the output processor's sake (hundreds can end in one step); an
    abort needs the row to word its reason, and takes the ORM."""
    finished: list[int] = []
    aborted: list[Job] = []
    table = connection.ops.quote_name(Job._meta.db_table)
    sql = (f"UPDATE {table} SET output_text = %s, output_token_ids = %s, "
           "num_output_tokens = %s, num_prompt_tokens = %s, num_cached_tokens = %s, "
           "num_preemptions = %s, first_token_at = COALESCE(first_token_at, %s), "
           "finish_reason = %s, samples = %s, output_logprobs = %s, prompt_logprobs = %s, "
           "status = %s, error = '', finished_at = %s "
           "WHERE id = %s AND request_id = %s AND status IN (%s, %s)")
    token_ids = Job._meta.get_field("output_token_ids")
    samples = Job._meta.get_field("samples")
    logprobs = Job._meta.get_field("output_logprobs")
    when = connection.ops.adapt_datetimefield_value
    now = when(timezone.now())
    with transaction.atomic(), connection.cursor() as cursor:
        for f in finals:
            if f.finish_reason == "abort":
                job = _finish_aborted(f)
                if job is not None:
                    aborted.append(job)
                continue
            cursor.execute(sql, (
                f.text, token_ids.get_db_prep_value(f.token_ids, connection),
                len(f.token_ids), f.num_prompt_tokens, f.num_cached_tokens, f.num_preemptions,
                when(f.first_token_at), f.finish_reason,
                samples.get_db_prep_value(f.samples, connection),
                logprobs.get_db_prep_value(f.logprobs, connection),
                logprobs.get_db_prep_value(f.prompt_logprobs, connection),
                Job.Status.FINISHED, now, f.job_id,
                f.request_id, Job.Status.RUNNING, Job.Status.QUEUED))
            if cursor.rowcount:
                finished.append(f.job_id)
    # Read back only what the job's final update and its latency need (not its prompt,
    # token ids or logprobs: parsing those JSON lists was a third of a job's end)
    jobs = list(Job.objects.filter(pk__in=finished).only(*PAYLOAD_FIELDS)) + aborted
    metrics_store.observe_jobs(jobs)
    return jobs


def _finish_aborted(final: FinalState) -> Job | None:
    job = Job.objects.select_for_update().filter(pk=final.job_id).first()
    if job is None or job.is_terminal or job.request_id != final.request_id:
        return None
    job.output_text = final.text
    job.output_token_ids = final.token_ids
    job.num_output_tokens = len(final.token_ids)
    job.num_prompt_tokens = final.num_prompt_tokens
    job.num_cached_tokens = final.num_cached_tokens
    job.num_preemptions = final.num_preemptions
    job.first_token_at = job.first_token_at or final.first_token_at
    job.finish_reason = final.finish_reason
    job.samples = final.samples
    job.output_logprobs, job.prompt_logprobs = final.logprobs, final.prompt_logprobs
    reason = "cancelled by its owner" if job.cancel_requested \
        else f"aborted by an operator on engine {job.engine}"
    _end(job, Job.Status.CANCELLED, error=reason)
    job.save(update_fields=[
        "output_text", "output_token_ids", "num_output_tokens", "num_prompt_tokens",
        "num_cached_tokens", "num_preemptions", "first_token_at", "finish_reason", "samples",
        "output_logprobs", "prompt_logprobs", *END_FIELDS])
    return job


def fail_job(job_id: int, error: str, request_id: str | None = None) -> None:
    """End the job as failed; with request_id, only while that attempt owns it."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        if job is None or job.is_terminal:
            return
        if request_id is not None and job.request_id != request_id:
            return
        _end(job, Job.Status.FAILED, error=error[:4000])
        job.save(update_fields=END_FIELDS)
    _publish_job(job)


CANCEL_FLAG_KEY = "kvops:cancel:{job}"
CANCEL_FLAG_TTL_S = 3600


def _flag_cancel(job_id: int) -> None:
    """Say in Redis too that the job's cancellation was asked for: a task that claimed
    the job but has not submitted it yet (the abort cancel_job sends finds no engine
    request) looks there after its submit, cheaply."""
    try:
        live.redis_client().set(CANCEL_FLAG_KEY.format(job=job_id), 1, ex=CANCEL_FLAG_TTL_S)
    except Exception as e:  # noqa: BLE001  (then cancels_requested reads the row)
        log.warning("job %s: cancel flag not set in Redis: %s", job_id, e)


def cancels_requested(job_ids: list[int]) -> set[int]:
    """Which of these jobs' cancellation has been asked for? Redis' flags, in one call
    (no database connection for every job's task); the rows themselves if Redis does not
    answer."""
    if not job_ids:
        return set()
    try:
        flags = live.redis_client().mget([CANCEL_FLAG_KEY.format(job=j) for j in job_ids])
        return {j for j, flag in zip(job_ids, flags) if flag is not None}
    except Exception:  # noqa: BLE001
        return set(Job.objects.filter(pk__in=job_ids, cancel_requested=True)
                   .values_list("pk", flat=True))


def live_instances() -> set[str]:
    """Worker processes whose heartbeat is fresh."""
    cutoff = timezone.now() - timedelta(seconds=settings.KVOPS_ENGINE_DEAD_AFTER_S)
    return set(Engine.objects.filter(status=Engine.Status.READY, last_heartbeat__gte=cutoff)
               .values_list("instance", flat=True))


def requeue_job(job_id: int, reason: str) -> bool:
    """Put a job back in the queue to run again from its prompt (new task id, routed
    again). A job that named its engine fails instead: it cannot move elsewhere."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        if job is None or job.is_terminal:
            return False
        if job.requested_engine:
            _end(job, Job.Status.FAILED, error=f"{reason}; the job named that engine")
            job.save(update_fields=END_FIELDS)
            transaction.on_commit(lambda: _publish_job(job))
            return True
        log.warning("requeueing job %s: %s", job.pk, reason)
        job.status = Job.Status.QUEUED
        job.engine = job.engine_instance = job.request_id = ""
        job.error = f"requeued: {reason}"
        job.save(update_fields=["status", "engine", "engine_instance", "request_id", "error"])
        transaction.on_commit(lambda: dispatch_job(job.pk))
    return True


def reap() -> list[int]:
    """Find jobs nobody will finish and move them on. Running jobs whose worker process
    is gone (heartbeat stopped, or the engine restarted) run again elsewhere; queued jobs
    routed to a dead engine are routed again; queued jobs whose task was never sent are
    sent. Returns the ids touched."""
    cutoff = timezone.now() - timedelta(seconds=settings.KVOPS_ENGINE_DEAD_AFTER_S)
    Engine.objects.filter(status=Engine.Status.READY, last_heartbeat__lt=cutoff) \
        .update(status=Engine.Status.DEAD)
    alive = live_instances()
    dead_names = set(Engine.objects.exclude(status=Engine.Status.READY)
                     .values_list("name", flat=True))
    touched = []
    for job in Job.objects.filter(status=Job.Status.RUNNING).exclude(engine_instance__in=alive):
        if requeue_job(job.pk, f"engine {job.engine or '?'} stopped while running it"):
            touched.append(job.pk)
    for job in Job.objects.filter(status=Job.Status.QUEUED, queued_at__lt=cutoff):
        target = (job.routing or {}).get("engine")
        if target in dead_names and requeue_job(job.pk, f"engine {target} is not running"):
            touched.append(job.pk)
    touched += send_unsent(settings.KVOPS_OUTBOX_AFTER_S, settings.KVOPS_RESEND_AFTER_S)
    return touched


def redispatch_queued(reason: str) -> int:
    """Send every queued job again (the broker lost its messages, e.g. Redis restarted).
    Stale deliveries are ignored by claim_jobs, so a job still in the broker runs once."""
    n = 0
    for job_id in Job.objects.filter(status=Job.Status.QUEUED).values_list("pk", flat=True):
        log.warning("re-dispatching job %s: %s", job_id, reason)
        dispatch_job(job_id)
        n += 1
    return n


# --- engines --------------------------------------------------------------------------------
def register_engine(name: str, worker: str, host: str, instance: str, config: dict) -> Engine:
    """The engine's row, `starting` until its worker can take commands (its first
    heartbeat)."""
    now = timezone.now()
    engine, _ = Engine.objects.update_or_create(name=name, defaults={
        "worker": worker, "host": host, "instance": instance, "config": config,
        "status": Engine.Status.STARTING, "started_at": now, "last_heartbeat": now})
    return engine


def heartbeat(name: str, instance: str, metrics: dict) -> None:
    """The worker's beat, the first when Celery's consumer is up: the engine is ready
    and these are its metrics."""
    Engine.objects.filter(name=name, instance=instance).update(
        last_heartbeat=timezone.now(), metrics=metrics, status=Engine.Status.READY)


def mark_engine_stopped(name: str) -> None:
    Engine.objects.filter(name=name).update(status=Engine.Status.STOPPED)


# --- operator actions --------------------------------------------------------------------
ERROR_STATUS = {"UnknownRequestError": 404, "InvalidStateError": 409,
                "NotEnoughBlocksError": 409, "PrefixNotCachedError": 409,
                "InvalidRequestError": 400, "CommandExpired": 504}


def operator_action(user, engine: Engine, action: str, target: str, arguments: dict,
                    idempotency_key: str = "") -> tuple[int, dict, bool]:
    """Send one operator command to the engine's worker, record it, and answer with
    (HTTP status, body, replayed). With an idempotency key the row is stored first, so
    a retry of the same action (replayed: True) gets the first answer and the command
    is sent once; KeyReused if the key belongs to another action, or its first call is
    not answered yet."""
    params = {k: v for k, v in arguments.items() if k != "request_id"}
    row = OperatorAction(user=user, engine=engine.name, action=action, target=target,
                         params=params, idempotency_key=idempotency_key)
    if idempotency_key:
        try:
            with transaction.atomic():
                row.save()
        except IntegrityError:
            prior = OperatorAction.objects.get(user=user, idempotency_key=idempotency_key)
            if (prior.engine, prior.action, prior.target, prior.params) != \
                    (engine.name, action, target, params):
                raise KeyReused(f"{idempotency.HEADER} {idempotency_key!r} was used for "
                                f"another action ({prior.action} on {prior.engine})") from None
            if not prior.status_code:
                raise KeyReused(f"the first call with {idempotency.HEADER} "
                                f"{idempotency_key!r} is still being answered") from None
            return prior.status_code, prior.result, True
    reply = control.send_engine_command(engine.worker, action, arguments)
    if reply is None:
        status, body = 504, {"ok": False, "error": "Timeout",
                             "message": f"engine {engine.name} ({engine.worker}) did not answer "
                                        f"within {settings.KVOPS_CONTROL_TIMEOUT_S:g} s"}
    elif reply.get("ok"):
        status, body = 200, reply
    else:
        status, body = ERROR_STATUS.get(reply.get("error"), 500), reply
    row.ok, row.status_code, row.result = status == 200, status, body
    row.save()
    if status == 200 and action in STATE_COMMANDS:
        # the worker wrote the engine's new state (its heartbeat) before it answered: the
        # next read of the engines must see it
        selectors.forget_recent_engines()
        if action in ("drain", "undrain"):  # a draining worker takes nothing from the shared queue
            consumers = control.app.control
            (consumers.cancel_consumer if action == "drain" else consumers.add_consumer)(
                SHARED_QUEUE, destination=[engine.worker], reply=True,
                timeout=settings.KVOPS_CONTROL_TIMEOUT_S)
    return status, body, False
