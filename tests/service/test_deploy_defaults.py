"""Deployment defaults of the web server, tried against the running stack: the login
lockout holds whatever X-Forwarded-For says (no proxy is trusted unless
KVOPS_TRUSTED_PROXIES names it), a websocket's Origin must be this server's own scheme,
host and port, and the server itself closes a websocket sending more than the app reads."""
import asyncio

import pytest
import requests
import websockets


PASSWORD = "mauve-tractor-41-lake"


def _login(stack, username: str, password: str, forwarded: str | None = None):
    session = requests.Session()
    session.get(f"{stack.url}/accounts/login/", timeout=10)
    headers = {"Referer": stack.url}
    if forwarded:
        headers["X-Forwarded-For"] = forwarded
    answer = session.post(f"{stack.url}/accounts/login/", timeout=10, headers=headers,
                          allow_redirects=False,
                          data={"username": username, "password": password,
                                "csrfmiddlewaretoken": session.cookies["csrftoken"]})
    return session, answer


def test_the_login_lockout_holds_with_forged_forwarded_addresses(stack):
    stack.manage("shell", "-c", "from django.contrib.auth.models import User; "
                 f"User.objects.create_user('lockme', password='{PASSWORD}')")
    for i in range(12):
        _, answer = _login(stack, "lockme", "wrong guess", forwarded=f"10.9.8.{i}")
        assert answer.status_code in (200, 429)  # the form again, then locked out
    _, answer = _login(stack, "lockme", PASSWORD, forwarded="10.9.9.99")
    assert answer.status_code == 429, answer.status_code  # still locked: one address


def test_no_proxy_is_trusted_unless_named(settings):
    from kvops.infra.run import WS_MAX_BYTES, web_server_argv
    assert settings.KVOPS_TRUSTED_PROXIES == ""  # the default
    argv = web_server_argv("127.0.0.1", 8000, settings.KVOPS_TRUSTED_PROXIES)
    assert "--no-proxy-headers" in argv and "--forwarded-allow-ips" not in argv
    assert argv[argv.index("--ws-max-size") + 1] == str(WS_MAX_BYTES)
    argv = web_server_argv("127.0.0.1", 8000, "10.0.0.5,10.1.0.0/16")
    assert argv[argv.index("--forwarded-allow-ips") + 1] == "10.0.0.5,10.1.0.0/16"


def _websocket(stack, session, origin: str | None, path: str = "/ws/engines/sim/"):
    cookie = "; ".join(f"{k}={v}" for k, v in session.cookies.items())
    return websockets.connect(f"ws://127.0.0.1:{stack.port}{path}", origin=origin,
                              additional_headers={"Cookie": cookie}, open_timeout=10,
                              max_size=2**22)


async def _status(connect) -> int:
    try:
        async with connect:
            return 101
    except websockets.InvalidStatus as e:
        return e.response.status_code


def test_a_websocket_from_another_origin_is_refused(stack):
    session, answer = _login(stack, "alice", "alice-pass-123")
    assert answer.status_code == 302
    own = f"http://127.0.0.1:{stack.port}"
    for origin in ("http://127.0.0.1:9999", "http://localhost:1234", f"https://127.0.0.1:{stack.port}",
                   "http://evil.example", "null", None):
        assert asyncio.run(_status(_websocket(stack, session, origin))) == 403, origin
    assert asyncio.run(_status(_websocket(stack, session, own))) == 101


def test_a_websocket_message_over_the_limit_closes_the_socket(stack):
    session, _ = _login(stack, "alice", "alice-pass-123")

    async def send_big() -> tuple[int | None, str]:
        async with _websocket(stack, session, f"http://127.0.0.1:{stack.port}") as ws:
            hello = await asyncio.wait_for(ws.recv(), 10)
            await ws.send("x" * (2 * 2**20))
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
            return ws.close_code, hello

    code, hello = asyncio.run(send_big())
    assert '"hello"' in hello and code == 1009  # "message too big", from the server
    assert requests.get(f"{stack.url}/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize("origin, host, secure, ok", [
    ("http://127.0.0.1:8000", "127.0.0.1:8000", False, True),
    ("http://127.0.0.1:9999", "127.0.0.1:8000", False, False),
    ("https://127.0.0.1:8000", "127.0.0.1:8000", False, False),
    ("https://kvops.example.org", "kvops.example.org", True, True),  # KVOPS_HTTPS behind TLS
    ("http://kvops.example.org", "kvops.example.org", True, False),
    ("http://[::1]:8000", "[::1]:8000", False, True),
    ("http://evil.example:8000", "evil.example:8000", False, False),  # not in ALLOWED_HOSTS
    ("https://app.trusted.example", "127.0.0.1:8000", False, True),  # *.trusted.example
    ("http://app.trusted.example", "127.0.0.1:8000", False, False),
    ("null", "127.0.0.1:8000", False, False),
    (None, "127.0.0.1:8000", False, False),
])
def test_the_origin_rule(settings, origin, host, secure, ok):
    from kvops.dashboard.ws_origin import allowed
    settings.ALLOWED_HOSTS = ["127.0.0.1", "[::1]", "kvops.example.org"]
    settings.CSRF_TRUSTED_ORIGINS = ["https://*.trusted.example"]
    assert allowed(origin, host, secure) is ok
