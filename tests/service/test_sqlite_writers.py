"""The SQLite backend's writer lock (kvops/sqlite): a write transaction, or a write
statement outside one, holds an exclusive flock next to the database file while it runs;
other writers wait for it there, readers do not; it gives up after the connection's
timeout with SQLite's own error; a process that dies holding it loses it."""
import fcntl
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager

import pytest
from django.db import OperationalError, connections, transaction

from kvops.sqlite.base import DatabaseWrapper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def settings_for(path, timeout_s=10.0) -> dict:
    """A connection's settings, with Django's defaults filled in."""
    return connections.configure_settings({"default": {
        "ENGINE": "kvops.sqlite", "NAME": str(path),
        "OPTIONS": {"timeout": timeout_s, "transaction_mode": "IMMEDIATE",
                    "init_command": "PRAGMA journal_mode=WAL;"}}})["default"]


@pytest.fixture
def database(tmp_path, django_db_blocker):
    """A file database with one table, and a way to open a connection to it under an
    alias of this thread's (as each thread of a server gets its own connection)."""
    path = tmp_path / "db.sqlite3"
    opened = []

    def connect(alias, timeout_s=10.0) -> str:
        wrapper = DatabaseWrapper(settings_for(path, timeout_s), alias)
        connections[alias] = wrapper  # this thread's connection under that alias
        if threading.current_thread() is threading.main_thread():
            opened.append(wrapper)  # (other threads close their own)
        return alias

    with django_db_blocker.unblock():
        alias = connect("writers_setup")
        with connections[alias].cursor() as cursor:
            cursor.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, who TEXT)")
        yield path, connect
        for wrapper in opened:
            wrapper.close()


@contextmanager
def lock_file(path):
    fd = os.open(f"{path}-writer.lock", os.O_RDWR | os.O_CREAT)
    try:
        yield fd
    finally:
        os.close(fd)


def is_held(path) -> bool:
    with lock_file(path) as fd:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False


def rows(alias) -> list[str]:
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT who FROM t ORDER BY id")
        return [who for (who,) in cursor.fetchall()]


def test_a_write_transaction_holds_the_lock_until_it_commits_or_rolls_back(database):
    path, connect = database
    alias = connect("a")
    assert not is_held(path)
    with transaction.atomic(using=alias):
        assert is_held(path)
        with connections[alias].cursor() as cursor:
            cursor.execute("INSERT INTO t (who) VALUES ('a')")
        assert is_held(path)
    assert not is_held(path)
    with pytest.raises(RuntimeError):
        with transaction.atomic(using=alias):
            with connections[alias].cursor() as cursor:
                cursor.execute("INSERT INTO t (who) VALUES ('rolled back')")
            raise RuntimeError
    assert not is_held(path)
    assert rows(alias) == ["a"]


def test_writers_wait_for_the_holder_and_readers_do_not(database):
    path, connect = database
    alias = connect("holder")
    done = {}

    def other(name, sql):
        other_alias = connect(f"other_{name}")
        with connections[other_alias].cursor() as cursor:
            cursor.execute(sql)
            done[name] = cursor.fetchall() if sql.startswith("SELECT") else True
        connections[other_alias].close()

    with transaction.atomic(using=alias):
        with connections[alias].cursor() as cursor:
            cursor.execute("INSERT INTO t (who) VALUES ('holder')")
        reader = threading.Thread(target=other, args=("reader", "SELECT who FROM t"))
        reader.start()
        reader.join(10)
        assert done["reader"] == []  # read without waiting; the insert is not committed
        writer = threading.Thread(target=other, args=(
            "writer", "INSERT INTO t (who) VALUES ('writer')"))  # autocommit: one statement
        writer.start()
        writer.join(0.3)
        assert writer.is_alive() and "writer" not in done  # queued behind the holder
    writer.join(10)
    assert done["writer"] is True
    assert rows(alias) == ["holder", "writer"]
    assert not is_held(path)


def test_a_writer_gives_up_after_the_timeout_with_sqlites_error(database):
    path, connect = database
    alias = connect("impatient", timeout_s=0.3)
    with lock_file(path) as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another writer, stuck
        with pytest.raises(OperationalError, match="database is locked"):
            with transaction.atomic(using=alias):
                with connections[alias].cursor() as cursor:
                    cursor.execute("INSERT INTO t (who) VALUES ('late')")
        with pytest.raises(OperationalError, match="database is locked"):
            with connections[alias].cursor() as cursor:
                cursor.execute("INSERT INTO t (who) VALUES ('late')")
        assert rows(alias) == []  # reads go on meanwhile
    with transaction.atomic(using=alias):
        with connections[alias].cursor() as cursor:
            cursor.execute("INSERT INTO t (who) VALUES ('after')")
    assert rows(alias) == ["after"]


HOLDER = """
import sys, time
from django.db import connections, transaction
from kvops.sqlite.base import DatabaseWrapper
from tests.service.test_sqlite_writers import settings_for
connections["w"] = DatabaseWrapper(settings_for(sys.argv[1]), "w")
with transaction.atomic(using="w"):
    with connections["w"].cursor() as cursor:
        cursor.execute("INSERT INTO t (who) VALUES ('killed')")
    print("holding", flush=True)
    time.sleep(60)
"""


def test_a_process_killed_holding_the_lock_loses_it_and_its_write(database):
    path, connect = database
    alias = connect("survivor")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "kvops.settings"}
    holder = subprocess.Popen([sys.executable, "-c", "import django; django.setup()\n" + HOLDER,
                               str(path)], stdout=subprocess.PIPE, text=True, env=env,
                              cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert is_held(path)
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    finally:
        if holder.poll() is None:
            holder.kill()
    with transaction.atomic(using=alias):
        with connections[alias].cursor() as cursor:
            cursor.execute("INSERT INTO t (who) VALUES ('survivor')")
    assert rows(alias) == ["survivor"]


def test_a_sqlite_database_url_gets_this_backend(tmp_path):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "kvops.settings",
           "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}
    engine = subprocess.run(
        [sys.executable, "-c", "from django.conf import settings; "
                               "print(settings.DATABASES['default']['ENGINE'])"],
        env=env, capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    assert engine == "kvops.sqlite"


def test_the_writers_bench_runs_both_backends():
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_sqlite", "--writers", "2",
                          "--seconds", "0.3", "--rounds", "1", "--gap-ms", "5"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=120).stdout
    rows = {line[:24].strip(): line[24:].split() for line in out.splitlines()[2:]}
    assert set(rows) == {"django (busy handler)", "kvops (writer queue)"}, out
    for writes, *latencies in rows.values():
        p50, p90, p99, most = map(float, latencies)  # each write waits for the lock a while
        assert int(writes) > 0 and 0 < p50 <= p90 <= p99 <= most, out
