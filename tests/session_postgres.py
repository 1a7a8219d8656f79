"""The PostgreSQL pass of the suite, loaded as a pytest plugin (`-p tests.session_postgres`
in pyproject) and idle unless KVOPS_TEST_DATABASE=postgres (`make test` runs the tests
marked `postgres` a second time so). Production runs PostgreSQL (docker-compose.yml);
the code has paths of its own there (row locks behind the caps and claims, jsonb, the
NUL character), so the tests of jobs, caps, claims, the outbox, moves, the what-if and
the audit log run on it as well as on SQLite.

The server: KVOPS_TEST_POSTGRES_URL (default postgres://postgres@127.0.0.1:5432/postgres,
the local one) if it answers, else a private cluster made with initdb in a temporary
folder (no fsync: it is thrown away), as `make run` starts a private Redis. In-process
tests get a database of pytest-django's making on it; each Stack a fresh one
(tests.support.stack). Imported before pytest-django loads Django's settings, so
DATABASE_URL is right for in-process Django too."""
from __future__ import annotations

import atexit
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from urllib.parse import urlparse, urlunparse

from tests.support.wait import wait_until

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/postgres"


def answers(url: str) -> bool:
    import psycopg
    try:
        with psycopg.connect(_dsn(url), connect_timeout=3):
            return True
    except psycopg.Error:
        return False


def _dsn(url: str) -> str:
    return url.replace("postgres://", "postgresql://", 1)


def with_database(url: str, name: str) -> str:
    return urlunparse(urlparse(url)._replace(path=f"/{name}"))


def create_database(server_url: str, name: str) -> str:
    """A new, empty database on the server; its URL."""
    import psycopg
    with psycopg.connect(_dsn(server_url), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    return with_database(server_url, name)


def drop_database(server_url: str, name: str) -> None:
    import psycopg
    try:
        with psycopg.connect(_dsn(server_url), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except psycopg.Error:
        pass  # the server went first (a private one, at exit)


def _binary(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        raise RuntimeError(f"PostgreSQL's {name} is not installed (make setup installs it)")
    return found


def start_private(workdir: str, port: int | None = None) -> tuple[str, subprocess.Popen]:
    """A throwaway PostgreSQL cluster under workdir, on a free port of 127.0.0.1 (trust
    auth, no fsync). PostgreSQL refuses to run as root: as root it runs as `postgres`.
    With the port of a cluster stopped there (stop_private), that cluster starts again."""
    from tests.session_redis import free_port
    data, port = os.path.join(workdir, "pgdata"), port or free_port()
    as_user = _as_postgres()
    if not os.path.exists(os.path.join(data, "PG_VERSION")):
        if as_user:
            user = pwd.getpwnam("postgres")
            os.makedirs(data, exist_ok=True)
            for path in (workdir, data):
                os.chown(path, user.pw_uid, user.pw_gid)
        subprocess.run([*as_user, _binary("initdb"), "-D", data, "-U", "postgres",
                        "--auth=trust", "--no-sync", "-E", "UTF8"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    proc = subprocess.Popen(
        [*as_user, _binary("postgres"), "-D", data, "-p", str(port), "-k", workdir,
         "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
         "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
         "-c", "max_connections=300"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"postgres://postgres@127.0.0.1:{port}/postgres"
    wait_until(lambda: answers(url), f"a private PostgreSQL on port {port}", 60, poll_s=0.2)
    return url, proc


def stop_private(workdir: str, proc: subprocess.Popen) -> None:
    """Stop a cluster start_private started (a fast shutdown: its sessions are ended)."""
    if proc.poll() is not None:
        return
    subprocess.run([*_as_postgres(), _binary("pg_ctl"), "-D", os.path.join(workdir, "pgdata"),
                    "stop", "-m", "fast", "-w"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    proc.wait(30)


def _as_postgres() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def server_url() -> str:
    """The PostgreSQL server of this pass (found, or started once)."""
    url = os.environ.get("KVOPS_TEST_POSTGRES_SERVER")
    if url:
        return url
    url = os.environ.get("KVOPS_TEST_POSTGRES_URL", DEFAULT_URL)
    if not answers(url):
        workdir = tempfile.mkdtemp(prefix="kvops-pg-")
        url, proc = start_private(workdir)
        atexit.register(shutil.rmtree, workdir, True)
        atexit.register(proc.terminate)
    os.environ["KVOPS_TEST_POSTGRES_SERVER"] = url  # (the stacks' processes inherit it)
    return url


if os.environ.get("KVOPS_TEST_DATABASE") == "postgres":
    # pytest-django makes and drops "test_kvops_<pid>" on this server (dropped here too,
    # whatever is still connected, if it could not)
    os.environ["DATABASE_URL"] = with_database(server_url(), f"kvops_{os.getpid()}")
    atexit.register(drop_database, server_url(), f"test_kvops_{os.getpid()}")
