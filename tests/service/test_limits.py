"""Per-user limits on job submission, over REST and /v1 alike, in this process against
the database and the test session's Redis (the broker and the rate counts): a rate with
a 429 and Retry-After, a cap on jobs queued or running, staff exempt from both."""
import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from kvops.jobs.throttles import JobSubmitThrottle

pytestmark = pytest.mark.django_db(transaction=True)
JOB = {"prompt": "limits", "max_tokens": 2}


@pytest.fixture()
def users():
    erin = User.objects.create_user("erin", password="mauve-tractor-41-lake")
    boss = User.objects.create_user("boss", password="mauve-tractor-41-lake", is_staff=True)
    return erin, boss


def rest(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


async def v1(async_client, user, **body):
    token = await Token.objects.acreate(user=user) if not await Token.objects.filter(
        user=user).aexists() else await Token.objects.aget(user=user)
    return await async_client.post(
        "/v1/completions", {"model": "any", "prompt": "limits", "max_tokens": 2, **body},
        content_type="application/json", headers={"Authorization": f"Bearer {token.key}"})


def test_the_rest_rate_limit_answers_429_with_retry_after(users, monkeypatch):
    monkeypatch.setattr(JobSubmitThrottle, "THROTTLE_RATES", {"jobs": "2/min"})
    erin, boss = users
    from django.core.cache import cache
    cache.clear()
    assert [rest(erin).post("/api/jobs/", JOB, format="json").status_code
            for _ in range(2)] == [201, 201]
    refused = rest(erin).post("/api/jobs/", JOB, format="json")
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    assert rest(erin).get("/api/jobs/").status_code == 200  # reading is not limited
    assert all(rest(boss).post("/api/jobs/", JOB, format="json").status_code == 201
               for _ in range(3))  # staff are exempt


@pytest.mark.asyncio
async def test_the_v1_rate_limit_answers_429_with_retry_after(users, async_client,
                                                              monkeypatch):
    monkeypatch.setattr(JobSubmitThrottle, "THROTTLE_RATES", {"jobs": "1/min"})
    erin, _ = users
    from django.core.cache import cache
    await cache.aclear()
    first = await v1(async_client, erin)
    assert first.status_code != 429  # (a 404: no engine serves "any" here)
    refused = await v1(async_client, erin)
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    assert refused.json()["error"]["type"] == "rate_limit_exceeded"


def test_jobs_queued_or_running_are_capped_per_user(users, settings):
    settings.KVOPS_MAX_JOBS_PER_USER = 2
    erin, boss = users
    for _ in range(2):
        assert rest(erin).post("/api/jobs/", JOB, format="json").status_code == 201
    refused = rest(erin).post("/api/jobs/", JOB, format="json")
    assert refused.status_code == 429 and "KVOPS_MAX_JOBS_PER_USER=2" in refused.json()["error"]["message"]
    assert rest(boss).post("/api/jobs/", JOB, format="json").status_code == 201
    from kvops.models import Job
    Job.objects.filter(owner=erin).update(status=Job.Status.FINISHED)  # they ended
    assert rest(erin).post("/api/jobs/", JOB, format="json").status_code == 201


@pytest.mark.asyncio
async def test_the_cap_holds_on_v1_too(users, async_client, settings):
    settings.KVOPS_MAX_JOBS_PER_USER = 1
    erin, _ = users
    from django.utils import timezone

    from kvops import selectors
    from kvops.models import Engine, Job
    await Engine.objects.acreate(  # an engine serving "any" (the cap is counted as the
        name="capped", worker="engine-capped@here", status=Engine.Status.READY,  # job
        last_heartbeat=timezone.now(), config={"model": "any", "simulate": True,  # is
                                               "block_size": 16})  # stored, after the
    selectors.forget_recent_engines()  # model check)
    await Job.objects.acreate(owner=erin, prompt="already queued", params={})
    refused = await v1(async_client, erin)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_jobs"
    assert await Job.objects.filter(owner=erin).acount() == 1


def test_a_job_counts_its_n_sequences(users, settings):
    settings.KVOPS_MAX_SEQS_PER_USER = 8
    erin, boss = users
    assert rest(erin).post("/api/jobs/", {**JOB, "n": 6}, format="json").status_code == 201
    refused = rest(erin).post("/api/jobs/", {**JOB, "n": 3}, format="json")
    assert refused.status_code == 429, refused.content
    assert "KVOPS_MAX_SEQS_PER_USER=8" in refused.json()["error"]["message"]
    assert "would make 9" in refused.json()["error"]["message"]
    assert rest(erin).post("/api/jobs/", {**JOB, "n": 2}, format="json").status_code == 201
    assert rest(boss).post("/api/jobs/", {**JOB, "n": 16}, format="json").status_code == 201
