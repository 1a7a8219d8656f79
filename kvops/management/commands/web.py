"""`python manage.py web`: the web server as `make run` starts it (kvops/infra/run.py,
web_server_argv), for containers and process managers."""
import os

from django.conf import settings
from django.core.management.base import BaseCommand

from kvops.infra.run import web_server_argv


class Command(BaseCommand):
    help = "Start the web server (uvicorn, with the options make run gives it)."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=settings.KVOPS_PORT)

    def handle(self, *args, **opts):
        argv = web_server_argv(opts["host"], opts["port"], settings.KVOPS_TRUSTED_PROXIES)
        os.execv(argv[0], argv)
