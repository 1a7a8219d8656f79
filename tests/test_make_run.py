"""`make run` on a machine where nothing answers at REDIS_URL: it starts a private Redis,
migrates, creates the admin, serves the pages and the API with the default model, runs a
job, and Ctrl-C stops every process it started."""
import os
import signal
import subprocess
from pathlib import Path

import pytest
import requests

from tests.support.stack import REPO, free_port
from tests.support.wait import wait_until

DEFAULT_MODEL = REPO / "data" / "models" / "SmolLM2-135M-Instruct" / "config.json"


def still_running(proc: subprocess.Popen, log: Path) -> None:
    """(A wait's check: `make run` exiting ends it, with the log's tail.)"""
    if proc.poll() is not None:
        raise AssertionError(f"make run exited early:\n{log.read_text()[-3000:]}")


def port_open(port: int) -> bool:
    import socket
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="the default model is converted by make setup")
def test_make_run_serves_and_stops(tmp_path):
    web_port, redis_port = free_port(), free_port()
    env = dict(os.environ, KVOPS_PORT=str(web_port),
               REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
               DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
               DJANGO_SUPERUSER_PASSWORD="make-run-test-pw",
               KVOPS_ENGINE_MAX_NUM_SEQS="8", KVOPS_ENGINE_KV_CACHE_MEMORY_BYTES=str(64 << 20))
    env.pop("DJANGO_SECRET_KEY", None)  # as a new user: make run writes data/secret_key
    env.pop("KVOPS_DEBUG", None)
    log = tmp_path / "make-run.log"
    # SIGINT ignored on the way in, as a shell that starts a job in the background hands
    # it down: Ctrl-C (SIGINT to the group) must still stop the stack.
    proc = subprocess.Popen(["make", "run"], cwd=REPO, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    url = f"http://127.0.0.1:{web_port}"
    try:
        def engine_up() -> bool:
            health = requests.get(f"{url}/healthz", timeout=2).json()
            return health["ok"] and health["engines_alive"] > 0  # anonymous: counts only

        wait_until(engine_up, "the web server and the engine", 300, poll_s=0.5,
                   errors=(requests.RequestException,), check=lambda: still_running(proc, log),
                   detail=lambda: log.read_text()[-3000:])
        wait_until(lambda: f"kvops is ready at {url}/" in log.read_text(), "the ready line",
                   30, poll_s=0.2, check=lambda: still_running(proc, log),
                   detail=lambda: log.read_text()[-3000:])
        text = log.read_text()
        assert "starting a private redis-server" in text
        # the URL once the stack starts, and again once it serves
        assert text.index(f"kvops is starting at {url}/") < text.index(f"kvops is ready at {url}/")
        # nothing a user cannot act on: the static folder's warning, Celery's banner and
        # its warning against root (said once, in a line of ours), the prefix index's
        # complaints and the health probe's 503s while the engine loads
        for noise in ("No directory at", "SecurityWarning", "concurrency:",
                      "prefix index rewrite failed", "Service Unavailable"):
            assert noise not in text, (noise, text[-3000:])
        key = REPO / "data" / "secret_key"  # written on the first run, for the owner only
        assert key.is_file() and (key.stat().st_mode & 0o777) == 0o600
        session = requests.Session()
        login = session.get(f"{url}/accounts/login/", timeout=10)
        assert login.status_code == 200
        r = session.post(f"{url}/accounts/login/", timeout=10, data={
            "username": "admin", "password": "make-run-test-pw",
            "csrfmiddlewaretoken": session.cookies["csrftoken"]}, headers={"Referer": url})
        assert r.url.rstrip("/") == url and r.status_code == 200
        r = session.post(f"{url}/api/jobs/", timeout=10, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0},
            headers={"X-CSRFToken": session.cookies["csrftoken"], "Referer": url})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        job = {}

        def finished() -> bool:
            job.update(session.get(f"{url}/api/jobs/{job_id}/", timeout=10).json())
            return job["status"] in ("finished", "failed", "cancelled")

        wait_until(finished, "the job to end", 120, poll_s=0.5,
                   errors=(requests.RequestException,), check=lambda: still_running(proc, log),
                   detail=lambda: log.read_text()[-3000:])
        assert job["status"] == "finished" and job["engine"] == "default"
        assert "Paris" in job["output_text"], job["output_text"]
        # the database with its tokens and prompts, and the data folder: the owner's alone
        for name in ("db.sqlite3", "db.sqlite3-wal", "db.sqlite3-shm"):
            assert ((tmp_path / name).stat().st_mode & 0o777) == 0o600, name
        assert ((REPO / "data").stat().st_mode & 0o777) == 0o700
        assert "file permissions:" not in log.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends to the terminal's group
        proc.wait(60)
    assert "[kvops] stopping" in log.read_text()
    assert not port_open(web_port) and not port_open(redis_port)
