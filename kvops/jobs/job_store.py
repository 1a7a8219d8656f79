"""A job's row through its life, after admission: the owner's cancel, the worker's
claim, progress and end, failures, and a re-run from the prompt when its worker is gone.
What a job's listeners receive (job_payload) is published from here."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from datetime import datetime

from django.db import DataError, IntegrityError, connection, transaction
from django.utils import timezone

from kvops import live
from kvops.engines import control
from kvops.monitoring import metrics_store
from kvops.models import Engine, Job
from kvops.jobs.outbox import dispatch_job
from kvops.jobs.reconnect import retried_on_reconnect
from kvops.engines.registry import live_instances

log = logging.getLogger(__name__)


class Conflict(Exception):
    """The object is in a state where the change makes no sense (HTTP 409)."""


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
        publish_job(job)
    return job


END_FIELDS = ["status", "error", "finished_at"]


def _end(job: Job, status: str, error: str = "") -> None:
    job.status = status
    job.error = error
    job.finished_at = timezone.now()


def publish_job(job: Job) -> None:
    publish_jobs([job])


def publish_jobs(jobs: list[Job]) -> None:
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
                  "finished_at", "engines", "params")


def job_payload(job: Job) -> dict:
    """What a job's websocket and SSE listeners receive: cumulative, so a missed message
    costs nothing."""
    return {"status": job.status, "attempt": job.attempts, "text": job.output_text,
            "num_output_tokens": job.num_output_tokens, "finish_reason": job.finish_reason,
            "num_prompt_tokens": job.num_prompt_tokens,
            "finished": job.is_terminal, "error": job.error, "engine": job.engine,
            "request_id": job.request_id, "num_cached_tokens": job.num_cached_tokens,
            "num_preemptions": job.num_preemptions, "samples": job.samples,
            "engines": engines_of(job),
            "cached_tokens_by_tier": _cached_by_tier(job)}


def engines_of(job: Job) -> list[dict]:
    """Each engine the job ran on, oldest first: [{engine, at, reason}] ("start", or
    "migration" for an engine it moved to while it ran). A job that ran on one engine
    stores none: its engine and start say it."""
    if job.engines:
        return job.engines
    if not job.engine:
        return []
    return [{"engine": job.engine, "at": job.started_at.isoformat() if job.started_at else None,
             "reason": "start"}]


def _cached_by_tier(job: Job) -> dict | None:
    """Its cached prompt tokens by tier ({"gpu", "cpu", "disk"}), from its KV story when
    that is loaded (never a query of its own: finish_jobs sets the story it wrote)."""
    story = job.__dict__.get("kv_story")
    return story.get("cached_tokens") if story else None


# --- jobs, worker side ------------------------------------------------------------------
MAX_ATTEMPTS = 3  # a job whose workers keep dying is failed, not retried forever


@dataclass(slots=True)
class Claim:
    """A task delivery asking to run its job on this worker."""
    job_id: int
    engine: str
    instance: str
    task_id: str


def new_attempt(engine: str, instance: str, now: datetime | None) -> dict[str, object]:
    """A claimed job's fields as its new attempt starts them, but for the two that count
    on from the row (attempts + 1, and the request id that names the attempt): running
    on this worker's engine from now, nothing of an earlier attempt left (its output,
    error, story, and the engines it moved between). The one list of what a claim resets,
    applied to a row read here (_claim) and by the database (_claim_queued)."""
    return {"status": Job.Status.RUNNING, "engine": engine, "engine_instance": instance,
            "started_at": now, "first_token_at": None, "output_text": "",
            "output_token_ids": [], "samples": [], "output_logprobs": [],
            "prompt_logprobs": [], "finish_reason": "", "error": "", "num_output_tokens": 0,
            "num_cached_tokens": 0, "num_preemptions": 0, "kv_story": None, "engines": []}


def _request_id(job_id: int, attempt: int) -> str:
    return f"job-{job_id}-{attempt}"


CLAIM_FIELDS = ["attempts", "request_id", *new_attempt("", "", None)]


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
    publish_jobs(list({**ended, **claimed}.values()))
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

    now = timezone.now()
    taken: set[int] = set()
    with connection.cursor() as cursor:
        for (task_id, engine, instance), job_ids in by_task.items():
            fresh = new_attempt(engine, instance, now)
            sets = ", ".join(f"{column(name)} = %s" for name in fresh)
            # (the request id as _request_id writes it, from the row's id and attempt)
            cursor.execute(
                f"UPDATE {quote(Job._meta.db_table)} SET "
                f"{column('attempts')} = {column('attempts')} + 1, "
                f"{column('request_id')} = 'job-' || {column('id')} || '-' || "
                f"({column('attempts')} + 1), {sets} "
                f"WHERE {column('id')} IN ({', '.join(['%s'] * len(job_ids))}) "
                f"AND {column('status')} = %s AND NOT {column('cancel_requested')} "
                f"AND {column('attempts')} < %s AND {column('celery_task_id')} = %s "
                f"RETURNING {column('id')}",
                [*(field(name).get_db_prep_save(value, connection)
                   for name, value in fresh.items()),
                 *job_ids, Job.Status.QUEUED, MAX_ATTEMPTS, task_id])
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
    job.request_id = _request_id(job.pk, job.attempts)
    for name, value in new_attempt(c.engine, c.instance, timezone.now()).items():
        setattr(job, name, value)
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
    kv_story: dict | None = None  # its KV story, when the engine told a new one


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
    kv_story: dict | None = None  # its KV story, if the engine told one


def _progress_sql(text: str, also: str = "") -> str:
    """The UPDATE of a running attempt's progress: its text set to `text` (SQL with one
    parameter: appended, or whole), the counts, the first token's time and the KV story;
    matched on id, attempt and status (and `also`)."""
    table = connection.ops.quote_name(Job._meta.db_table)
    return (f"UPDATE {table} SET output_text = {text}, num_output_tokens = %s, "
            "num_prompt_tokens = %s, num_cached_tokens = %s, num_preemptions = %s, "
            "first_token_at = COALESCE(first_token_at, %s), kv_story = COALESCE(%s, kv_story) "
            f"WHERE id = %s AND request_id = %s AND status = %s{also}")


def _progress_row():
    """A delta's parameters for _progress_sql, up to the status."""
    when = connection.ops.adapt_datetimefield_value
    story = _story_prep()
    text = Job._meta.get_field("output_text")
    return lambda d: (text.get_db_prep_value(d.text, connection), d.num_output_tokens,
                      d.num_prompt_tokens, d.num_cached_tokens, d.num_preemptions,
                      when(d.first_token_at), story(d.kv_story), d.job_id, d.request_id)


def record_progress(deltas: list[ProgressDelta]) -> tuple[set[str], set[str]]:
    """Append what running jobs produced: one statement run for every job
    (executemany) in one transaction. Each row is matched on its attempt (request id),
    so a stale attempt writes nothing. Returns (fenced, unstored): the request ids of
    stale attempts (their job runs again elsewhere, or ended: the caller stops them), and
    of those whose row the database refused (the rest of the batch is written; the
    caller keeps their text and writes it whole at the end). Plain SQL: the ORM's form
    of this (a CASE per field) costs milliseconds of Python per job, which the worker
    cannot spare."""
    sql = _progress_sql("output_text || %s")
    row = _progress_row()
    rows = [(*row(d), Job.Status.RUNNING) for d in deltas]
    unstored: set[str] = set()
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.executemany(sql, rows)
            if cursor.rowcount == -1 or cursor.rowcount >= len(rows):
                return set(), unstored
    except _REFUSED_ROW:  # one row the database will not take must not cost the others
        unstored = _rows_one_by_one(sql, rows, [d.request_id for d in deltas])
    # Some row did not match (rare): find which attempts lost their job.
    owned = set(Job.objects.filter(pk__in=[d.job_id for d in deltas], status=Job.Status.RUNNING)
                .values_list("pk", "request_id"))
    return ({d.request_id for d in deltas if (d.job_id, d.request_id) not in owned
             and d.request_id not in unstored}, unstored)


# What a database says of a row it will not store (a value it cannot hold), as opposed
# to a connection or a lock that failed the whole statement.
_REFUSED_ROW = (DataError, IntegrityError, UnicodeError, ValueError)


def _rows_one_by_one(sql: str, rows: list[tuple], keys: list) -> set:
    """Run sql for each row in a savepoint of its own; the keys of the rows refused."""
    refused: list = []
    with transaction.atomic(), connection.cursor() as cursor:
        for key, params in zip(keys, rows, strict=True):
            with _alone(key, refused, f"the progress of {key}"):
                cursor.execute(sql, params)
    return set(refused)


@contextlib.contextmanager
def _alone(key, refused: list | None, what: str):
    """One row's write (`what`, for the log). With `refused` (a list), in a savepoint
    of its own: a row the database refuses is logged and its key added to `refused`
    instead of raising (the rest of the block skipped). Without, as it is."""
    if refused is None:
        yield
        return
    try:
        with transaction.atomic():
            yield
    except _REFUSED_ROW as e:
        log.warning("the database refused %s: %s", what, e)
        refused.append(key)


@retried_on_reconnect
def hand_over(delta: ProgressDelta, to_engine: str, reason: str = "migration") -> Job | None:
    """The attempt's request now runs on engine `to_engine` (it moved there while it ran;
    the source's output processor calls this once it has seen the request end there):
    the last progress made here is appended, and the job becomes that engine's (its
    instance, `engines` one entry longer), in one transaction. The destination's writes
    wait for this (record_adopted), so the row's text stays in order. None if the
    attempt no longer owns a running job (it ended there already, or runs again)."""
    now = timezone.now()
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(
            pk=delta.job_id, request_id=delta.request_id, status=Job.Status.RUNNING).first()
        if job is None:
            return None
        instance = Engine.objects.filter(name=to_engine).values_list("instance", flat=True).first()
        job.engines = [*engines_of(job), {"engine": to_engine, "at": now.isoformat(),
                                          "reason": reason}]
        job.engine, job.engine_instance = to_engine, instance or ""
        job.output_text += delta.text
        job.num_output_tokens = delta.num_output_tokens
        job.num_preemptions = delta.num_preemptions
        if delta.first_token_at is not None and job.first_token_at is None:
            job.first_token_at = delta.first_token_at
        if delta.kv_story is not None:
            job.kv_story = delta.kv_story
        job.save(update_fields=["engines", "engine", "engine_instance", "output_text",
                                "num_output_tokens", "num_preemptions", "first_token_at",
                                "kv_story"])
    return job


@retried_on_reconnect
def record_adopted(deltas: list[ProgressDelta], instance: str) -> tuple[set[str], set[str]]:
    """The progress of attempts that moved to this engine (`instance`) and whose move the
    source has not yet written (hand_over): each delta's text is the whole output so
    far, and replaces the row's once the row is this instance's. Returns (written,
    fenced): the attempts whose row took it, and those that no longer own a running job;
    the rest wait for the hand-over (their caller writes them again)."""
    sql = _progress_sql("%s", " AND engine_instance = %s")
    row = _progress_row()
    written: set[str] = set()
    with transaction.atomic(), connection.cursor() as cursor:
        for d in deltas:
            cursor.execute(sql, (*row(d), Job.Status.RUNNING, instance))
            if cursor.rowcount:
                written.add(d.request_id)
    rest = [d for d in deltas if d.request_id not in written]
    owned = set(Job.objects.filter(pk__in=[d.job_id for d in rest], status=Job.Status.RUNNING)
                .values_list("pk", "request_id")) if rest else set()
    return written, {d.request_id for d in rest if (d.job_id, d.request_id) not in owned}


@retried_on_reconnect
def finish_jobs(finals: list[FinalState]) -> list[Job]:
    """Attempts that ended: finished, or aborted (cancelled by their owner or an
    operator). Writes their final state in one transaction and returns the jobs, as
    stored (finished ones with PAYLOAD_FIELDS only), that were still those attempts' (a
    job that ended meanwhile, or runs again elsewhere, is left alone). Plain SQL for the
    finished ones, for the output processor's sake (hundreds can end in one step); an
    abort needs the row to word its reason, and takes the ORM. A job whose row the
    database refuses (a value it cannot hold) fails alone, "its result could not be
    stored", and is returned so; the others' ends are written."""
    refused: list[FinalState] = []  # (failed: their end could not be stored)
    table = connection.ops.quote_name(Job._meta.db_table)
    sql = (f"UPDATE {table} SET output_text = %s, output_token_ids = %s, "
           "num_output_tokens = %s, num_prompt_tokens = %s, num_cached_tokens = %s, "
           "num_preemptions = %s, first_token_at = COALESCE(first_token_at, %s), "
           "finish_reason = %s, samples = %s, output_logprobs = %s, prompt_logprobs = %s, "
           "kv_story = COALESCE(%s, kv_story), status = %s, error = '', finished_at = %s "
           "WHERE id = %s AND request_id = %s AND status IN (%s, %s)")
    text = Job._meta.get_field("output_text")
    token_ids = Job._meta.get_field("output_token_ids")
    samples = Job._meta.get_field("samples")
    logprobs = Job._meta.get_field("output_logprobs")
    when = connection.ops.adapt_datetimefield_value
    now = when(timezone.now())
    story = _story_prep()
    rows, keys = [], []
    aborts = [f for f in finals if f.finish_reason == "abort"]
    for f in finals:
        if f.finish_reason == "abort":
            continue
        try:
            rows.append((
                text.get_db_prep_value(f.text, connection),
                token_ids.get_db_prep_value(f.token_ids, connection),
                len(f.token_ids), f.num_prompt_tokens, f.num_cached_tokens, f.num_preemptions,
                when(f.first_token_at), f.finish_reason,
                samples.get_db_prep_value(f.samples, connection),
                logprobs.get_db_prep_value(f.logprobs, connection),
                logprobs.get_db_prep_value(f.prompt_logprobs, connection),
                story(f.kv_story), Job.Status.FINISHED, now, f.job_id,
                f.request_id, Job.Status.RUNNING, Job.Status.QUEUED))
            keys.append(f)
        except _REFUSED_ROW as e:  # (a value that cannot even be put in SQL)
            log.warning("the end of job %s cannot be stored: %s", f.job_id, e)
            refused.append(f)

    def write(alone: list | None) -> tuple[list[int], list[Job]]:
        """The ends, in one transaction; with `alone`, each row in a savepoint of its
        own, those the database refuses added to it."""
        finished, aborted = [], []
        with transaction.atomic(), connection.cursor() as cursor:
            for f, params in zip(keys, rows, strict=True):
                with _alone(f, alone, f"the end of job {f.job_id}"):
                    cursor.execute(sql, params)
                    if cursor.rowcount:
                        finished.append(f.job_id)
            for f in aborts:
                with _alone(f, alone, f"the end of job {f.job_id}"):
                    job = _finish_aborted(f)
                    if job is not None:
                        aborted.append(job)
        return finished, aborted

    try:
        finished, aborted = write(None)
    except _REFUSED_ROW:  # each on its own: one job's row the database refuses fails it alone
        finished, aborted = write(refused)
    for f in refused:  # failed, with the reason, while the attempt still owns it
        fail_job(f.job_id, "the job's result could not be stored", f.request_id,
                 publish=False)
    aborted += Job.objects.filter(pk__in=[f.job_id for f in refused],
                                  status=Job.Status.FAILED).only(*PAYLOAD_FIELDS)
    # Read back only what the job's final update and its latency need (not its prompt,
    # token ids or logprobs: parsing those JSON lists was a third of a job's end)
    jobs = list(Job.objects.filter(pk__in=finished).only(*PAYLOAD_FIELDS))
    stories = {f.job_id: f.kv_story for f in finals if f.kv_story}
    for job in jobs:  # (the story as just written, for job_payload; not read back)
        job.kv_story = stories.get(job.pk)
    jobs += aborted
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
    job.kv_story = final.kv_story or job.kv_story
    reason = "cancelled by its owner" if job.cancel_requested \
        else f"aborted by an operator on engine {job.engine}"
    _end(job, Job.Status.CANCELLED, error=reason)
    job.save(update_fields=[
        "output_text", "output_token_ids", "num_output_tokens", "num_prompt_tokens",
        "num_cached_tokens", "num_preemptions", "first_token_at", "finish_reason", "samples",
        "output_logprobs", "prompt_logprobs", "kv_story", *END_FIELDS])
    return job


def _story_prep():
    """A KV story as a parameter of plain SQL: JSON, or NULL (COALESCE keeps the one
    stored) when there is none."""
    field = Job._meta.get_field("kv_story")
    return lambda story: None if story is None else field.get_db_prep_value(story, connection)


@retried_on_reconnect
def fail_job(job_id: int, error: str, request_id: str | None = None,
             publish: bool = True) -> None:
    """End the job as failed; with request_id, only while that attempt owns it."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        if job is None or job.is_terminal:
            return
        if request_id is not None and job.request_id != request_id:
            return
        _end(job, Job.Status.FAILED, error=error[:4000])
        job.save(update_fields=END_FIELDS)
    if publish:
        publish_job(job)


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
            transaction.on_commit(lambda: publish_job(job))
            return True
        log.warning("requeueing job %s: %s", job.pk, reason)
        job.status = Job.Status.QUEUED
        job.engine = job.engine_instance = job.request_id = ""
        job.error = f"requeued: {reason}"
        job.save(update_fields=["status", "engine", "engine_instance", "request_id", "error"])
        transaction.on_commit(lambda: dispatch_job(job.pk))
    return True
