"""Test session setup, loaded as a pytest plugin (`-p tests.session_redis` in pyproject):
a private Redis server for the whole run, so tests never touch a developer's Redis.
A plugin named with -p is imported before pytest-django loads Django's settings (a
conftest.py is imported after), so REDIS_URL is right for in-process Django too."""
import atexit
import os
import shutil
import socket
import subprocess
import tempfile

from tests.support.wait import WaitTimeout, wait_until


def free_port() -> int:
    # Not tests.support.stack.free_port: importing kvops here would load settings too early.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int, workdir: str) -> subprocess.Popen:
    """A throwaway redis-server on 127.0.0.1:port (no persistence)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (make setup installs it)")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--databases", "64",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _accepts(port), f"redis-server to listen on port {port}", 10,
                   poll_s=0.05)
    except WaitTimeout:
        proc.kill()
        raise
    return proc


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


_workdir = tempfile.mkdtemp(prefix="kvops-test-")
_redis_port = free_port()
_redis = start_redis(_redis_port, _workdir)
atexit.register(_redis.kill)
atexit.register(shutil.rmtree, _workdir, True)
os.environ["REDIS_URL"] = f"redis://127.0.0.1:{_redis_port}/0"
os.environ["KVOPS_TEST_WORKDIR"] = _workdir
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Settings refuse to start without a secret key (KVOPS_DEBUG off): one per test session,
# inherited by the stacks the tests start.
os.environ.setdefault("DJANGO_SECRET_KEY", "kvops-test-session-" + os.urandom(24).hex())
