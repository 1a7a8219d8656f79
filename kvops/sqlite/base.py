"""Django's SQLite backend, with writers that take turns within a millisecond of each
other instead of sleeping in SQLite's busy handler.

SQLite lets one writer at a time in; a writer that finds the lock taken sleeps and tries
again, with sleeps that grow to 100 ms (its busy handler: 1, 2, 5, 10, 15, 20, 25, 25,
25, 50, 50, 100 ms ...). The web server, the engine workers and their threads all write
one file: in a burst of streams the web's insert of a batch of jobs, the workers' claims
and the output processor's progress writes take turns many times a second, and a writer
that loses twice sleeps tens of milliseconds while the database sits idle (a 256-stream
burst measured its last 75 jobs stored 185 ms after they were routed, most of it asleep).

Here a write transaction, and a write statement outside one, first takes an exclusive
flock on a file next to the database (`<name>-writer.lock`), polled every 0.1-2 ms:
whoever holds it is the only writer, so the BEGIN IMMEDIATE behind it finds SQLite's lock
free, and the next writer starts within about a millisecond of the last one's commit.
A process that dies holding the flock loses it with its file descriptors. Past the
connection's timeout (settings: 30 s) the writer gives up with SQLite's own error,
"database is locked". Writers that do not come through Django (the sqlite3 shell) meet
SQLite's busy handler as before. An in-memory database has a single process and no file:
it is left alone.

The database file holds every API token, session and prompt: it is created here, mode
0600 in a folder made 0700, before SQLite opens it (SQLite would make it 0644), and
SQLite gives its -wal and -shm files the database's mode.
"""
from __future__ import annotations

import fcntl
import os
import time

from pathlib import Path

from django.db.backends.sqlite3 import base
from django.db.backends.sqlite3.base import Database

from kvops.infra.private_file import create_private_file

POLL_S = (0.0001, 0.0002, 0.0005, 0.001, 0.002)  # the waits between tries, then the last


class WriterLock:
    """An exclusive flock on one file, held by one connection at a time."""

    __slots__ = ("path", "timeout_s", "fd", "held")

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.fd: int | None = None
        self.held = False

    def acquire(self) -> None:
        if self.held:
            return
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline, tries = None, 0
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.held = True
                return
            except BlockingIOError:
                pass
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout_s
            elif now >= deadline:
                raise Database.OperationalError(
                    f"database is locked (another writer held {self.path} for "
                    f"{self.timeout_s:g} s)")
            time.sleep(POLL_S[min(tries, len(POLL_S) - 1)])
            tries += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self.release()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# Statements that change nothing, or that only open, end or mark a transaction.
_NOT_WRITES = ("SELECT", "PRAGMA", "BEGIN", "COMMIT", "END", "ROLLBACK", "SAVEPOINT",
               "RELEASE", "EXPLAIN", "VALUES")


def _writes(query: str) -> bool:
    return not query.lstrip().upper().startswith(_NOT_WRITES)


class CursorWrapper(base.SQLiteCursorWrapper):
    """A statement that writes outside a transaction holds the writer lock while it runs
    (SQLite commits it on its own at its end)."""

    writer_lock: WriterLock | None = None

    def execute(self, query, params=None):
        return self._run(super().execute, query, params)

    def executemany(self, query, param_list):
        return self._run(super().executemany, query, param_list)

    def _run(self, call, query, arguments):
        if self.writer_lock is None or self.connection.in_transaction or not _writes(query):
            return call(query, arguments)
        self.writer_lock.acquire()
        try:
            return call(query, arguments)
        finally:
            self.writer_lock.release()


class DatabaseWrapper(base.DatabaseWrapper):
    writer_lock: WriterLock | None = None

    def get_new_connection(self, conn_params):
        if not self.is_in_memory_db():  # (its -wal and -shm take the same mode)
            create_private_file(Path(self.settings_dict["NAME"]))
        conn = super().get_new_connection(conn_params)
        if self.writer_lock is not None:
            self.writer_lock.close()
            self.writer_lock = None
        if not self.is_in_memory_db():
            self.writer_lock = WriterLock(f"{self.settings_dict['NAME']}-writer.lock",
                                          float(conn_params.get("timeout", 5)))
        return conn

    def create_cursor(self, name=None):
        cursor = self.connection.cursor(factory=CursorWrapper)
        cursor.writer_lock = self.writer_lock
        return cursor

    def _start_transaction_under_autocommit(self):
        if self.writer_lock is None:
            return super()._start_transaction_under_autocommit()
        with self.wrap_database_errors:  # as Django's own errors (OperationalError)
            self.writer_lock.acquire()
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self.writer_lock.release()
            raise

    def _commit(self):
        try:
            return super()._commit()
        finally:
            self._release_unless_open()

    def _rollback(self):
        try:
            return super()._rollback()
        finally:
            self._release_unless_open()

    def _close(self):
        try:
            return super()._close()
        finally:
            if self.writer_lock is not None:
                self.writer_lock.close()

    def _release_unless_open(self):
        # A COMMIT that failed leaves the transaction open: the rollback that follows
        # releases the lock.
        if self.writer_lock is not None and not (self.connection is not None
                                                 and self.connection.in_transaction):
            self.writer_lock.release()
