"""The HTTP body limit, answered as JSON: a request whose Content-Length is over
DATA_UPLOAD_MAX_MEMORY_SIZE (KVOPS_MAX_BODY_BYTES) gets a 413 naming the limit before
its body is read. (Django's own check answers an HTML "Bad Request (400)" that API
clients cannot read, and only once a view touches the body.)"""
from __future__ import annotations

import json

from django.conf import settings

from kvops.openai.handler import API_PREFIX


def _declared_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def too_large_body(path: str, limit: int) -> bytes:
    """The 413's JSON: OpenAI's error shape under /v1, the REST API's elsewhere."""
    message = (f"the request body is larger than {limit} bytes, the most this server "
               "takes (KVOPS_MAX_BODY_BYTES)")
    if path.startswith(API_PREFIX):
        doc = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                         "code": "request_too_large"}}
    else:
        doc = {"error": message, "limit": limit}
    return json.dumps(doc).encode()


def limit_body(app):
    """An ASGI app that answers 413 for HTTP requests over the limit and passes the
    rest to app."""
    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
            length = _declared_length(scope)
            if limit is not None and length is not None and length > limit:
                body = too_large_body(scope.get("path", ""), limit)
                await send({"type": "http.response.start", "status": 413,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)
    return guarded
