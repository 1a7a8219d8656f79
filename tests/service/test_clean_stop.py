"""Stopping the stack: one SIGTERM or SIGINT, once or twice, to `make run`'s process
(kvops.run) or to its whole process group (what a supervisor, `docker stop` or a closed
terminal sends) stops every process it started within 10 s, the port is free again, and
a job that was running goes back to the queue instead of being lost or left `running`.
An engine worker on its own stops within 10 s of a SIGTERM while a long job runs, and
the job runs again on the next engine."""
from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.support.stack import REPO, Stack, _own_database, free_port
from tests.support.wait import wait_until

pytestmark = pytest.mark.stack

STOP_WITHIN_S = 10.0
# The engine: simulated, quick to start; a job of LONG_JOB tokens runs for about 20 s.
ENGINE_ENV = {"KVOPS_ENGINE_SIMULATE": "1", "KVOPS_ENGINE_SIMULATE_TOKENIZER": "bytes",
              "KVOPS_ENGINE_SIMULATE_STEP_MS": "5",
              "KVOPS_ENGINE_VOCAB_SIZE": "32000", "KVOPS_ENGINE_NUM_GPU_BLOCKS": "512",
              "KVOPS_ENGINE_MAX_NUM_SEQS": "8"}
LONG_JOB = {"prompt": "a long one", "max_tokens": 4000, "ignore_eos": True}


# --- processes, from /proc --------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, process group, session) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = data[data.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


def _processes() -> dict[int, tuple[str, int, int, int]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                out[int(name)] = stat
    return out


def _alive(stat: tuple[str, int, int, int] | None) -> bool:
    return stat is not None and stat[0] not in ("Z", "X")  # a zombie has let go of all


def _tree(root: int) -> set[int]:
    """root and every process below it."""
    procs = _processes()
    found, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (_, ppid, _, _) in procs.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                frontier.append(pid)
    return found


def _survivors(pids: set[int], sessions: set[int]) -> dict[int, str]:
    """Live processes among pids, or in one of the sessions: pid -> command line."""
    out = {}
    for pid, stat in _processes().items():
        if _alive(stat) and (pid in pids or stat[3] in sessions):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
            except OSError:
                pass
    return out


def _kill_all(pids: set[int], sessions: set[int]) -> None:
    """Whatever a failed test left behind."""
    for pid in _survivors(pids, sessions):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no listener
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# (what a server still starting answers: no answer, or not the JSON it will answer)
NOT_YET = (requests.RequestException, ValueError, KeyError)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def _job_row(db: Path, job_id: int) -> dict:
    with sqlite3.connect(db, timeout=10) as conn:
        conn.row_factory = sqlite3.Row
        row = conn.execute("SELECT status, error, attempts FROM kvops_job WHERE id = ?",
                           (job_id,)).fetchone()
    return dict(row)


# --- the whole stack, as `make run` starts it --------------------------------------------
def _send(proc: subprocess.Popen, how: str) -> None:
    if how == "sigterm-group":
        os.killpg(proc.pid, signal.SIGTERM)
    elif how == "sigterm-group-twice":
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.05)  # the second arrives while the first is being handled
        os.killpg(proc.pid, signal.SIGTERM)
    elif how == "sigint-twice":
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how, private_redis", [
    ("sigterm-group", False),
    ("sigint-twice", False),
    ("sigterm-group-twice", False),
    ("sigterm-group", True),
], ids=["sigterm-group", "sigint-twice", "sigterm-group-twice", "sigterm-group-own-redis"])
def test_a_stop_signal_stops_every_process_of_the_stack(tmp_path, how, private_redis):
    port = free_port()
    redis_url = (f"redis://127.0.0.1:{free_port()}/0" if private_redis
                 else _own_database(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")))
    db = tmp_path / "db.sqlite3"
    env = dict(os.environ, KVOPS_DATA_DIR=str(tmp_path), KVOPS_PORT=str(port),
               REDIS_URL=redis_url, DATABASE_URL=f"sqlite:///{db}", PYTHONUNBUFFERED="1",
               KVOPS_HEARTBEAT_S="0.5", DJANGO_SUPERUSER_USERNAME="admin",
               DJANGO_SUPERUSER_PASSWORD="clean-stop-pw-123", **ENGINE_ENV)
    env.pop("KVOPS_ENGINE_WORKER", None)
    log = tmp_path / "run.log"
    proc = subprocess.Popen([sys.executable, "-m", "kvops.infra.run"], cwd=REPO, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    tracked: set[int] = {proc.pid}
    sessions: set[int] = {proc.pid}
    try:
        def ready() -> bool:
            assert proc.poll() is None, f"kvops.run exited with {proc.returncode}"
            health = requests.get(f"{url}/healthz", timeout=2).json()
            return health["ok"] and health["engines_alive"] > 0

        wait_until(ready, "the web server and the engine", 120, poll_s=0.1, errors=NOT_YET,
                   detail=lambda: _tail(log))
        token = subprocess.run(
            [sys.executable, "manage.py", "drf_create_token", "admin"], cwd=REPO, env=env,
            capture_output=True, text=True, timeout=60, check=True).stdout.split()[2]
        auth = {"Authorization": f"Token {token}"}
        r = requests.post(f"{url}/api/jobs/", json=LONG_JOB, headers=auth, timeout=10)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        wait_until(lambda: requests.get(f"{url}/api/jobs/{job_id}/", headers=auth, timeout=5)
                   .json()["num_output_tokens"], "the job to run", 30, poll_s=0.1,
                   errors=NOT_YET, detail=lambda: _tail(log))

        # Everything it started, and their sessions (each child has one of its own).
        tracked = _tree(proc.pid)
        procs = _processes()
        sessions = {procs[pid][3] for pid in tracked if pid in procs}
        names = " ".join(_survivors(tracked, set()).values())
        for part in ("uvicorn", "-Q engine.default", "engine.serve.core_proc", "-Q ops "):
            assert part in names, (part, names)
        if private_redis:
            assert "redis-server" in names, names

        _send(proc, how)
        wait_until(lambda: _survivors(tracked, sessions), "every process to stop",
                   STOP_WITHIN_S, until=lambda left: not left, poll_s=0.1,
                   detail=lambda: _tail(log))
        assert proc.wait(1) == 0, log.read_text()[-3000:]
        assert _port_free(port), f"port {port} still taken"
        text = log.read_text(errors="replace")
        assert text.count("[kvops] stopping") == 1, text[-3000:]
        assert "Traceback" not in text, text[-5000:]
        # The job that ran was handed back: queued again (it runs on the next start),
        # neither failed nor left `running` by a worker that is gone.
        job = _job_row(db, job_id)
        assert job["status"] == "queued", job
        assert "stopped while running it" in job["error"], job
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_all(tracked, sessions)
        proc.wait(10)


# --- an engine worker on its own -------------------------------------------------------
@pytest.mark.parametrize("how", ["sigterm", "sigterm-group", "sigint-twice"])
def test_an_engine_worker_stops_quickly_and_hands_its_job_back(tmp_path, how):
    """SIGTERM to the worker alone (its core gets none), to its process group (the core
    dies of it at once), or Ctrl-C twice (Celery's cold shutdown, which cannot cancel a
    threads pool's tasks): the worker exits within 10 s although its job would run for
    20 s more, its core goes too, and the job goes back to the queue, where the next
    engine takes it and finishes it."""
    stack = Stack(tmp_path)
    try:
        stack.start_web()
        config = {"core": "process", "simulate": 1, "vocab_size": 32000,
                  "num_gpu_blocks": 512, "max_num_seqs": 8, "simulate_step_ms": 5}
        stack.start_engine("solo", **config)
        r = stack.api("POST", "/api/jobs/", user="alice", json=LONG_JOB)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        stack.wait(lambda: stack.api("GET", f"/api/jobs/{job_id}/", user="alice")
                   .json()["num_output_tokens"] > 0, "the job to run", 30)
        worker = stack.procs.pop("engine-solo")
        tree = _tree(worker.pid)
        assert len(tree) >= 2, "no core process under the worker"
        if how == "sigterm":
            os.kill(worker.pid, signal.SIGTERM)
        elif how == "sigterm-group":
            os.killpg(worker.pid, signal.SIGTERM)
        else:
            os.kill(worker.pid, signal.SIGINT)
            time.sleep(0.05)
            os.kill(worker.pid, signal.SIGINT)
        try:
            worker.wait(STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(5)
            raise AssertionError(f"the worker ran on {STOP_WITHIN_S:g} s after its signal:\n"
                                 + stack.log("engine-solo")[-4000:]) from None
        wait_until(lambda: _survivors(tree, set()), "its core to stop with it", 2,
                   until=lambda left: not left, poll_s=0.1)
        log = stack.log("engine-solo")
        assert "Traceback" not in log, log[-5000:]
        assert f"handing jobs [{job_id}] back to the queue" in log, log[-3000:]
        job = stack.api("GET", f"/api/jobs/{job_id}/", user="alice").json()
        assert job["status"] == "queued", job
        assert "stopped while running it" in job["error"], job
        # The next engine runs it from its prompt.
        stack.start_engine("solo", **config)
        done = stack.wait_job(job_id, 60, user="alice")
        assert done["status"] == "finished" and done["num_output_tokens"] == 4000, done
        assert done["attempts"] == 2, done
    finally:
        stack.stop()
