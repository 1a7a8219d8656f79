"""GET /healthz: 200 when the database and Redis answer, else 503. Anyone may ask (load
balancers, compose): they get the status only. A signed-in user or a token holder
(`Token <key>` or `Bearer <key>`) also gets each check's error and the engines.

GET /health and /ping, /version: as vLLM serves them, for clients and load tools that
probe a server before they use it."""
from __future__ import annotations

from django.db import DatabaseError, connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods
from rest_framework.authentication import TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed

from kvops import live, selectors
from kvops.infra import api_key


def healthz(request: HttpRequest) -> JsonResponse:
    checks: dict[str, str] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except Exception as e:
        checks["database"] = f"error: {e}"
    try:
        live.redis_client().ping()
        checks["redis"] = "ok"
    except Exception as e:
        checks["redis"] = f"error: {e}"
    engines = []
    if checks["database"] == "ok":
        for engine in selectors.engines():
            age = selectors.heartbeat_age_s(engine)
            engines.append({"name": engine.name, "status": engine.status,
                            "alive": selectors.engine_alive(engine),
                            "heartbeat_age_s": None if age is None else round(age, 1)})
    ok = all(v == "ok" for v in checks.values())
    status = 200 if ok else 503
    alive = sum(e["alive"] for e in engines)
    if signed_in_user(request) is None:
        return JsonResponse({"ok": ok, "checks": {k: "ok" if v == "ok" else "error"
                                                  for k, v in checks.items()},
                             "engines_alive": alive}, status=status)
    return JsonResponse({"ok": ok, "checks": checks, "engines": engines,
                         "engines_alive": alive}, status=status)


def signed_in_user(request: HttpRequest):
    """The user of the request's session or API token (`Authorization: Token <key>` or
    `Bearer <key>`, kvops/infra/api_key.py), None for an anonymous caller or a key that
    is not one: the probes outside the REST API (/healthz, /metrics) read who asks this
    one way."""
    if getattr(request, "user", None) is not None and request.user.is_authenticated:
        return request.user
    key = api_key.key_of(request.META.get("HTTP_AUTHORIZATION", ""))
    if not key:
        return None
    try:
        user, _ = TokenAuthentication().authenticate_credentials(key)
    except (AuthenticationFailed, DatabaseError):
        return None
    return user


@require_http_methods(["GET", "HEAD"])
def health(request: HttpRequest) -> HttpResponse:
    """200 when an engine serves (alive, taking jobs), else 503; no body."""
    return _serving()


@csrf_exempt
@require_http_methods(["GET", "HEAD", "POST"])
def ping(request: HttpRequest) -> HttpResponse:
    """/health's answer (vLLM serves /ping for SageMaker, by GET or POST)."""
    return _serving()


def _serving() -> HttpResponse:
    try:
        serving = bool(selectors.served_models())
    except DatabaseError:
        serving = False
    return HttpResponse(status=200 if serving else 503)


@require_http_methods(["GET", "HEAD"])
def version(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"version": _version()})


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version as package_version
    try:
        return package_version("kvops")
    except PackageNotFoundError:
        return "unknown"
