"""Keeping jobs moving when workers or Redis go away: reap() moves on the jobs nobody
will finish, and a background thread in the web process runs it every few seconds and
re-dispatches queued jobs when Redis restarts (a restarted Redis has lost the broker's
messages), across restarts of the web process too (check_broker). An engine worker reaps once as it starts."""
from __future__ import annotations

import logging
import threading
from datetime import timedelta

from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from kvops import live
from kvops.jobs.job_store import requeue_job
from kvops.models import Engine, Job
from kvops.jobs.outbox import redispatch_queued, send_unsent
from kvops.engines.registry import live_instances

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


# Set in Redis while its broker queues hold kvops' messages: a Redis started again empty
# (the private one `make run` starts, or any without persistence) has lost the mark and
# the messages together, whichever process started it.
QUEUE_MARK = "kvops:broker:queue-mark"


def check_broker() -> int:
    """Re-dispatch the queued jobs if the broker lost its messages (the mark is gone);
    the first web process to see it does, once. Stale deliveries are ignored by the
    claim, so a job whose message survived still runs once."""
    try:
        lost = live.redis_client().set(QUEUE_MARK, "1", nx=True)
    except Exception:  # Redis away: the next pass looks again
        return 0
    if not lost:
        return 0
    n = redispatch_queued("Redis restarted and lost the queue")
    if n:
        log.warning("Redis started afresh: re-dispatched %d queued jobs", n)
    return n


def _loop() -> None:
    interval = max(1.0, settings.KVOPS_HEARTBEAT_S)
    while True:
        try:
            check_broker()
            reap()
        except Exception:
            log.exception("reaper pass failed")
        finally:
            close_old_connections()
        threading.Event().wait(interval)
