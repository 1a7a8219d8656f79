"""The Celery app shared by the web process (which enqueues jobs and sends control
commands) and the engine workers (which run them)."""
import os

from celery import Celery

from kvops.broker import broker_url

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvops.settings")

app = Celery("kvops")
app.config_from_object("django.conf:settings", namespace="CELERY")

_job_timeout = int(os.environ.get("KVOPS_JOB_TIMEOUT_S", 3600))
app.conf.update(
    broker_url=broker_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")),
    # A GPU job is long and expensive: take one at a time, acknowledge it only when it
    # is done, and hand it back if the worker process dies under it.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    # Redis redelivers an unacknowledged message after this long: longer than any job.
    broker_transport_options={"visibility_timeout": _job_timeout + 300},
    task_default_queue="jobs",
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    broker_connection_retry_on_startup=True,
    enable_utc=True,
)
app.autodiscover_tasks(["kvops"])

# Control commands and worker signals: importing registers them (harmless off-worker).
from kvops import worker  # noqa: E402,F401
