"""The routes clients and load tools probe before they use a server, as vLLM serves them
(/health, /ping, /version), and /v1's errors in OpenAI's shape whatever the path."""
from importlib.metadata import version

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token

from kvops import selectors
from kvops.models import Engine

pytestmark = pytest.mark.django_db


@pytest.fixture()
def no_engines():
    Engine.objects.all().delete()
    selectors.forget_recent_engines()
    yield
    selectors.forget_recent_engines()


def live_engine(name: str = "routes-sim", status=Engine.Status.READY) -> Engine:
    engine = Engine.objects.create(name=name, worker=f"engine-{name}@here", status=status,
                                   last_heartbeat=timezone.now(),
                                   config={"model": "sim-model", "simulate": True})
    selectors.forget_recent_engines()
    return engine


def test_health_and_ping_say_whether_an_engine_serves(no_engines):
    client = Client()
    assert client.get("/health").status_code == 503
    assert client.post("/ping").status_code == 503
    live_engine(status=Engine.Status.STOPPED)
    assert client.get("/health").status_code == 503  # a stopped engine serves nothing
    live_engine("routes-live")
    answer = client.get("/health")
    assert answer.status_code == 200 and answer.content == b""
    assert client.get("/ping").status_code == client.post("/ping").status_code == 200
    assert client.delete("/health").status_code == 405


def test_version():
    assert Client().get("/version").json() == {"version": version("kvops")}


@pytest.mark.django_db(transaction=True)  # tokens are looked up on another thread
def test_every_v1_error_is_openai_shaped(no_engines):
    user = User.objects.create_user("routes-rita")
    auth = {"HTTP_AUTHORIZATION": f"Bearer {Token.objects.create(user=user).key}"}
    live_engine()
    client = Client()
    for method, path, status in [("get", "/v1/embeddings", 404),
                                 ("post", "/v1/nothing/at/all", 404),
                                 ("get", "/v1/completions", 405), ("post", "/v1/models", 405),
                                 ("get", "/v1/models/gpt-9", 404), ("get", "/v1/models", 401)]:
        headers = {} if path == "/v1/models" and method == "get" else auth
        answer = getattr(client, method)(path, **headers)
        assert answer.status_code == status, (method, path, answer.content[:200])
        assert answer["Content-Type"] == "application/json", (method, path)
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert client.get("/v1/models/gpt-9", **auth).json()["error"]["code"] == "model_not_found"
    found = client.get("/v1/models/sim-model", **auth).json()
    assert found["id"] == "sim-model" and found["object"] == "model"
    assert found["kvops_engines"] == ["routes-sim"]


@pytest.mark.django_db(transaction=True)
def test_a_failure_inside_v1_is_a_json_500(no_engines, monkeypatch):
    from kvops.openai import served_models
    user = User.objects.create_user("routes-fay")
    auth = {"HTTP_AUTHORIZATION": f"Bearer {Token.objects.create(user=user).key}"}

    def broken():
        raise RuntimeError("the registry is on fire")
    monkeypatch.setattr(served_models.selectors, "served_models", broken)
    answer = Client(raise_request_exception=False).get("/v1/models", **auth)
    assert answer.status_code == 500 and answer["Content-Type"] == "application/json"
    assert answer.json()["error"]["type"] == "server_error"
    assert "RuntimeError" in answer.json()["error"]["message"]
