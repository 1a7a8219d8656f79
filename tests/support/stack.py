"""A throwaway kvops deployment on this machine: uvicorn + engine workers (Celery) on a
fresh SQLite file, driven over HTTP like any client. Tests, benchmarks and the load
script use it; it talks to loopback only."""
from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import requests

from kvops.infra.private_file import ensure_secret_key
from kvops.infra.run import web_server_argv
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
_stack_count = itertools.count(1)


def _own_database(redis_url: str) -> str:
    """The same Redis server, another database number: stacks running side by side (a
    test session's) must not see each other's queues, groups and keys. Redis has 16
    databases unless started with --databases (the test session's has 64)."""
    parsed = urlparse(redis_url)
    return urlunparse(parsed._replace(path=f"/{next(_stack_count) % 64}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAULTS = Path(__file__).resolve().parent / "faults"  # sitecustomize.py: fault injection


class Stack:
    def __init__(self, workdir: Path, env: dict | None = None, faults: bool = False) -> None:
        """faults: its processes load tests/support/faults (arm_fault makes an engine's
        next step raise)."""
        self.workdir = workdir
        ensure_secret_key(workdir)  # as `make run` does (DJANGO_SECRET_KEY, if set, wins)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ,
                        DATABASE_URL=f"sqlite:///{workdir / 'db.sqlite3'}",
                        KVOPS_DATA_DIR=str(workdir), PYTHONUNBUFFERED="1",
                        KVOPS_HEARTBEAT_S="0.5", KVOPS_CONTROL_TIMEOUT_S="5",
                        DJANGO_SUPERUSER_USERNAME="admin", DJANGO_SUPERUSER_EMAIL="a@x.org",
                        DJANGO_SUPERUSER_PASSWORD="admin-pass-123")
        self.database = None  # its own database on the PostgreSQL pass's server
        if os.environ.get("KVOPS_TEST_DATABASE") == "postgres" and "DATABASE_URL" not in (
                env or {}):
            from tests.session_postgres import create_database
            self.database = f"kvops_stack_{os.getpid()}_{next(_stack_count)}"
            self.env["DATABASE_URL"] = create_database(self._postgres_server(), self.database)
        self.env.update(env or {})
        if faults:  # (this checkout first: the hooks import engine before sys.path[0] is
            # set, and an installed kvops may be another checkout's)
            self.env["PYTHONPATH"] = os.pathsep.join(
                [str(FAULTS), str(REPO), *filter(None, [self.env.get("PYTHONPATH")])])
            self.env["KVOPS_TEST_FAULT_DIR"] = str(workdir)
        if "REDIS_URL" not in (env or {}):
            self.env["REDIS_URL"] = _own_database(os.environ.get("REDIS_URL",
                                                                 "redis://127.0.0.1:6379/0"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.tokens: dict[str, str] = {}

    # --- processes -----------------------------------------------------------------
    def manage(self, *args: str, env: dict | None = None) -> str:
        out = subprocess.run([sys.executable, "manage.py", *args], cwd=REPO,
                             env={**self.env, **(env or {})}, capture_output=True, text=True,
                             timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{out.stderr}")
        return out.stdout.strip()

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> None:
        log = open(self.workdir / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(argv, cwd=REPO, env={**self.env, **(env or {})},
                                            stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def start_web(self) -> None:
        self.manage("migrate", "-v0")
        self.manage("createsuperuser", "--noinput")
        self.manage("shell", "-c", "from django.contrib.auth.models import User; "
                    "User.objects.create_user('alice', password='alice-pass-123')")
        for user in ("admin", "alice"):
            self.tokens[user] = self.manage("drf_create_token", user).split()[2]
        self.restart_web()

    def restart_web(self) -> None:
        """The web server (again, after a kill: on its port, the database as it is)."""
        self._spawn("web", web_server_argv("127.0.0.1", self.port))
        self.wait(lambda: requests.get(f"{self.url}/healthz", timeout=2).status_code == 200,
                  "web server", 30)

    def start_engine(self, name: str, threads: int = 24, **config: str | int) -> None:
        """A simulated engine counts bytes as tokens (its outputs are what the tests
        compute: tests/engine/sim.py) unless `simulate_tokenizer` says otherwise."""
        if config.get("simulate"):
            config.setdefault("simulate_tokenizer", "bytes")
        env = {f"KVOPS_ENGINE_{k.upper()}": str(v) for k, v in config.items()}
        before = self._engine_row(name).get("started_at") if self.tokens else None
        self._spawn(f"engine-{name}", [sys.executable, "manage.py", "engine_worker", "--name",
                                       name, "--threads", str(threads)], env)
        # (started again: the row the killed worker left looks alive for a while)
        self.wait(lambda: self.engine_alive(name) and
                  self._engine_row(name).get("started_at") != before, f"engine {name}", 120)

    def _engine_row(self, name: str) -> dict:
        r = requests.get(f"{self.url}/api/engines/", timeout=5,
                         headers={"Authorization": f"Token {self.tokens['admin']}"})
        return next((e for e in r.json() if e["name"] == name), {})

    def arm_fault(self, engine: str) -> None:
        """The engine's next simulated step raises (a stack started with faults=True)."""
        if "KVOPS_TEST_FAULT_DIR" not in self.env:
            raise RuntimeError("this stack was started without faults=True")
        (Path(self.env["KVOPS_TEST_FAULT_DIR"]) / f"fault-{engine}").touch()

    def start_ops_worker(self, **env: str) -> None:
        """The ops worker (what-if replays). Tasks sent before it is up wait in its queue."""
        self._spawn("ops", [sys.executable, "manage.py", "ops_worker"], env)

    def engine_alive(self, name: str) -> bool:
        r = requests.get(f"{self.url}/healthz", timeout=2,  # as admin: with the engines
                         headers={"Authorization": f"Token {self.tokens['admin']}"})
        return any(e["name"] == name and e["alive"] for e in r.json()["engines"])

    def kill(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(name)
        os.killpg(proc.pid, sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name)
        if self.database is not None:
            from tests.session_postgres import drop_database
            drop_database(self._postgres_server(), self.database)
            self.database = None

    @staticmethod
    def _postgres_server() -> str:
        from tests.session_postgres import server_url
        return server_url()

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def wait(self, predicate, what: str, timeout_s: float) -> None:
        """wait_until with this stack's ways: a probe that raises is not up yet, and a
        process of the stack that has exited ends the wait."""
        wait_until(predicate, what, timeout_s, poll_s=0.2, errors=(Exception,),
                   check=self._all_running)

    def _all_running(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited early:\n{self.log(name)[-3000:]}")

    # --- HTTP ----------------------------------------------------------------------
    def api(self, method: str, path: str, user: str | None = "admin", **kw) -> requests.Response:
        headers = kw.pop("headers", {})
        if user is not None:
            headers["Authorization"] = f"Token {self.tokens[user]}"
        return requests.request(method, f"{self.url}{path}", headers=headers, timeout=60, **kw)

    def wait_job(self, job_id: int, timeout_s: float = 60, user: str = "admin") -> dict:
        result = {}

        def done() -> bool:
            result.update(self.api("GET", f"/api/jobs/{job_id}/", user=user).json())
            return result["status"] in ("finished", "failed", "cancelled")

        self.wait(done, f"job {job_id}", timeout_s)
        return result

    def wait_running(self, job_id: int, timeout_s: float = 30, user: str = "admin") -> str:
        """Wait until the job runs on an engine; returns its engine request id."""
        job = {}

        def running() -> bool:
            job.update(self.api("GET", f"/api/jobs/{job_id}/", user=user).json())
            return job["status"] == "running" and bool(job["request_id"])

        self.wait(running, f"job {job_id} running", timeout_s)
        return job["request_id"]
