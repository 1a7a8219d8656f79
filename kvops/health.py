"""GET /healthz: 200 when the database and Redis answer; lists engines."""
from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, JsonResponse

from kvops import live, selectors


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
    return JsonResponse({"ok": ok, "checks": checks, "engines": engines},
                        status=200 if ok else 503)
