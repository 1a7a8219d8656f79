"""Every API error is JSON with a message a user can act on."""
from django.http import HttpRequest, JsonResponse
from rest_framework.views import exception_handler as drf_exception_handler


def exception_handler(exc, context):
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    data = response.data
    if isinstance(data, dict) and "detail" in data and len(data) == 1:
        response.data = {"error": str(data["detail"])}
    elif isinstance(data, (dict, list)):
        response.data = {"error": _summary(data), "fields": data}
    return response


def _summary(data) -> str:
    if isinstance(data, list):
        return "; ".join(_summary(d) for d in data)
    if isinstance(data, dict):
        return "; ".join(f"{k}: {_summary(v)}" for k, v in data.items())
    return str(data)


def not_found(request: HttpRequest, path: str = "") -> JsonResponse:
    """Any other /api/ path: a JSON 404 (Django's own is an HTML page). Without its
    trailing slash, a path the API serves is redirected to it first (APPEND_SLASH)."""
    return JsonResponse({"error": f"no such endpoint: {request.method} {request.path} "
                                  "(see /api/docs/)"}, status=404)
