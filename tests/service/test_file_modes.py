"""Files that hold tokens, prompts or keys are the owner's alone: the SQLite database and
its -wal and -shm are created 0600 (SQLite would make them 0644), folders made for them
0700, and a start-up check says which are looser and how to fix them."""
import logging
import os
import sqlite3
import stat

import pytest

from kvops.apps import warn_loose_files
from kvops.infra.private_file import create_private_file, loose_modes, private_paths


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_running_stacks_database_is_private(stack):
    """The stack's web and worker opened it through kvops.sqlite (WAL mode)."""
    db = stack.workdir / "db.sqlite3"
    for path in (db, db.with_name("db.sqlite3-writer.lock"), stack.workdir / "secret_key"):
        assert mode(path) == 0o600, path
    for path in (db.with_name("db.sqlite3-wal"), db.with_name("db.sqlite3-shm")):
        assert not path.exists() or mode(path) == 0o600, path  # (while a connection is open)


@pytest.mark.django_db
def test_a_new_database_and_its_folder_are_created_private(tmp_path):
    from django.db import connections
    from django.db.utils import ConnectionHandler
    folder = tmp_path / "deep" / "data"
    name = folder / "kvops.sqlite3"
    handler = ConnectionHandler({"default": {**connections.settings["default"],
                                             "ENGINE": "kvops.sqlite", "NAME": str(name),
                                             "OPTIONS": {"transaction_mode": "IMMEDIATE"}}})
    connection = handler["default"]
    try:
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=wal")
            cursor.execute("CREATE TABLE t (x)")
            cursor.execute("INSERT INTO t VALUES (1)")
        assert mode(name) == 0o600
        assert mode(f"{name}-wal") == 0o600 and mode(f"{name}-shm") == 0o600
        assert mode(folder) == 0o700 and mode(folder.parent) == 0o700
    finally:
        connection.close()


def test_the_start_up_check_names_what_others_could_read(tmp_path, settings, caplog):
    settings.DATA_DIR = tmp_path
    tmp_path.chmod(0o700)
    (tmp_path / "secret_key").write_text("k")
    (tmp_path / "secret_key").chmod(0o600)
    assert warn_loose_files() == []
    (tmp_path / "secret_key").chmod(0o644)
    tmp_path.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="kvops.apps"):
        lines = warn_loose_files()
    assert len(lines) == 2 and f"chmod 700 {tmp_path}" in lines[0]
    assert f"chmod 600 {tmp_path / 'secret_key'}" in lines[1]
    assert "other users of this machine may read it" in caplog.text
    db = tmp_path / "x.sqlite3"
    assert create_private_file(db) and not create_private_file(db)
    sqlite3.connect(db).execute("PRAGMA journal_mode=wal").close()
    db.chmod(0o640)
    assert [line.split(" is mode")[0] for line in loose_modes(private_paths(tmp_path, str(db)))] \
        == [str(tmp_path), str(tmp_path / "secret_key"), str(db)]
