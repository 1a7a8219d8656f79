"""The disk tier's folder and files, safe against the machine's other users and against
whatever is planted in the folder (engine/kv/tiers/disk.py keeps blocks there).

* The folder is private: the disk cache folder and every folder inside it are the
  engine's user's, with no write for group or others; each parent above it is the
  user's or root's and not writable by others, unless it is root's with the sticky bit
  (as /tmp): there another user may create names of their own but not rename or delete
  ours. Anything else is refused at start (`check_private`), naming the folder and the
  `chmod`/`chown` that fixes it. A folder the engine creates is 0700.
* Files are created 0600 under a fresh name (`tempfile.mkstemp`: O_CREAT | O_EXCL, no
  symlink followed) and renamed over the block's name, which replaces a symlink found
  there rather than writing through it.
* A file is read with O_NOFOLLOW | O_NONBLOCK and must be, by fstat, a regular file of
  the size expected: a symlink, a FIFO (which would block a plain open) or a device is
  refused without waiting (`read_regular`).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from pathlib import Path

from engine.config import ConfigError

KEY_FILE = "disk.key"  # the disk key of an engine without a configured secret
KEY_BYTES = 32


class NotARegularFile(OSError):
    """A name in the folder is not a regular file of the size expected (a symlink, a
    FIFO, a device, or a file of another size)."""


def check_private(folder: Path) -> None:
    """Raise ConfigError unless `folder` (which exists) and its parents are as the module
    says: the folder the engine's user's alone to write, each parent not writable by
    anyone else."""
    folder = folder.resolve()
    _check_own(folder)
    for parent in folder.parents:
        _check_parent(parent)


def make_private(folder: Path) -> Path:
    """`folder` created if missing (each missing level 0700), then checked private; the
    resolved path."""
    folder = Path(os.path.abspath(folder))
    missing = []
    at = folder
    while not os.path.lexists(at):
        missing.append(at)
        at = at.parent
    for level in reversed(missing):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:  # (another engine made it meanwhile: checked below)
            pass
    check_private(folder)
    return folder.resolve()


def make_private_subfolder(folder: Path) -> None:
    """A folder inside a private one: created 0700 if missing, else it must be the
    user's own folder (not a symlink) with no group or other write."""
    try:
        os.mkdir(folder, 0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"disk tier: {folder} is not a folder (a symlink or a file where "
                          f"the disk tier keeps its blocks): remove it")
    _check_own(folder, st)


def _check_own(folder: Path, st: os.stat_result | None = None) -> None:
    st = st or os.stat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"disk tier: {folder} is not a folder")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise ConfigError(
            f"disk tier: the folder {folder} belongs to uid {st.st_uid}, not to the engine's "
            f"user (uid {uid}): another user could read or plant blocks there. Use a folder "
            f"of the engine's user, or `chown {uid} {folder}` if it is yours to give")
    if st.st_mode & 0o022:
        raise ConfigError(
            f"disk tier: the folder {folder} is writable by its group or others "
            f"(mode {stat.S_IMODE(st.st_mode):o}), who could plant blocks there: "
            f"`chmod 700 {folder}`")


def _check_parent(parent: Path) -> None:
    st = os.stat(parent)
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        raise ConfigError(
            f"disk tier: {parent}, a parent of the disk cache folder, belongs to uid "
            f"{st.st_uid}, who could move the folder and put another in its place: use a "
            f"folder under ones that only the engine's user or root own "
            f"(or `chown {uid} {parent}`)")
    sticky_root = st.st_uid == 0 and st.st_mode & stat.S_ISVTX
    if st.st_mode & 0o022 and not sticky_root:
        raise ConfigError(
            f"disk tier: {parent}, a parent of the disk cache folder, is writable by its "
            f"group or others (mode {stat.S_IMODE(st.st_mode):o}), who could move the "
            f"folder and put another in its place: `chmod go-w {parent}`")


def write_new(folder: Path, name: str, data: bytes | list[bytes]) -> None:
    """`folder/name` holds `data`, 0600: written under a fresh temporary name and renamed
    over `name` (a symlink there is replaced, never followed)."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for part in data if isinstance(data, list) else [data]:
                f.write(part)
        os.replace(tmp, folder / name)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_regular(path: Path, size: int) -> bytes:
    """The `size` bytes of the regular file `path`; NotARegularFile if it is anything
    else (opened without following a symlink or waiting on a FIFO's writer), OSError if
    it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise NotARegularFile(f"{path}: not a regular file of {size} bytes")
        parts, left = [], size
        while left:
            part = os.read(fd, left)
            if not part:
                raise NotARegularFile(f"{path}: shorter than {size} bytes")
            parts.append(part)
            left -= len(part)
        return b"".join(parts)
    finally:
        os.close(fd)


def own_regular_file(st: os.stat_result) -> bool:
    """Whether an lstat result is a regular file of the engine's user (one a previous run
    of it may have left)."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def key_file_secret(folder: Path) -> bytes:
    """The secret kept in `folder/disk.key` (32 random bytes, 0600), made on first use:
    the disk key of an engine given no secret, so that its blocks outlive a restart."""
    path = folder / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except FileExistsError:
        return _read_key_file(path)
    key = secrets.token_bytes(KEY_BYTES)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def _read_key_file(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"disk tier: cannot read the key file {path} ({e.strerror}): "
                          f"remove it (the blocks written with it are then unreadable)") from None
    try:
        st = os.fstat(fd)
        if not own_regular_file(st) or st.st_mode & 0o077 or st.st_size != KEY_BYTES:
            raise ConfigError(
                f"disk tier: the key file {path} must be a regular file of {KEY_BYTES} "
                f"bytes of the engine's user, mode 600: `chmod 600 {path}` if it is that, "
                f"else remove it (its blocks are then unreadable)")
        return os.read(fd, KEY_BYTES)
    finally:
        os.close(fd)
