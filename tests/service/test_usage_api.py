"""GET /api/usage/: the bill per user or tenant equals the sum of its jobs' own usage
(rows written straight to the database with known numbers and KV stories); a plain user
sees only their own; bad input is a 400 naming the field; CSV carries the same rows."""
import csv
import io
from datetime import datetime, timedelta, timezone

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from kvops.jobs import usage
from kvops.models import Job
from kvops.routing import tenancy

pytestmark = pytest.mark.django_db(transaction=True)
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
PERIOD = {"since": T0.isoformat(), "until": (T0 + timedelta(hours=1)).isoformat()}


def story(cached: dict, held: dict | None) -> dict:
    """The parts of a KV story (engine/observe/story.py) the bill reads."""
    return {"cached_tokens": cached, **({"block_seconds": held} if held is not None else {})}


@pytest.fixture()
def users():
    return {"alice": User.objects.create_user("alice", password="x-alice-pass-1"),
            "bob": User.objects.create_user("bob", password="x-bob-pass-1"),
            "root": User.objects.create_user("root", password="x-root-pass-1", is_staff=True)}


@pytest.fixture()
def jobs(users):
    """Jobs with known numbers: those that count (ended inside the period) and those that
    must not (running, ended before it, ended at its end)."""
    def job(owner, status, minute, prompt, cached, output, kv_story=None, samples=None):
        return Job.objects.create(
            owner=users[owner], status=status, finished_at=T0 + timedelta(minutes=minute),
            num_prompt_tokens=prompt, num_cached_tokens=cached, num_output_tokens=output,
            kv_story=kv_story, samples=samples or [])
    counted = [
        job("alice", Job.Status.FINISHED, 1, 100, 64, 20,
            story({"gpu": 48, "cpu": 16, "disk": 0}, {"gpu": 8.0, "cpu": 0.5})),
        job("alice", Job.Status.CANCELLED, 2, 50, 32, 3,
            story({"gpu": 0, "cpu": 16, "disk": 16}, {"gpu": 2.25, "cpu": 1.0})),
        job("alice", Job.Status.FAILED, 3, 30, 0, 0),  # no story: its engine kept none
        # n = 2: output counts every sample's tokens
        job("bob", Job.Status.FINISHED, 4, 70, 16, 5,
            story({"gpu": 16, "cpu": 0, "disk": 0}, {"gpu": 4.0, "cpu": 0.0}),
            samples=[{"token_ids": [1] * 5}, {"token_ids": [2] * 7}]),
        # a story told before block-seconds were: its tiers count, its seconds are 0
        job("root", Job.Status.FINISHED, 5, 40, 16, 9, story({"gpu": 16, "cpu": 0, "disk": 0},
                                                            None)),
    ]
    job("alice", Job.Status.RUNNING, 10, 1000, 0, 0)  # not ended
    job("alice", Job.Status.FINISHED, -1, 1000, 0, 0)  # ended before since
    job("bob", Job.Status.FINISHED, 60, 1000, 0, 0)  # ended at until: outside [since, until)
    return counted


def client(user) -> APIClient:
    c = APIClient()
    c.force_authenticate(user)
    return c


def expected_row(jobs: list[Job]) -> dict:
    """The sum of these jobs' own numbers, written out by hand from their fields."""
    def of(job):
        s = job.kv_story or {}
        held = s.get("block_seconds") or {}
        return {"prompt_tokens": job.num_prompt_tokens,
                "prompt_tokens_computed": job.num_prompt_tokens - job.num_cached_tokens,
                "cached_tokens": job.num_cached_tokens,
                **{f"cached_tokens_{t}": (s.get("cached_tokens") or {}).get(t, 0)
                   for t in ("gpu", "cpu", "disk")},
                "output_tokens": sum(len(x["token_ids"]) for x in job.samples)
                if job.samples else job.num_output_tokens,
                "kv_block_seconds_gpu": held.get("gpu", 0.0),
                "kv_block_seconds_cpu": held.get("cpu", 0.0),
                "jobs_untold": 0 if s else 1}
    total = {"jobs": len(jobs)}
    for job in jobs:
        for name, value in of(job).items():
            total[name] = total.get(name, 0) + value
    return total


def rows(answer) -> dict:
    assert answer.status_code == 200, answer.content
    body = answer.json()
    return {r[body["by"]]: {k: v for k, v in r.items() if k != body["by"]}
            for r in body["rows"]}


def test_staff_see_every_user_each_row_the_sum_of_its_jobs(users, jobs):
    got = rows(client(users["root"]).get("/api/usage/", {"by": "user", **PERIOD}))
    assert got == {"alice": expected_row(jobs[:3]), "bob": expected_row(jobs[3:4]),
                   "root": expected_row(jobs[4:])}
    # the numbers written out once, so that a formula shared by both sides cannot hide
    assert got["alice"] == {"jobs": 3, "prompt_tokens": 180, "prompt_tokens_computed": 84,
                            "cached_tokens": 96, "cached_tokens_gpu": 48,
                            "cached_tokens_cpu": 32, "cached_tokens_disk": 16,
                            "output_tokens": 23, "kv_block_seconds_gpu": 10.25,
                            "kv_block_seconds_cpu": 1.5, "jobs_untold": 1}
    assert got["bob"]["output_tokens"] == 12
    # one user's rows, for staff
    only = rows(client(users["root"]).get("/api/usage/", {"user": "bob", **PERIOD}))
    assert only == {"bob": expected_row(jobs[3:4])}


def test_by_tenant_labels_each_user_and_puts_staff_under_staff(users, jobs):
    got = rows(client(users["root"]).get("/api/usage/", {"by": "tenant", **PERIOD}))
    assert got == {tenancy.tenant(users["alice"]): expected_row(jobs[:3]),
                   tenancy.tenant(users["bob"]): expected_row(jobs[3:4]),
                   usage.STAFF_TENANT: expected_row(jobs[4:])}


def test_a_plain_user_sees_only_their_own_usage(users, jobs):
    bob = client(users["bob"])
    assert rows(bob.get("/api/usage/", PERIOD)) == {"bob": expected_row(jobs[3:4])}
    assert rows(bob.get("/api/usage/", {"user": "alice", **PERIOD})) == \
        {"bob": expected_row(jobs[3:4])}
    assert rows(bob.get("/api/usage/", {"by": "tenant", **PERIOD})) == \
        {tenancy.tenant(users["bob"]): expected_row(jobs[3:4])}


def test_the_default_period_is_the_last_24_hours(users):
    now = datetime.now(timezone.utc)
    for minutes_ago in (10, 25 * 60):
        Job.objects.create(owner=users["alice"], status=Job.Status.FINISHED,
                           finished_at=now - timedelta(minutes=minutes_ago),
                           num_prompt_tokens=minutes_ago)
    got = rows(client(users["alice"]).get("/api/usage/"))
    assert got["alice"]["jobs"] == 1 and got["alice"]["prompt_tokens"] == 10
    # until alone: since is 24 h before it
    long_ago = client(users["alice"]).get("/api/usage/", {"until": "2000-01-01T00:00:00Z"})
    assert rows(long_ago) == {}
    assert long_ago.json()["since"] == "1999-12-31T00:00:00+00:00"


@pytest.mark.parametrize("params, field", [
    ({"by": "engine"}, "by"),
    ({"since": "yesterday"}, "since"),
    ({"until": "2026-13-01T00:00:00Z"}, "until"),
    ({"since": PERIOD["until"], "until": PERIOD["since"]}, "since"),
    ({"since": PERIOD["since"], "until": PERIOD["since"]}, "since"),
    ({"since": "2999-01-01T00:00:00Z"}, "since"),  # after until's default, now
])
def test_bad_input_is_a_400_naming_the_field(users, params, field):
    answer = client(users["alice"]).get("/api/usage/", params)
    assert answer.status_code == 400, answer.content
    assert answer["Content-Type"].startswith("application/json")
    error = answer.json()["error"]
    assert error["type"] == "invalid_request" and error["field"] == field, error
    # the same answer when CSV was asked for
    answer = client(users["alice"]).get("/api/usage/", {**params, "format": "csv"})
    assert answer.status_code == 400 and answer.json()["error"]["field"] == field


def test_options_describes_the_view_as_json_even_when_csv_is_asked(users):
    answer = client(users["alice"]).options("/api/usage/?by=tenant&format=csv")
    assert answer.status_code == 200 and answer["Content-Type"].startswith("application/json")
    assert answer.json()["name"]


def test_csv_has_the_same_rows_and_numbers(users, jobs):
    root = client(users["root"])
    as_json = root.get("/api/usage/", {"by": "user", **PERIOD}).json()["rows"]
    answer = root.get("/api/usage/", {"by": "user", "format": "csv", **PERIOD})
    assert answer.status_code == 200 and answer["Content-Type"].startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(answer.content.decode())))
    assert [r["user"] for r in table] == [r["user"] for r in as_json] == ["alice", "bob", "root"]
    for line, row in zip(table, as_json):
        assert set(line) == set(row)
        for name, value in row.items():
            assert line[name] == str(value), (name, line[name], value)


def test_the_schema_describes_the_usage_view(users):
    answer = client(users["root"]).get("/api/schema/", {"format": "json"})
    assert answer.status_code == 200
    operation = answer.json()["paths"]["/api/usage/"]["get"]
    assert {p["name"] for p in operation["parameters"]} >= {"by", "since", "until", "format"}
