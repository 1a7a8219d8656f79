"""`make run`: the whole stack on one machine, stopped by Ctrl-C.

Finds Redis at REDIS_URL or starts a private redis-server, applies migrations, makes an
admin account if there is none, then runs the web server (uvicorn), one engine worker and
the ops worker (what-if replays).

Stopping: SIGINT, SIGTERM, SIGHUP or SIGQUIT, to this process or to its whole process
group (a terminal's Ctrl-C or close, `docker stop`, systemd), once or many times, stops
every process it started within STOP_S + REDIS_STOP_S seconds. The first signal starts
the stop; the others change nothing (the handlers only note them, so nothing interrupts
the stop). Each child runs in a process group of its own, out of reach of a signal to
ours: each group gets SIGTERM, and whatever is left of it after STOP_S gets SIGKILL; a
private Redis goes last, once the workers have handed their jobs back through it.
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

from kvops.infra.private_file import ensure_secret_key

REPO = Path(__file__).resolve().parents[2]
# Connections the web server's socket queues before it accepts them: hundreds of
# clients connecting at once must not be reset.
LISTEN_BACKLOG = 4096
# The largest websocket message the server reads: what the app takes (1,024 characters,
# kvops/dashboard/consumers.py) in UTF-8. A larger one closes the socket (1009) before the server
# buffers it; uvicorn's default, 16 MiB, let four sockets add 100 MB to the web.
WS_MAX_BYTES = 4 * 1024
# After the stop signal: how long the children have to exit on their SIGTERM (the web
# server closes its streams after 5 s, an engine worker hands its jobs back and exits in
# a second or two, kvops/worker/worker.py) before what is left of them is killed; then the
# private Redis, if any.
STOP_S = 7.0
READY_POLL_S = 1.0  # how often the start-up asks whether the stack serves yet
REDIS_STOP_S = 1.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


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


class Stopped(Exception):
    """A stop signal came while the stack was starting."""


_stop_signal: int | None = None  # the first stop signal


def _note_stop(signum: int, frame: object) -> None:
    """Only notes the signal: the main loop stops the stack. Raising here instead (it
    once raised KeyboardInterrupt) let a second signal, from a Ctrl-C both to the group
    and to us, break off the stop half-way and leave the children running."""
    global _stop_signal
    if _stop_signal is None:
        _stop_signal = signum


def stopping() -> bool:
    return _stop_signal is not None


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
        if redis_reachable(host, port) or stopping():  # (stopped: main() stops it)
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
    """A management command, run to its end; Stopped if a stop signal comes first."""
    proc = subprocess.Popen([sys.executable, "manage.py", *args], cwd=REPO)
    while proc.poll() is None and not stopping():
        time.sleep(0.1)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if stopping():
        raise Stopped
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args)


def spawn(argv: list[str]) -> subprocess.Popen:
    """A child of the stack, in a process group (and session) of its own."""
    return subprocess.Popen(argv, cwd=REPO, start_new_session=True)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group lives (a zombie, dead but not yet reaped by
    whoever adopted it, does not count: it holds nothing)."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc: ask the kernel, zombies included
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_children(children: list[subprocess.Popen], redis_proc: subprocess.Popen | None,
                  stop_s: float = STOP_S, redis_stop_s: float = REDIS_STOP_S) -> None:
    """SIGTERM each child's process group (the child and what it started: an engine
    worker's core, the ops worker's pool), wait until every group is empty or stop_s has
    passed, SIGKILL what is left (and wait for it a moment); then the same for the private
    Redis (redis_stop_s)."""
    for procs, limit in ((children, stop_s), ([redis_proc] if redis_proc else [], redis_stop_s)):
        deadline = time.monotonic() + limit
        for proc in procs:
            _signal_group(proc.pid, signal.SIGTERM)
        killed = False
        while True:
            for proc in procs:
                proc.poll()  # reap
            left = [proc for proc in procs if _group_alive(proc.pid)]
            if not left:
                break
            if time.monotonic() >= deadline:
                if killed:  # (stuck in the kernel: nothing more to do)
                    break
                for proc in left:
                    log(f"{_name(proc)} did not stop within {limit:g} s: killing it")
                    _signal_group(proc.pid, signal.SIGKILL)
                killed, deadline = True, time.monotonic() + 0.5
            time.sleep(0.05)


def _name(proc: subprocess.Popen) -> str:
    return " ".join(map(str, proc.args[:4]))


def serving(port: int) -> bool:
    """Whether the stack serves: its web server's /healthz says the database and Redis
    answer and an engine is alive (asked there, not at /health, whose 503s until then
    the web server would log)."""
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            health = json.load(r)
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return bool(health.get("ok")) and health.get("engines_alive", 0) > 0


def quiet_children() -> None:
    """What the stack's processes print that a user cannot act on, left out: Celery's
    banner (the engine worker's thread count in it is one waiting thread per job the
    batch may hold, not a claim on the CPU) and its warning against running as root,
    said once here instead."""
    os.environ["KVOPS_CELERY_QUIET"] = "1"
    if os.geteuid() == 0:
        log("running as root: the workers would run as any user; Celery advises against "
            "root (run `make run` as a normal user to follow it)")
        filters = os.environ.get("PYTHONWARNINGS")
        os.environ["PYTHONWARNINGS"] = ",".join(
            filter(None, [filters, "ignore::UserWarning:celery.platforms"]))


def quiet_args() -> list[str]:
    """The Celery workers' flag that leaves their banner out, under `make run`."""
    return ["--quiet"] if os.environ.get("KVOPS_CELERY_QUIET") else []


def main() -> int:
    # Ctrl-C, SIGTERM (docker stop, systemd), SIGHUP (the terminal closed) and SIGQUIT
    # stop the stack; set explicitly, since a shell that starts us in the background hands
    # SIGINT down ignored.
    for sig in STOP_SIGNALS:
        signal.signal(sig, _note_stop)
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
    # (The signal handler raises nothing: every child started is in these.)
    children: list[subprocess.Popen] = []
    redis_proc: subprocess.Popen | None = None
    try:
        redis_proc = ensure_redis(redis_url, data_dir)
        manage("migrate", "--noinput", "-v0")
        manage("ensure_admin")
        # (the web server serves the pages' files from the checkout while debugging; the
        # folder it would collect them into must exist, or it warns on every start)
        Path(settings.STATIC_ROOT).mkdir(parents=True, exist_ok=True)
        quiet_children()
        name = settings.KVOPS_ENGINE_NAME
        for argv in (web_server_argv("127.0.0.1", port, settings.KVOPS_TRUSTED_PROXIES),
                     [sys.executable, "manage.py", "engine_worker", "--name", name],
                     [sys.executable, "manage.py", "ops_worker"]):  # what-if replays
            if stopping():
                raise Stopped
            children.append(spawn(argv))
        url = f"http://127.0.0.1:{port}/"
        log(f"kvops is starting at {url}: the web server, the ops worker, and engine "
            f"{name!r} loading its model (the URL is printed again once it serves)")
        ready_at = None
        while not stopping():
            dead = next((c for c in [*children, *filter(None, [redis_proc])]
                         if c.poll() is not None), None)
            if dead is not None:
                log(f"{_name(dead)} exited with {dead.returncode}; stopping")
                return 1
            now = time.monotonic()
            if ready_at is not True and (ready_at is None or now >= ready_at):
                if serving(port):
                    log(f"kvops is ready at {url} (engine {name!r}); Ctrl-C stops it")
                    ready_at = True
                else:
                    ready_at = now + READY_POLL_S
            time.sleep(0.2)
        raise Stopped
    except Stopped:
        log("stopping")
        return 0
    finally:
        stop_children(children, redis_proc)


if __name__ == "__main__":
    sys.exit(main())
