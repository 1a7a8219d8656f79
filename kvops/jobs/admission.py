"""Admission: a parsed job (kvops/intake/intake.py) checked and stored, the one pipeline every
API submits through (REST from a thread, /v1 from the event loop).

A job is first matched against its owner's earlier submission under the same
Idempotency-Key (a retry gets the first job); its structured-output constraint is
compiled (kvops/intake/grammar_check.py: seconds, at worst, so never inside a batch); then the
calls that arrive together are checked and stored together (kvops/jobs/group_commit.py): each
is checked on its own against the engines (a bad one gets its own error, its prompt
rendered once), the good ones go in one transaction and one INSERT, and each /v1 call's
listener is bound inside that transaction, before any task is sent.

A burst of N streamed completions used to cost N write transactions on the web's one
database thread; with SQLite, whose writers poll for the lock with sleeps of up to
100 ms, a burst of 256 took seconds to admit while the worker's own writes held the lock.
"""
from __future__ import annotations

import sqlite3
import uuid
from dataclasses import dataclass
from typing import Callable

from asgiref.sync import sync_to_async
from django.db import IntegrityError, close_old_connections, transaction
from redis.exceptions import RedisError

from kvops.intake import grammar_check, intake
from kvops.jobs import idempotency, outbox
from kvops.jobs.group_commit import GroupCommit
from kvops.jobs.idempotency import KeyReused
from kvops.intake.intake import NewJob
from kvops.models import Job
from kvops.jobs.throttles import TooManyJobs, over_caps


class Unavailable(Exception):
    """A service the call needs (Redis) is unreachable now; nothing was stored (HTTP 503)."""


MAX_BATCH = 256  # jobs in one transaction
MAX_JOBS_PER_TASK = 64  # jobs admitted together for one engine travel in one task


@dataclass(slots=True)
class Admission:
    """One call waiting to be stored."""
    new: NewJob
    bind: Callable[[Job], None] | None = None  # bind(job) inside the transaction


def admit(new: NewJob) -> Job:
    """Check and store the job (from a thread); its earlier twin under the same
    Idempotency-Key if there is one (marked `replayed`)."""
    if new.idempotency_key:  # a retry gets the first answer, even if the engine has gone
        prior = prior_job(new)
        if prior is not None:
            return prior
    grammar_check.check(new.params.get("structured"), new.field_name("structured"),
                        new.engine, new.model or None)
    return _group(Admission(new))


async def admit_async(new: NewJob, bind: Callable[[Job], None]) -> Job:
    """admit, from the event loop: the compile waits on the grammar checker's threads,
    the batch is written on another; bind(job) runs inside the storing transaction (or
    on the earlier job a retry replays, before it is read)."""
    if new.idempotency_key:
        prior = await sync_to_async(_prior_bound, thread_sensitive=False)(new, bind)
        if prior is not None:
            return prior
    await grammar_check.check_async(new.params.get("structured"),
                                    new.field_name("structured"), new.engine,
                                    new.model or None)
    return await _group.one(Admission(new, bind))


def _store(batch: list[Admission]) -> list[Job | BaseException]:
    """Check each call and store the good ones in one transaction; per call, its job or
    its error."""
    close_old_connections()
    try:
        results: list[Job | BaseException | None] = []
        good: list[Admission] = []
        for item in batch:
            try:
                prior = _prior_bound(item.new, item.bind) if item.new.idempotency_key else None
                if prior is None:
                    intake.check(item.new)
            except Exception as e:  # noqa: BLE001  (that call's own error, e.g. a 400)
                results.append(e)
                continue
            results.append(prior)
            if prior is None:
                good.append(item)
        if good:
            def bind(stored: list) -> None:
                for item, job in zip(good, stored):
                    if item.bind is not None and isinstance(job, Job):
                        item.bind(job)

            try:
                stored = iter(create_jobs([item.new for item in good], on_stored=bind))
            except IntegrityError:
                # a call with the same key stored its job since: this one is its retry
                if len(good) == 1 and good[0].new.idempotency_key:
                    prior = _prior_bound(good[0].new, good[0].bind)
                    if prior is not None:
                        return [prior if r is None else r for r in results]
                raise
            results = [next(stored) if r is None else r for r in results]
        return results
    finally:
        close_old_connections()


_group: GroupCommit[Admission, Job] = GroupCommit(_store, max_batch=MAX_BATCH)


def prior_job(new: NewJob) -> Job | None:
    """The job its owner submitted under the same idempotency key, marked `replayed`;
    None if there is none. KeyReused if that job asked for something else."""
    prior = Job.objects.filter(owner=new.owner, idempotency_key=new.idempotency_key).first()
    if prior is None:
        return None
    same = (prior.prompt, prior.messages, prior.params, prior.priority, prior.requested_engine,
            prior.model) == (new.prompt, new.messages, new.params, new.priority, new.engine,
                             new.model)
    if not same:
        raise KeyReused(f"{idempotency.HEADER} {new.idempotency_key!r} was used for another "
                        f"request (job {prior.pk}); use a new key for a new job")
    prior.replayed = True
    return prior


def _prior_bound(new: NewJob, bind: Callable[[Job], None] | None) -> Job | None:
    """prior_job, with the caller's listener bound to it before its row is read again
    (so that the listener misses no update between the two)."""
    prior = prior_job(new)
    if prior is not None and bind is not None:
        bind(prior)
        prior.refresh_from_db()
        prior.replayed = True
    return prior


def create_jobs(new: list[NewJob], on_stored=None) -> list[Job | TooManyJobs]:
    """Store jobs in one INSERT and send their tasks once the transaction commits.
    Returns, per NewJob, its Job, or the TooManyJobs that kept it out: a job that would
    take its owner past a cap (kvops/jobs/throttles.py) is not stored, and the caps are
    counted inside the storing transaction, so concurrent submissions cannot both pass.

    Each job is routed first, so its row holds its queue decision and task id from the
    start (no second write; a worker that takes the task finds the row complete), and a
    routing failure (Redis away) stores nothing. Jobs routed to the same queue share a
    task (up to MAX_JOBS_PER_TASK each): one delivery for a burst. on_stored(results),
    if given, runs inside the transaction with what will be returned (the /v1 path binds
    its listeners there)."""
    from kvops.routing.routing import choose_queues

    every = [Job(owner=n.owner, prompt=n.prompt, messages=n.messages, params=n.params,
                 prompt_token_ids=n.token_ids, tokenizer=n.tokenizer, model=n.model,
                 num_prompt_tokens=len(n.token_ids or ()),
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
        transaction.on_commit(lambda: outbox.send_tasks(jobs, queues))
    return results


def create_job(new: NewJob) -> Job:
    """Store one job as it is (no check against the engines: admit() does that), for
    the service's own callers; its earlier twin under the same Idempotency-Key if any."""
    if new.idempotency_key:
        prior = prior_job(new)
        if prior is not None:
            return prior
    [result] = create_jobs([new])
    if isinstance(result, TooManyJobs):
        raise result
    return result


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
