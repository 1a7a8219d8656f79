"""Production defaults in this process: the first admin's password written for its
owner only (0600, O_EXCL), /metrics for its token and staff only, /healthz telling anonymous callers
the status only."""
import stat

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from rest_framework.authtoken.models import Token

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_admin_credentials_file_is_private(tmp_path, settings, monkeypatch):
    settings.DATA_DIR = tmp_path
    monkeypatch.delenv("DJANGO_SUPERUSER_PASSWORD", raising=False)
    (tmp_path / "admin-credentials.txt").write_text("stale, of an earlier database\n")
    call_command("ensure_admin")
    creds = tmp_path / "admin-credentials.txt"
    assert stat.S_IMODE(creds.stat().st_mode) == 0o600
    text = creds.read_text()
    assert "stale" not in text
    password = text.split("password: ")[1].strip()
    assert User.objects.get(username="admin").check_password(password)


def test_metrics_answer_their_token_and_staff_only(settings, client):
    """Its counters move with every user's requests (a `salt` miss with each guess of
    another tenant's prompt): anonymous callers and plain users are refused, in JSON."""
    settings.KVOPS_METRICS_TOKEN = ""
    refused = client.get("/metrics")
    assert refused.status_code == 401 and refused["WWW-Authenticate"].startswith("Bearer")
    assert "KVOPS_METRICS_TOKEN" in refused.json()["error"]
    settings.KVOPS_METRICS_TOKEN = "scrape-secret-1"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    ok = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret-1")
    assert ok.status_code == 200 and b"kvops:" in ok.content

    plain = User.objects.create_user("plain", password="mauve-tractor-41-lake")
    staff = User.objects.create_user("staffer", password="mauve-tractor-41-lake",
                                     is_staff=True)
    plain_token = Token.objects.create(user=plain).key
    staff_token = Token.objects.create(user=staff).key
    for scheme in ("Token", "Bearer", "bearer"):  # an API key in either scheme, as on /api
        assert client.get("/metrics", HTTP_AUTHORIZATION=f"{scheme} {plain_token}"
                          ).status_code == 403
        assert client.get("/metrics", HTTP_AUTHORIZATION=f"{scheme} {staff_token}"
                          ).status_code == 200
    assert client.get("/metrics", HTTP_AUTHORIZATION="Basic c3RhZmZlcjp4").status_code == 401
    client.force_login(plain)
    refused = client.get("/metrics")
    assert refused.status_code == 403 and "staff" in refused.json()["error"]
    client.force_login(staff)
    assert client.get("/metrics").status_code == 200
    client.logout()

    settings.KVOPS_METRICS_PUBLIC = True  # the explicit opt-out
    assert client.get("/metrics").status_code == 200


def test_healthz_tells_anonymous_callers_the_status_only(rf, monkeypatch):
    import json

    from django.contrib.auth.models import AnonymousUser

    from kvops.monitoring import health

    def redis_down():
        raise ConnectionError("Error 111 connecting to 10.0.0.7:6379. Connection refused.")
    monkeypatch.setattr(health.live, "redis_client", redis_down)
    request = rf.get("/healthz")
    request.user = AnonymousUser()
    answer = health.healthz(request)
    body = json.loads(answer.content)
    assert answer.status_code == 503 and body["checks"] == {"database": "ok", "redis": "error"}
    assert "10.0.0.7" not in answer.content.decode() and "engines" not in body
    token = Token.objects.create(user=User.objects.create_user("ops", password="x-pass-123"))
    for header in (f"Token {token.key}", f"Bearer {token.key}"):  # either scheme, as on /api
        request = rf.get("/healthz", HTTP_AUTHORIZATION=header)
        request.user = AnonymousUser()
        body = json.loads(health.healthz(request).content)
        assert "10.0.0.7" in body["checks"]["redis"] and body["engines"] == []
    for header in ("Bearer not-a-key", f"Basic {token.key}", "Bearer"):
        request = rf.get("/healthz", HTTP_AUTHORIZATION=header)
        request.user = AnonymousUser()
        body = json.loads(health.healthz(request).content)
        assert body["checks"]["redis"] == "error" and "engines" not in body


def test_weak_passwords_are_refused():
    from django.contrib.auth.password_validation import validate_password
    from django.core.exceptions import ValidationError
    user = User(username="carol")
    for weak in ("password123", "83749261", "carol1234", "short"):
        with pytest.raises(ValidationError):
            validate_password(weak, user)
    validate_password("mauve-tractor-41-lake", user)  # no error


def test_repeated_failed_logins_lock_the_account_out(client, settings):
    settings.AXES_FAILURE_LIMIT = 3
    User.objects.create_user("dave", password="mauve-tractor-41-lake")

    def login(password: str):
        client.get("/accounts/login/")
        return client.post("/accounts/login/", {"username": "dave", "password": password})

    for _ in range(2):
        assert login("guess").status_code == 200  # the form again, with its error
    assert login("guess").status_code == 429  # the third failure locks the pair out
    assert login("mauve-tractor-41-lake").status_code == 429  # even the right password
    assert "_auth_user_id" not in client.session


@pytest.mark.asyncio
async def test_a_burst_of_v1_calls_looks_a_token_up_once(monkeypatch, rf):
    """/v1 bearer tokens: one database lookup for a burst with a new key (not one per
    call), the answer kept TOKEN_CACHE_S; an unknown key is no user."""
    import asyncio

    from kvops.openai import auth

    user = await User.objects.acreate(username="bursty")
    token = await Token.objects.acreate(user=user)
    lookups = []
    real = auth._token_user

    def counted(key):
        lookups.append(key)
        return real(key)
    monkeypatch.setattr(auth, "_tokens", auth.TokenUsers(counted))
    request = rf.post("/v1/completions", HTTP_AUTHORIZATION=f"Bearer {token.key}")
    users = await asyncio.gather(*(auth.authenticate(request) for _ in range(20)))
    assert all(u is not None and u.pk == user.pk for u in users)
    assert lookups == [token.key]
    bad = rf.post("/v1/completions", HTTP_AUTHORIZATION="Bearer not-a-token")
    assert await auth.authenticate(bad) is None
