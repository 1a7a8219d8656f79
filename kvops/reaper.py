"""Keeping jobs moving when workers or Redis go away: reap() moves on the jobs nobody
will finish, and a background thread in the web process runs it every few seconds and
re-dispatches queued jobs when Redis restarts (a restarted Redis has lost the broker's
messages). An engine worker reaps once as it starts."""
from __future__ import annotations

import logging
import threading
from datetime import timedelta

from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from kvops import live
from kvops.job_store import requeue_job
from kvops.models import Engine, Job
from kvops.outbox import redispatch_queued, send_unsent
from kvops.registry import live_instances

log = logging.getLogger(__name__)
_started = threading.Event()


def reap() -> list[int]:
    """Find jobs nobody will finish and move them on. Running jobs whose worker process
    is gone (heartbeat stopped, or the engine restarted) run again elsewhere; queued jobs
    routed to a dead engine are routed again; queued jobs whose task was never sent are
    sent. Returns the ids touched."""
    cutoff = timezone.now() - timedelta(seconds=settings.KVOPS_ENGINE_DEAD_AFTER_S)
    Engine.objects.filter(status=Engine.Status.READY, last_heartbeat__lt=cutoff) \
        .update(status=Engine.Status.DEAD)
    alive = live_instances()
    dead_names = set(Engine.objects.exclude(status=Engine.Status.READY)
                     .values_list("name", flat=True))
    touched = []
    for job in Job.objects.filter(status=Job.Status.RUNNING).exclude(engine_instance__in=alive):
        if requeue_job(job.pk, f"engine {job.engine or '?'} stopped while running it"):
            touched.append(job.pk)
    for job in Job.objects.filter(status=Job.Status.QUEUED, queued_at__lt=cutoff):
        target = (job.routing or {}).get("engine")
        if target in dead_names and requeue_job(job.pk, f"engine {target} is not running"):
            touched.append(job.pk)
    touched += send_unsent(settings.KVOPS_OUTBOX_AFTER_S, settings.KVOPS_RESEND_AFTER_S)
    return touched


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
            reap()
            current = _redis_run_id()
            if current and run_id and current != run_id:
                n = redispatch_queued("Redis restarted and lost the queue")
                log.warning("Redis restarted: re-dispatched %d queued jobs", n)
            run_id = current or run_id
        except Exception:
            log.exception("reaper pass failed")
        finally:
            close_old_connections()
