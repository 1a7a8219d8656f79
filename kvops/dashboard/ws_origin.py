"""Which pages may open a websocket: the Origin check.

A browser sends its session cookie with a websocket to this server from any page, so
the Origin header is what tells our pages from another site's (a websocket has no CSRF
token). Channels' AllowedHostsOriginValidator compares the host alone: a page served at
http://127.0.0.1:9999 (any local program) was let in with the user's cookie. Here the
origin must be this server's own, as CSRF's check has it: the same scheme, host and port
as the connection's Host (under KVOPS_HTTPS, https), that host one of ALLOWED_HOSTS; or
an origin CSRF_TRUSTED_ORIGINS names (as Django reads it: scheme, host and port, a host
`*.example.com` standing for its subdomains). A connection without an Origin (not a
browser) is refused too: the API's clients use tokens over HTTP. Behind a proxy that
terminates TLS, set KVOPS_HTTPS=1 (the page's origin is https) and keep the Host header.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host

DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(scheme: str, host: str, port: int | None) -> tuple[str, str, int] | None:
    if scheme not in DEFAULT_PORTS or not host:
        return None
    return scheme, host.lower(), port or DEFAULT_PORTS[scheme]


def parse_origin(value: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin such as https://example.com:8443; None if it is
    not one (e.g. "null", a file:// page)."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    return _origin(parts.scheme.lower(), parts.hostname or "", port)


def _trusted(origin: tuple[str, str, int], entry: str) -> bool:
    """Does a CSRF_TRUSTED_ORIGINS entry name this origin?"""
    wildcard = "://*." in entry
    trusted = parse_origin(entry.replace("://*.", "://", 1) if wildcard else entry)
    if trusted is None or (origin[0], origin[2]) != (trusted[0], trusted[2]):
        return False
    return origin[1] == trusted[1] or (wildcard and origin[1].endswith("." + trusted[1]))


def allowed(origin_header: str | None, host_header: str | None, secure: bool) -> bool:
    """May a page of this origin open a websocket reaching us by this Host?"""
    if not origin_header:
        return False
    origin = parse_origin(origin_header)
    if origin is None:
        return False
    if any(_trusted(origin, entry) for entry in settings.CSRF_TRUSTED_ORIGINS):
        return True
    if not host_header:
        return False
    domain, port = split_domain_port(host_header)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return False
    scheme = "https" if secure else "http"
    own = _origin(scheme, domain.strip("[]"), int(port) if port else None)
    return origin == own


class SameOriginValidator:
    """ASGI middleware for websockets: the app if allowed(), else a refused handshake."""

    def __init__(self, application) -> None:
        self.application = application

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers", ()))
        decode = lambda value: value.decode("latin1") if value is not None else None  # noqa: E731
        secure = scope.get("scheme") == "wss" or settings.HTTPS
        if allowed(decode(headers.get(b"origin")), decode(headers.get(b"host")), secure):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)
