"""Whatever a model or a client writes is stored as written, on SQLite and on PostgreSQL
(which refuses U+0000 in text and in jsonb strings): the prompt, chat messages and stop
strings at intake, the text appended while a job runs and its end (text, samples,
logprobs), and what a database write of one job cannot do to the others' in its batch."""
import pytest
from django.contrib.auth.models import User
from django.db import connection

from kvops.intake.intake import NewJob
from kvops.jobs import admission, job_store
from kvops.models import Job
from kvops.text_fields import ESCAPE, escape_text, unescape_text

pytestmark = pytest.mark.django_db(transaction=True)

NUL = "\x00"
ODD = f"a{NUL}b{ESCAPE}c{ESCAPE}0{NUL}{NUL}~"  # the escape's own characters around NUL


def test_the_escape_round_trips_and_appends_piece_by_piece():
    class Postgres:
        vendor = "postgresql"

    for text in ["", "plain", NUL, ESCAPE, ODD, ESCAPE + "~", ESCAPE + "0"]:
        stored = escape_text(text, Postgres)
        assert NUL not in stored and unescape_text(stored) == text
    for cut in range(len(ODD) + 1):  # escaping is per character: pieces append
        head, tail = ODD[:cut], ODD[cut:]
        assert unescape_text(escape_text(head, Postgres) + escape_text(tail, Postgres)) == ODD
    assert escape_text(ODD, type("SQLite", (), {"vendor": "sqlite"})) == ODD


def test_a_job_with_nul_everywhere_is_stored_and_read_back_as_written():
    owner = User.objects.create(username="nul")
    [job] = admission.create_jobs([NewJob(
        owner, {"max_tokens": 5, "stop": [NUL, ODD]},
        messages=[{"role": "user", "content": ODD}], source=Job.Source.OPENAI)])
    [plain] = admission.create_jobs([NewJob(owner, {"max_tokens": 5}, "a prompt " + ODD)])
    row = Job.objects.get(pk=job.pk)
    assert row.messages == [{"role": "user", "content": ODD}]
    assert row.params["stop"] == [NUL, ODD]
    assert Job.objects.get(pk=plain.pk).prompt == "a prompt " + ODD
    assert Job.objects.filter(prompt="a prompt " + ODD).count() == 1  # a lookup escapes too

    running = []
    for j in (job, plain):
        Job.objects.filter(pk=j.pk).update(status=Job.Status.RUNNING, attempts=1,
                                           request_id=f"job-{j.pk}-1", engine="e")
        running.append(Job.objects.get(pk=j.pk))
    # progress of both in one write, NUL in one of them: both are written
    for piece in (ODD[:3], ODD[3:]):
        assert job_store.record_progress([
            job_store.ProgressDelta(j.pk, j.request_id, piece, 2, 3, 0, 0)
            for j in running]) == (set(), set())
    assert [Job.objects.get(pk=j.pk).output_text for j in running] == [ODD, ODD]
    values = list(Job.objects.filter(pk__in=[j.pk for j in running])
                  .values_list("output_text", flat=True))
    assert values == [ODD, ODD]

    final = job_store.FinalState(
        job.pk, running[0].request_id, ODD + NUL, [0, 1, 2], 3, 0, 0, "stop", None,
        samples=[{"text": ODD, "finish_reason": "stop"}],
        logprobs=[[0, -0.5, {NUL: -0.5, ODD: -1.0}]])
    [ended] = job_store.finish_jobs([final])
    assert ended.output_text == ODD + NUL
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.output_text) == (Job.Status.FINISHED, ODD + NUL)
    assert row.samples == [{"text": ODD, "finish_reason": "stop"}]
    assert row.output_logprobs == [[0, -0.5, {NUL: -0.5, ODD: -1.0}]]
    assert job_store.job_payload(row)["text"] == ODD + NUL
    if connection.vendor == "postgresql":  # stored escaped, with no NUL in it
        with connection.cursor() as cursor:
            cursor.execute("SELECT output_text, samples::text FROM kvops_job WHERE id = %s",
                           [job.pk])
            text, samples = cursor.fetchone()
        assert NUL not in text and "\\u0000" not in samples and unescape_text(text) == ODD + NUL


@pytest.mark.parametrize("bad", [{"kv_story": {"blocks": float("nan")}},  # not JSON
                                 {"text": "\ud800"}])  # not Unicode
def test_a_row_the_database_refuses_fails_its_job_alone(bad):
    owner = User.objects.create(username="refused")
    jobs = []
    for _ in range(3):
        job = Job.objects.create(owner=owner, prompt="p", status=Job.Status.RUNNING,
                                 attempts=1, engine="e")
        job.request_id = f"job-{job.pk}-1"
        job.save(update_fields=["request_id"])
        jobs.append(job)
    ok, broken, other = jobs
    fields = {"text": "more", "kv_story": None, **bad}

    def delta(job, **change):
        return job_store.ProgressDelta(job.pk, job.request_id, change.get("text", "more"), 1,
                                       3, 0, 0, kv_story=change.get("kv_story"))

    fenced, unstored = job_store.record_progress([delta(ok), delta(broken, **fields),
                                                  delta(other)])
    assert (fenced, unstored) == (set(), {broken.request_id})
    texts = dict(Job.objects.values_list("pk", "output_text"))
    assert (texts[ok.pk], texts[broken.pk], texts[other.pk]) == ("more", "", "more")

    def final(job, **change):
        return job_store.FinalState(job.pk, job.request_id, change.get("text", "done"), [1],
                                    3, 0, 0, "stop", None, kv_story=change.get("kv_story"))

    ended = job_store.finish_jobs([final(ok), final(broken, **fields), final(other)])
    assert sorted((j.pk, j.status) for j in ended) == [
        (ok.pk, Job.Status.FINISHED), (broken.pk, Job.Status.FAILED),
        (other.pk, Job.Status.FINISHED)]
    rows = {j.pk: j for j in Job.objects.all()}
    assert rows[ok.pk].output_text == rows[other.pk].output_text == "done"
    assert rows[broken.pk].error == "the job's result could not be stored"


def test_a_failure_written_after_the_database_dropped_its_connection_is_written():
    """PostgreSQL restarted (or failed over) under a worker: its thread's connection is
    dead, and Django learns so only from a failed query. The write runs again on a new
    connection and the job's error is the job's own, not the connection's."""
    if connection.vendor != "postgresql":
        pytest.skip("a server that ends connections: the PostgreSQL pass runs this")
    import psycopg
    owner = User.objects.create(username="reconnect")
    job = Job.objects.create(owner=owner, prompt="p", status=Job.Status.RUNNING, attempts=1,
                             engine="e", request_id="job-x-1")
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    settings = connection.settings_dict
    with psycopg.connect(host=settings["HOST"], port=settings["PORT"] or 5432,
                         user=settings["USER"], dbname=settings["NAME"],
                         autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    job_store.fail_job(job.pk, "its engine refused it", "job-x-1", publish=False)
    job.refresh_from_db()
    assert (job.status, job.error) == (Job.Status.FAILED, "its engine refused it")
    assert connection.connection.info.backend_pid != pid
