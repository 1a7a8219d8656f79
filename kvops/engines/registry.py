"""The engine registry: each engine worker's row (its config, its heartbeat with the
metrics its core reports, its status). The worker is the rows' one writer; the web
reads them (kvops/selectors.py)."""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from kvops.models import Engine


def live_instances() -> set[str]:
    """Worker processes whose heartbeat is fresh."""
    cutoff = timezone.now() - timedelta(seconds=settings.KVOPS_ENGINE_DEAD_AFTER_S)
    return set(Engine.objects.filter(status=Engine.Status.READY, last_heartbeat__gte=cutoff)
               .values_list("instance", flat=True))


def register_engine(name: str, worker: str, host: str, instance: str, config: dict,
                    stack: str) -> Engine:
    """The engine's row, `starting` until its worker can take commands (its first
    heartbeat). `stack`: its deployment's id (the worker has claimed the name under it on
    the Redis database: kvops/engines/engine_claim.py)."""
    now = timezone.now()
    engine, _ = Engine.objects.update_or_create(name=name, defaults={
        "worker": worker, "host": host, "instance": instance, "config": config, "stack": stack,
        "status": Engine.Status.STARTING, "started_at": now, "last_heartbeat": now})
    return engine


def heartbeat(name: str, instance: str, metrics: dict) -> None:
    """The worker's beat, the first when Celery's consumer is up: the engine is ready
    and these are its metrics."""
    Engine.objects.filter(name=name, instance=instance).update(
        last_heartbeat=timezone.now(), metrics=metrics, status=Engine.Status.READY)


def mark_engine_stopped(name: str, instance: str) -> None:
    """The worker instance stops: no job is routed to its engine any more."""
    Engine.objects.filter(name=name, instance=instance).update(status=Engine.Status.STOPPED)
