"""`python manage.py web`: the web server as `make run` starts it (kvops/run.py,
web_server_argv), for containers and process managers."""
import os

from django.core.management.base import BaseCommand

from kvops.run import web_server_argv


class Command(BaseCommand):
    help = "Start the web server (uvicorn, with the options make run gives it)."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=int(os.environ.get("KVOPS_PORT", 8000)))

    def handle(self, *args, **opts):
        argv = web_server_argv(opts["host"], opts["port"])
        os.execv(argv[0], argv)
