"""Writes that outlive a database restart. A restart of PostgreSQL (or a failover) kills
every open connection; Django notices only when a query fails on it, and a worker
thread has no request boundary at which a broken connection would be dropped. A write
made idempotent by its WHERE clause (it matches only the attempt that owns the job) is
run again, on a fresh connection, until the database answers or RETRY_FOR_S passes."""
from __future__ import annotations

import functools
import logging
import time
from typing import Callable, TypeVar

from django.db import InterfaceError, OperationalError, connection

log = logging.getLogger(__name__)

RETRY_FOR_S = 30.0
_FIRST_WAIT_S, _MAX_WAIT_S = 0.1, 2.0

T = TypeVar("T")


def retried_on_reconnect(write: Callable[..., T]) -> Callable[..., T]:
    """write, run again on a fresh connection while the database is away. Inside a
    transaction the error is the caller's: its transaction is lost with the connection."""
    @functools.wraps(write)
    def run(*args, **kwargs) -> T:
        deadline = time.monotonic() + RETRY_FOR_S
        wait = _FIRST_WAIT_S
        while True:
            try:
                return write(*args, **kwargs)
            except (OperationalError, InterfaceError) as e:
                if connection.in_atomic_block or time.monotonic() + wait > deadline:
                    raise
                log.warning("%s: the database connection failed (%s); again on a new one",
                            write.__name__, str(e).strip().splitlines()[0] if str(e) else e)
                connection.close()
                time.sleep(wait)
                wait = min(wait * 2, _MAX_WAIT_S)
    return run
