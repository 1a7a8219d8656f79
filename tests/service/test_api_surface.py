"""One API surface: /api, /v1 and /tokenize take a DRF token as `Token <key>` or `Bearer
<key>`, each refusing a missing or bad key in its own shape (DRF's 401 with its challenge
on /api, OpenAI's error object on /v1); every /api error answers in one shape
(kvops/api/errors.py); /api/schema/ describes every /v1 and root route the service
serves. In this process, against the database."""
import re

import pytest
from django.contrib.auth.models import User
from django.urls import URLPattern
from django.utils import timezone
from rest_framework.authtoken.models import Token

from kvops import selectors, urls
from kvops.engines import control
from kvops.models import Engine, OperatorAction

pytestmark = pytest.mark.django_db(transaction=True)
SCHEMES = ["Token", "Bearer", "bearer"]  # a scheme's case does not matter
BAD_HEADERS = [None, "Token wrong-key", "Bearer wrong-key", "Bearer", "Basic dXNlcjpwYXNz"]
ERROR_KEYS = {"type", "code", "message", "field", "fields"}


@pytest.fixture()
def operator():
    user = User.objects.create_user("surface-op", password="mauve-tractor-41-lake",
                                    is_staff=True)
    Token.objects.create(user=user)
    return user


@pytest.fixture()
def engine():
    """A live engine row serving `sim-model` with the simulator (no worker runs here)."""
    row = Engine.objects.create(
        name="surface-sim", worker="engine-surface-sim@here", status=Engine.Status.READY,
        last_heartbeat=timezone.now(),
        config={"model": "sim-model", "simulate": True, "block_size": 16, "vocab_size": 1000,
                "max_model_len": 4096})
    selectors.forget_recent_engines()
    yield row
    selectors.forget_recent_engines()


def auth(header: str | None) -> dict:
    return {} if header is None else {"HTTP_AUTHORIZATION": header}


def key(user) -> str:
    return Token.objects.get(user=user).key


def api_error(answer, status: int) -> dict:
    """The error of an /api answer, checked to be in the one shape."""
    assert answer.status_code == status, answer.content
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["message"], body
    return body["error"]


# --- both schemes on each surface -----------------------------------------------------

@pytest.mark.parametrize("scheme", SCHEMES)
def test_api_takes_either_scheme(client, operator, scheme):
    answer = client.get("/api/jobs/", **auth(f"{scheme} {key(operator)}"))
    assert answer.status_code == 200, answer.content
    assert answer.json()["results"] == []


@pytest.mark.parametrize("header", BAD_HEADERS)
def test_api_refuses_a_missing_or_bad_key_with_its_challenge(client, operator, header):
    answer = client.get("/api/jobs/", **auth(header))
    error = api_error(answer, 401)
    assert answer["WWW-Authenticate"] == "Token"
    assert error["type"] == "authentication_error"
    assert error["code"] in ("not_authenticated", "authentication_failed")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_v1_takes_either_scheme(client, operator, engine, scheme):
    answer = client.get("/v1/models", **auth(f"{scheme} {key(operator)}"))
    assert answer.status_code == 200, answer.content
    assert [m["id"] for m in answer.json()["data"]] == ["sim-model"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_tokenize_takes_either_scheme(client, operator, engine, scheme):
    answer = client.post("/detokenize", {"model": "sim-model", "tokens": [1, 2]},
                         content_type="application/json", **auth(f"{scheme} {key(operator)}"))
    # 200, or 503 where the simulator's tokenizer is not readable here: not a 401 either way
    assert answer.status_code in (200, 503), answer.content
    answer = client.post("/detokenize", {"model": "no-such-model", "tokens": [1]},
                         content_type="application/json", **auth(f"{scheme} {key(operator)}"))
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model"


@pytest.mark.parametrize("path", ["/v1/models", "/tokenize"])
@pytest.mark.parametrize("header", BAD_HEADERS)
def test_v1_and_tokenize_refuse_a_missing_or_bad_key_in_openai_shape(client, operator,
                                                                      path, header):
    method = client.get if path.startswith("/v1") else client.post
    answer = method(path, **auth(header))
    assert answer.status_code == 401, answer.content
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert "Bearer" in error["message"] and "Token" in error["message"]


# --- one error shape on /api ----------------------------------------------------------

def test_a_validation_error_names_its_field(client, operator, engine):
    client.force_login(operator)
    answer = client.post(f"/api/engines/{engine.name}/limits/", {"max_num_seqs": "many"},
                         content_type="application/json")
    error = api_error(answer, 400)
    assert error["type"] == "invalid_request" and error["field"] == "max_num_seqs"
    assert list(error["fields"]) == ["max_num_seqs"] and error["fields"]["max_num_seqs"]
    assert error["message"].startswith("max_num_seqs: ")
    job = api_error(client.post("/api/jobs/", {}, content_type="application/json"), 400)
    assert job["field"] == "prompt" and "prompt" in job["message"]
    assert job["code"] == "invalid_request"  # a refusal of intake without a code of its own


def test_an_action_the_engine_refuses(client, operator, engine, monkeypatch):
    refusal = {"ok": False, "error": "InvalidStateError", "message": "engine is draining"}
    monkeypatch.setattr(control, "send_engine_command", lambda worker, action, args: refusal)
    client.force_login(operator)
    answer = client.post(f"/api/engines/{engine.name}/pause/", {},
                         content_type="application/json")
    error = api_error(answer, 409)
    assert error == {"type": "conflict", "code": "InvalidStateError",
                     "message": "engine is draining", "field": None, "fields": {}}
    # the operator log keeps the engine's own answer
    row = OperatorAction.objects.get(engine=engine.name, action="pause")
    assert (row.status_code, row.result) == (409, refusal)


def test_an_action_the_engine_does_not_answer(client, operator, engine, monkeypatch):
    monkeypatch.setattr(control, "send_engine_command", lambda worker, action, args: None)
    client.force_login(operator)
    answer = client.post(f"/api/engines/{engine.name}/resume/", {},
                         content_type="application/json")
    error = api_error(answer, 504)
    assert error["type"] == "timeout" and "did not answer" in error["message"]


def test_not_found(client, operator):
    client.force_login(operator)
    for answer in (client.get("/api/engines/nowhere/"),
                   client.post("/api/engines/nowhere/pause/", {},
                               content_type="application/json")):
        error = api_error(answer, 404)
        assert error["type"] == error["code"] == "not_found"
        assert "'nowhere'" in error["message"] and "/api/engines/" in error["message"]
    error = api_error(client.get("/api/jobs/999999/"), 404)
    assert error["type"] == "not_found" and "'999999'" in error["message"]
    error = api_error(client.get("/api/no-such-thing/"), 404)
    assert error["code"] == "unknown_url" and "/api/docs/" in error["message"]


def test_drf_answers_of_its_own_are_in_the_shape(client, operator):
    client.force_login(operator)
    error = api_error(client.delete("/api/jobs/"), 405)
    assert error["type"] == error["code"] == "method_not_allowed"
    assert "DELETE" in error["message"]
    plain = User.objects.create_user("surface-plain", password="mauve-tractor-41-lake")
    client.force_login(plain)
    error = api_error(client.post("/api/engines/nowhere/pause/", {},
                                  content_type="application/json"), 403)
    assert error["type"] == "permission_error" and "operator" in error["message"]


def test_a_failure_is_a_500_in_the_shape(client, operator, monkeypatch, caplog):
    def broken():
        raise RuntimeError("the database went away")
    monkeypatch.setattr(selectors, "engines", broken)
    client.force_login(operator)
    error = api_error(client.get("/api/engines/"), 500)
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    assert "the database went away" in caplog.text  # logged, with its traceback


# --- the schema -----------------------------------------------------------------------

def served_openai_routes() -> list[str]:
    """Every route kvops/urls.py serves under /v1 and at the root for OpenAI and vLLM
    clients (not the catch-all), as OpenAPI writes paths."""
    routes = []
    for pattern in urls.urlpatterns:
        if not isinstance(pattern, URLPattern) or not hasattr(pattern.pattern, "_route"):
            continue
        route = pattern.pattern._route
        module = getattr(pattern.callback, "__module__", "")
        if route.startswith("v1/") or module == "kvops.openai.tokenize":
            routes.append("/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route))
    return routes


def test_the_schema_covers_every_openai_route(client, operator):
    routes = served_openai_routes()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
            "/detokenize"} <= set(routes)
    client.force_login(operator)
    answer = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert answer.status_code == 200, answer.content[:300]
    schema = answer.json()
    for route in routes:
        operations = schema["paths"].get(route)
        assert operations, f"{route} is served but not in /api/schema/"
        for method in operations:
            # the method the schema names is the one the route takes (a 405 if not)
            path = re.sub(r"\{\w+\}", "x", route)
            answer = client.generic(method.upper(), path, "{}", "application/json",
                                    **auth(f"Bearer {key(operator)}"))
            assert answer.status_code != 405, f"{method.upper()} {route}: {answer.content}"
    assert schema["components"]["securitySchemes"]["tokenAuth"]["scheme"] == "bearer"
    assert "](/)" in schema["info"]["description"]  # Swagger's link back to the console
