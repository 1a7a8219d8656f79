"""The Celery app shared by the web process (which enqueues jobs and sends control
commands) and the engine workers (which run them)."""
import os

from celery import Celery

import kvops.infra.broker  # noqa: F401  (registers the broker transport that settings name)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvops.settings")

app = Celery("kvops")
app.config_from_object("django.conf:settings", namespace="CELERY")

# The broker and its redelivery timeout come from settings (CELERY_*), read when Celery
# first needs its configuration.
app.conf.update(
    # A GPU job is long and expensive: take one at a time, acknowledge it only when it
    # is done, and hand it back if the worker process dies under it.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue="jobs",
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    broker_connection_retry_on_startup=True,
    enable_utc=True,
)
app.autodiscover_tasks(["kvops"])
# Control commands and worker signals: a worker imports the module as it starts, and
# importing registers them (by name here: the worker module imports what imports this).
app.conf.imports = ("kvops.worker.worker",)
