"""GET /api/engines/<name>/events/: the stored KV event history, a page at a time,
from an event id or a time, in this process against the session's Redis."""
import time
from datetime import datetime, timezone

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from kvops import live
from kvops.models import Engine
from tests.support.wait import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture()
def client():
    user = User.objects.create_user("olive", password="mauve-tractor-41-lake")
    c = APIClient()
    c.force_authenticate(user)
    return c


def _until_past(ms: int) -> None:
    """Wait for the clock to pass this millisecond (Redis stamps stream ids with it)."""
    wait_until(lambda: int(time.time() * 1000), f"the clock past {ms} ms", 5,
               until=lambda now: now > ms, poll_s=0)


def test_pages_through_the_history_by_id_and_by_time(client):
    name = f"hist-{time.monotonic_ns()}"
    Engine.objects.create(name=name, worker="w@test", status="ready")
    first = [{"type": "BlockStored", "step": i, "block_ids": [i]} for i in range(5)]
    live.append_events(name, first, maxlen=1000)
    # the next events get a later millisecond than these: a time between, to page from
    stored_ms = int(live.events_page(name, None, 1000)[0][-1]["id"].split("-")[0])
    _until_past(stored_ms)
    boundary = datetime.now(timezone.utc)
    _until_past(int(boundary.timestamp() * 1000))
    live.append_events(name, [{"type": "Preempted", "step": 5 + i} for i in range(3)], 1000)

    page = client.get(f"/api/engines/{name}/events/", {"limit": 3}).json()
    assert [e["step"] for e in page["events"]] == [0, 1, 2]
    assert page["oldest"] == page["events"][0]["id"] and page["next"] == page["events"][-1]["id"]
    steps = [e["step"] for e in page["events"]]
    while page["next"]:
        page = client.get(f"/api/engines/{name}/events/",
                          {"since": page["next"], "limit": 3}).json()
        steps += [e["step"] for e in page["events"]]
    assert steps == list(range(8))  # every event once, in order
    later = client.get(f"/api/engines/{name}/events/",
                       {"since": boundary.isoformat()}).json()
    assert [e["type"] for e in later["events"]] == ["Preempted"] * 3 and later["next"] is None

    for bad in ({"limit": 0}, {"limit": "x"}, {"since": "yesterday"}):
        answer = client.get(f"/api/engines/{name}/events/", bad)
        assert answer.status_code == 400, bad
    assert client.get("/api/engines/no-such-engine/events/").status_code == 404
    assert APIClient().get(f"/api/engines/{name}/events/").status_code == 401
