"""Every /v1 answer that is not a success, in OpenAI's error shape: the body, the
refusals of parsing and admission (their statuses from kvops/jobs/refusals.py, the table
the REST API answers from too), a failure's 500, an unknown path's 404."""
from __future__ import annotations

import functools
import logging

from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from kvops.jobs.refusals import refusal_of

log = logging.getLogger(__name__)


def error(status: int, message: str, param: str | None = None,
          type_: str = "invalid_request_error", code: str | None = None) -> JsonResponse:
    return JsonResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}}, status=status)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# OpenAI's error type for each status a refusal has (kvops/jobs/refusals.py)
_TYPE_OF = {403: "permission_error", 429: "rate_limit_exceeded", 503: "service_unavailable"}


def refusal(e: Exception) -> JsonResponse | None:
    """The answer to a call that parsing or admission refused; None for a failure."""
    if isinstance(e, BadRequest):
        return error(400, str(e), e.param)
    refused = refusal_of(e)
    if refused is None:
        return None
    return error(refused.status, str(e), refused.param,
                 type_=_TYPE_OF.get(refused.status, "invalid_request_error"), code=refused.code)


def json_errors(view):
    """Every answer of a /v1 view in OpenAI's error shape, a failure's 500 included
    (Django's would be an HTML page, of which clients print only the status)."""
    @functools.wraps(view)
    async def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        try:
            return await view(request, *args, **kwargs)
        except DisallowedHost:
            return error(400, "this host is not allowed (KVOPS_ALLOWED_HOSTS)")
        except Exception as e:  # noqa: BLE001  (the client gets JSON whatever failed)
            log.exception("%s %s failed", request.method, request.path)
            return error(500, f"internal error: {type(e).__name__}", type_="server_error")
    return csrf_exempt(wrapped)


@json_errors
async def not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """Any other /v1 path: a 404 in OpenAI's shape."""
    return error(404, f"no such endpoint: {request.method} {request.path}",
                 code="unknown_url")

