"""`python manage.py ops_worker`: start the ops worker, a Celery worker on the `ops`
queue only, for the service's own heavy work (what-if replays, kvops/what_if/what_if.py), away
from the engine workers, whose processes serve jobs."""
import os
import socket
import sys

from django.core.management.base import BaseCommand

from kvops.infra.run import quiet_args
from kvops.what_if.what_if import OPS_QUEUE


class Command(BaseCommand):
    help = "Start the ops worker (what-if replays)."

    def add_arguments(self, parser):
        parser.add_argument("--concurrency", type=int, default=1,
                            help="replays at once, each in a process of its own (default 1)")
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args, **opts):
        env = dict(os.environ)
        env.pop("KVOPS_ENGINE_WORKER", None)  # never an engine in this worker
        # prefork: each replay in a child process, which the task's time limit can stop
        argv = [sys.executable, "-m", "celery", "-A", "kvops", *quiet_args(), "worker", "-P", "prefork",
                "-c", str(opts["concurrency"]), "-Q", OPS_QUEUE,
                "-n", f"ops@{socket.gethostname()}", "--without-gossip", "--without-mingle",
                "-l", opts["loglevel"]]
        os.execve(sys.executable, argv, env)

