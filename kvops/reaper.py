"""A background thread in the web process that keeps jobs moving when workers or Redis
go away: it runs services.reap() every few seconds, and re-dispatches queued jobs when
Redis restarts (a restarted Redis has lost the broker's messages)."""
from __future__ import annotations

import logging
import threading

from django.conf import settings
from django.db import close_old_connections

from kvops import live, services

log = logging.getLogger(__name__)
_started = threading.Event()


def start() -> None:
    if _started.is_set():
        return
    _started.set()
    threading.Thread(target=_loop, name="kvops-reaper", daemon=True).start()


def _redis_run_id() -> str | None:
    try:
        return live.redis_client().info("server")["run_id"]
    except Exception:
        return None


def _loop() -> None:
    interval = max(1.0, settings.KVOPS_HEARTBEAT_S)
    run_id = _redis_run_id()
    while True:
        threading.Event().wait(interval)
        try:
            services.reap()
            current = _redis_run_id()
            if current and run_id and current != run_id:
                n = services.redispatch_queued("Redis restarted and lost the queue")
                log.warning("Redis restarted: re-dispatched %d queued jobs", n)
            run_id = current or run_id
        except Exception:
            log.exception("reaper pass failed")
        finally:
            close_old_connections()
