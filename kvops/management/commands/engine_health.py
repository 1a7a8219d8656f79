"""Exit 0 if this container's engine (KVOPS_ENGINE_NAME) has a fresh heartbeat, else 1:
the health check of an engine service in docker-compose."""
import sys

from django.conf import settings
from django.core.management.base import BaseCommand

from kvops import selectors


class Command(BaseCommand):
    help = "Health check of the engine named by KVOPS_ENGINE_NAME."

    def handle(self, *args, **opts):
        name = settings.KVOPS_ENGINE_NAME
        engine = selectors.engines().filter(name=name).first()
        if engine is None or not selectors.engine_alive(engine):
            self.stderr.write(f"engine {name} is not alive")
            sys.exit(1)
        self.stdout.write(f"engine {name} is alive")
