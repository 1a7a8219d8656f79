"""Files only their owner may read (the secret key, the first admin's password, the
SQLite database with its tokens and prompts), created with mode 0600 and O_EXCL in one
call, in folders made 0700: never readable by others, not even for the moment between a
create and a chmod, and never written over. loose_modes() finds such files and folders
made looser (by an earlier version, or by hand), for the start-up warning."""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

SECRET_KEY_FILE = "secret_key"


def make_private_dir(path: Path) -> None:
    """The folder, made 0700 with its missing parents if it does not exist (one that
    exists is left as it is: loose_modes says if it is looser)."""
    path = Path(path)
    if path.is_dir():
        return
    make_private_dir(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def create_private_file(path: Path) -> bool:
    """An empty file, mode 0600, if there is none; False if one exists already."""
    make_private_dir(Path(path).parent)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    return True


def create_private(path: Path, text: str) -> bool:
    """Write text to a new file, mode 0600. False if the file exists already (it is left
    as it is: two processes starting at once keep the first one's)."""
    make_private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def ensure_secret_key(data_dir: Path) -> Path:
    """The data dir's secret key file, generated on first use (`make run`, a test stack)."""
    path = Path(data_dir) / SECRET_KEY_FILE
    create_private(path, secrets.token_urlsafe(50) + "\n")
    return path


def loose_modes(paths: list[Path]) -> list[str]:
    """For each existing path that others may read or write (a file beyond 0600, a
    folder beyond 0700), a line saying so and how to fix it."""
    lines = []
    for path in paths:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            continue
        if mode & 0o077:
            want = "700" if Path(path).is_dir() else "600"
            lines.append(f"{path} is mode {mode:o}: other users of this machine may read "
                         f"it; run `chmod {want} {path}`")
    return lines


def private_paths(data_dir: Path, database: str | None) -> list[Path]:
    """What must stay private: the data folder, its secrets, and the SQLite database
    (wherever it is: its folder is the operator's choice) with its -wal and -shm."""
    data_dir = Path(data_dir)
    paths = [data_dir, data_dir / SECRET_KEY_FILE, data_dir / "admin-credentials.txt"]
    if database:
        paths += [Path(database), Path(f"{database}-wal"), Path(f"{database}-shm")]
    return list(dict.fromkeys(paths))
