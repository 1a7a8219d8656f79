import logging

from django.apps import AppConfig

log = logging.getLogger(__name__)


class KvopsConfig(AppConfig):
    name = "kvops"
    verbose_name = "kvops"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        warn_loose_files()


def warn_loose_files() -> list[str]:
    """Say, at every start, which files holding tokens, prompts or keys (and their
    folders) other users of this machine could read. Returns the warnings."""
    from django.conf import settings
    from django.db import connections

    from kvops.infra.private_file import loose_modes, private_paths
    database = connections.settings["default"]
    name = database["NAME"] if database["ENGINE"].endswith(("sqlite3", ".sqlite")) else None
    lines = loose_modes(private_paths(settings.DATA_DIR, str(name) if name else None))
    for line in lines:
        log.warning("file permissions: %s", line)
    return lines
