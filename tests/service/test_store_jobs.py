"""admission.create_jobs stores a batch with INSERTs built before its transaction: every
row as the ORM's bulk_create would store it, each job given its own id, in as many
statements as the database's parameter limit needs."""
import pytest
from django.contrib.auth.models import User

from kvops.jobs import admission
from kvops.intake.intake import NewJob
from kvops.models import Job

pytestmark = pytest.mark.django_db(transaction=True)


def new_jobs(owner) -> list[NewJob]:
    return [NewJob(owner, {"max_tokens": 5, "stop": ["\n"]}, "a prompt", priority=2,
                            engine="eng-a", idempotency_key="key-1"),
            NewJob(owner, {"max_tokens": 7}, messages=[{"role": "user",
                                                                 "content": "hi"}],
                            source=Job.Source.OPENAI),
            NewJob(owner, {}, "third", engine="eng-b")]


def stored(job: Job) -> dict:
    row = Job.objects.get(pk=job.pk)
    return {f.attname: getattr(row, f.attname) for f in Job._meta.concrete_fields
            if f.attname not in ("id", "owner_id", "queued_at", "celery_task_id",
                                 "dispatched_at")}  # (set once its task is sent)


@pytest.mark.parametrize("rows_per_insert", [None, 2])
def test_a_batch_is_stored_as_bulk_create_stores_it(monkeypatch, rows_per_insert):
    owner = User.objects.create(username="store")
    other = User.objects.create(username="store-reference")  # (its own idempotency keys)
    if rows_per_insert:
        monkeypatch.setattr(admission, "_rows_per_insert", lambda *args: rows_per_insert)
    statements = []
    real = admission._insert_statements
    monkeypatch.setattr(admission, "_insert_statements",
                        lambda jobs: statements.extend(real(jobs)) or statements)
    jobs = admission.create_jobs(new_jobs(owner))
    assert len(statements) == (2 if rows_per_insert else 1)
    assert all(job.pk and not job._state.adding for job in jobs)
    assert [job.pk for job in jobs] == sorted({job.pk for job in jobs})
    for job, new in zip(jobs, new_jobs(owner)):
        assert (job.prompt, job.messages, job.params) == (new.prompt, new.messages, new.params)
        reference = Job(owner=other, prompt=new.prompt, messages=new.messages,
                        params=new.params, priority=new.priority,
                        requested_engine=new.engine, source=new.source,
                        idempotency_key=new.idempotency_key, routing=job.routing)
        Job.objects.bulk_create([reference])
        assert stored(job) == stored(reference)
        assert Job.objects.get(pk=job.pk).queued_at is not None


def test_a_duplicate_idempotency_key_stores_nothing_of_its_batch():
    from django.db import IntegrityError
    owner = User.objects.create(username="store-dup")
    admission.create_jobs([NewJob(owner, {}, "first", idempotency_key="same")])
    with pytest.raises(IntegrityError):
        admission.create_jobs([NewJob(owner, {}, "other"),
                              NewJob(owner, {}, "again", idempotency_key="same")])
    assert list(Job.objects.filter(owner=owner).values_list("prompt", flat=True)) == ["first"]
