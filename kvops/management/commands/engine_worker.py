"""`python manage.py engine_worker --name NAME`: start one engine worker (a Celery worker
with the threads pool, named engine-NAME@host, on its own queue and the shared one)."""
import os
import socket
import sys

from django.conf import settings
from django.core.management.base import BaseCommand

from kvops.engines.engine_config import config_from_env
from kvops.infra.run import quiet_args


class Command(BaseCommand):
    help = "Start an engine worker (configure the engine with KVOPS_ENGINE_* variables)."

    def add_arguments(self, parser):
        parser.add_argument("--name", default=settings.KVOPS_ENGINE_NAME)
        parser.add_argument("--threads", type=int, default=None,
                            help="job threads (default: max_num_seqs + 16)")
        parser.add_argument("--no-shared-queue", action="store_true",
                            help="take only jobs addressed to this engine")
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args, **opts):
        name = opts["name"]
        env = dict(os.environ, KVOPS_ENGINE_WORKER="1", KVOPS_ENGINE_NAME=name)
        # Each job holds a thread while it runs: more threads than the batch holds, or
        # continuous batching never sees a full batch.
        max_seqs = config_from_env(env).max_num_seqs
        threads = opts["threads"] or max_seqs + 16
        queues = f"engine.{name}" if opts["no_shared_queue"] else f"engine.{name},jobs"
        argv = [sys.executable, "-m", "celery", "-A", "kvops", *quiet_args(), "worker", "-P", "threads",
                "-c", str(threads), "-Q", queues, "-n", f"engine-{name}@{socket.gethostname()}",
                "--without-gossip", "--without-mingle", "-l", opts["loglevel"]]
        os.execve(sys.executable, argv, env)

