"""Files only their owner may read (the secret key, the first admin's password),
created with mode 0600 and O_EXCL in one call: never readable by others, not even for
the moment between a create and a chmod, and never written over."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

SECRET_KEY_FILE = "secret_key"


def create_private(path: Path, text: str) -> bool:
    """Write text to a new file, mode 0600. False if the file exists already (it is left
    as it is: two processes starting at once keep the first one's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
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
