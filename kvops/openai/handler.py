"""The HTTP handler for the OpenAI-compatible API (/v1): Django without the page
middleware.

The page middleware (sessions, CSRF, messages, clickjacking, static files) is written
for synchronous code: under ASGI each one moves the request to a worker thread and
back, a dozen trips per request. /v1 uses none of it (bearer tokens, JSON, no cookies),
and at hundreds of requests a second those trips are most of its cost, so /v1 requests
go straight to their views. The views still check the Host header against
ALLOWED_HOSTS (kvops/openai/base.py's v1_view calls request.get_host()).
"""
from __future__ import annotations

from contextlib import aclosing

from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response
from django.http import StreamingHttpResponse

API_PREFIX = "/v1/"


class BareASGIHandler(ASGIHandler):
    """Django's ASGI handler with no middleware at all, and no thread of its own per
    request: Django's handler opens a ThreadSensitiveContext for each request, so the
    first synchronous call of each one (the request_started signal, at the least)
    starts a new thread and the end of the request joins it. /v1 views do their
    synchronous work with thread_sensitive=False or in short calls, so its requests
    share asgiref's one thread-sensitive thread instead."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        await self.handle(scope, receive, send)

    async def send_response(self, response, send):
        if not isinstance(response, EventStream):
            return await super().send_response(response, send)
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": [(k.encode("ascii"), v.encode("latin1"))
                                for k, v in response.items()]})
        async with aclosing(response.events) as events:
            async for event in events:
                await send({"type": "http.response.body", "body": event,
                            "more_body": True})
        await send({"type": "http.response.body"})

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        get_response = self._get_response_async if is_async else self._get_response
        self._middleware_chain = convert_exception_to_response(get_response)


class EventStream(StreamingHttpResponse):
    """A server-sent event stream: an async iterator of events (bytes). Under BareASGIHandler
    each event goes to the server as it comes, in one message, skipping Django's
    per-part conversions (a quarter of the web process's CPU per streamed token at
    hundreds of streams); under any other handler it is a plain streaming response."""

    def __init__(self, events) -> None:
        super().__init__(events, content_type="text/event-stream")
        self.events = events
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"  # a proxy in front must not buffer the stream


def split_api(api_app, other_app):
    """An ASGI app that sends /v1/ requests to api_app and the rest to other_app."""
    async def app(scope, receive, send):
        target = api_app if scope.get("path", "").startswith(API_PREFIX) else other_app
        await target(scope, receive, send)
    return app
