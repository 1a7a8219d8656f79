"""`make run`: the whole stack on one machine, stopped by Ctrl-C.

Finds Redis at REDIS_URL or starts a private redis-server, applies migrations, makes an
admin account if there is none, then runs the web server (uvicorn), one engine worker and
the ops worker (what-if replays).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from kvops.private_file import ensure_secret_key

REPO = Path(__file__).resolve().parent.parent
# Connections the web server's socket queues before it accepts them: hundreds of
# clients connecting at once must not be reset.
LISTEN_BACKLOG = 4096
# The largest websocket message the server reads: what the app takes (1,024 characters,
# kvops/consumers.py) in UTF-8. A larger one closes the socket (1009) before the server
# buffers it; uvicorn's default, 16 MiB, let four sockets add 100 MB to the web.
WS_MAX_BYTES = 4 * 1024


def web_server_argv(host: str, port: int, proxies: str = "") -> list[str]:
    """The web server's command: uvicorn on uvloop with httptools' HTTP parser.

    Streaming hundreds of SSE responses is mostly socket writes and event-loop turns, and
    uvicorn's C-backed loop and parser cost the web process a fraction of the CPU per
    streamed token that daphne's Twisted reactor does (docs/history/streaming.md). Websockets
    (Channels) go through the `websockets` package. Named explicitly so that a missing
    package fails at start-up instead of falling back to the slow pure-Python paths.
    Open streams get a few seconds to end at shutdown, then are closed.

    The client's address is the connection's own unless `proxies`
    (KVOPS_TRUSTED_PROXIES) names the proxies (addresses or networks, comma-separated)
    whose X-Forwarded-For is believed:
    uvicorn believes 127.0.0.1 by default, and with the login lockout keyed on the
    address, a forged header from a local client reset it."""
    proxies = proxies.strip()
    return [sys.executable, "-m", "uvicorn", "kvops.asgi:application", "--host", host,
            "--port", str(port), "--backlog", str(LISTEN_BACKLOG), "--loop", "uvloop",
            "--http", "httptools", "--ws", "websockets-sansio",
            "--ws-max-size", str(WS_MAX_BYTES), "--lifespan", "off",
            "--no-access-log", "--log-level", "warning", "--timeout-graceful-shutdown", "5",
            *(["--proxy-headers", "--forwarded-allow-ips", proxies] if proxies
              else ["--no-proxy-headers"])]


def log(message: str) -> None:
    print(f"[kvops] {message}", flush=True)


def redis_reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def ensure_redis(url: str, data_dir: Path) -> subprocess.Popen | None:
    """Use the Redis at url, or start a private one there (local URLs only)."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    if redis_reachable(host, port):
        log(f"using Redis at {host}:{port}")
        return None
    if host not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"Redis at {url} does not answer; start it or set REDIS_URL")
    exe = shutil.which("redis-server") or install_redis()
    workdir = data_dir / "redis"
    workdir.mkdir(parents=True, exist_ok=True)
    log(f"starting a private redis-server on {host}:{port} (files in {workdir})")
    proc = subprocess.Popen([exe, "--bind", host, "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, start_new_session=True)
    for _ in range(100):
        if redis_reachable(host, port):
            return proc
        time.sleep(0.1)
    proc.kill()
    sys.exit("redis-server did not start")


def install_redis() -> str:
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        sys.exit("redis-server is not installed: install it (e.g. `apt-get install redis-server`) "
                 "or point REDIS_URL at a running Redis")
    log("redis-server is missing: installing the Debian package")
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=True,
                   env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("installing redis-server failed")
    return exe


def manage(*args: str) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, check=True)


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    # Ctrl-C and SIGTERM (docker stop, systemd) both stop the stack; set explicitly,
    # since a shell that starts us in the background hands SIGINT down ignored.
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    data_dir = Path(os.environ.setdefault("KVOPS_DATA_DIR", str(REPO / "data")))
    data_dir.mkdir(parents=True, exist_ok=True)
    # The database, its tokens and prompts, and the secret key live here: ours alone
    # (`make setup` made it with the shell's umask). The web warns about anything else.
    if data_dir.stat().st_uid == os.geteuid():
        data_dir.chmod(0o700)
    if not os.environ.get("DJANGO_SECRET_KEY"):
        ensure_secret_key(data_dir)  # on first run; kept across runs (sessions survive)
    # The rest from the settings (now that the secret key is there), as every process
    # of the stack reads them.
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvops.settings")
    from django.conf import settings
    redis_url, port = settings.REDIS_URL, settings.KVOPS_PORT
    children: list[subprocess.Popen] = []
    redis_proc = ensure_redis(redis_url, data_dir)
    if redis_proc is not None:
        children.append(redis_proc)
    try:
        manage("migrate", "--noinput", "-v0")
        manage("ensure_admin")
        children.append(subprocess.Popen(
            web_server_argv("127.0.0.1", port, settings.KVOPS_TRUSTED_PROXIES), cwd=REPO,
            start_new_session=True))
        name = settings.KVOPS_ENGINE_NAME
        children.append(subprocess.Popen(
            [sys.executable, "manage.py", "engine_worker", "--name", name], cwd=REPO,
            start_new_session=True))
        children.append(subprocess.Popen(  # what-if replays, away from the engine
            [sys.executable, "manage.py", "ops_worker"], cwd=REPO, start_new_session=True))
        log(f"kvops is starting at http://127.0.0.1:{port}/ (engine {name!r}); Ctrl-C stops it")
        while all(c.poll() is None for c in children):
            time.sleep(0.5)
        dead = next(c for c in children if c.poll() is not None)
        log(f"{' '.join(map(str, dead.args[:4]))} exited with {dead.returncode}; stopping")
        return 1
    except KeyboardInterrupt:
        log("stopping")
        return 0
    finally:
        for child in reversed(children):
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
        for child in reversed(children):
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
