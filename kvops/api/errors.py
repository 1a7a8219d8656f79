"""Every /api error answers in one JSON shape (docs/api.md, "Errors"):

    {"error": {"type": "invalid_request", "code": "required", "message": "prompt: ...",
               "field": "prompt", "fields": {"prompt": ["This field is required."]}}}

type: the kind of error, one per status (ERROR_TYPES); code: its cause, finer (DRF's
code, a refusal's from kvops/jobs/refusals.py, or the engine's error class for an
operator action it refused); message: one sentence to show; field: the first field at
fault, null if none; fields: each field's messages, {} if none. /v1 answers in OpenAI's
shape instead (kvops/openai/errors.py)."""
from __future__ import annotations

import logging

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404, HttpRequest, JsonResponse
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request", 401: "authentication_error", 403: "permission_error",
               404: "not_found", 405: "method_not_allowed", 406: "not_acceptable",
               409: "conflict", 413: "too_large", 415: "unsupported_media_type",
               429: "rate_limited", 500: "server_error", 503: "service_unavailable",
               504: "timeout"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request")


def error_body(status: int, message: str, code: str | None = None,
               fields: dict | None = None) -> dict:
    fields = fields or {}
    return {"error": {"type": error_type(status), "code": code or error_type(status),
                      "message": message, "field": next(iter(fields), None),
                      "fields": fields}}


def error_response(status: int, message: str, code: str | None = None,
                   fields: dict | None = None) -> Response:
    return Response(error_body(status, message, code, fields), status=status)


def exception_handler(exc: Exception, context: dict) -> Response:
    """DRF's answer to exc (its status and headers: WWW-Authenticate, Retry-After) with
    the body in the shape above; any other exception is logged and answered 500 in it
    too (Django's would be an HTML page)."""
    if isinstance(exc, Http404):
        exc = exceptions.NotFound(str(exc) or None)
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied(str(exc) or None)
    response = drf_exception_handler(exc, context)
    if response is None:
        request = context.get("request")
        log.exception("%s %s failed", getattr(request, "method", "?"),
                      getattr(request, "path", "?"), exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}")
    data, code = response.data, _first(exc.get_codes())
    if isinstance(data, dict) and set(data) == {"detail"}:
        response.data = error_body(response.status_code, str(data["detail"]), code)
    else:
        fields = data if isinstance(data, dict) else {"non_field_errors": data}
        response.data = error_body(response.status_code, _summary(data), code, fields)
    return response


def _first(codes) -> str | None:
    """The first code of DRF's codes (a string, or a list or dict of them)."""
    if isinstance(codes, dict):
        codes = list(codes.values())
    if isinstance(codes, list):
        return _first(codes[0]) if codes else None
    return codes


def _summary(data) -> str:
    if isinstance(data, list):
        return "; ".join(_summary(d) for d in data)
    if isinstance(data, dict):
        return "; ".join(f"{k}: {_summary(v)}" for k, v in data.items())
    return str(data)


def not_found(request: HttpRequest, path: str = "") -> JsonResponse:
    """Any other /api/ path: a JSON 404 (Django's own is an HTML page). Without its
    trailing slash, a path the API serves is redirected to it first (APPEND_SLASH)."""
    return JsonResponse(error_body(404, f"no such endpoint: {request.method} {request.path} "
                                        "(see /api/docs/)", "unknown_url"), status=404)
