"""Operator commands from the web to one engine worker, over Celery remote control."""
from __future__ import annotations

from django.conf import settings

from kvops.celery import app

CONTROL_COMMAND = "kvops_engine"


def send_engine_command(worker: str, command: str, arguments: dict,
                        timeout_s: float | None = None) -> dict | None:
    """Ask the worker to apply `command` between two steps; its reply, or None if it
    did not answer in time. A reply is {"ok": True, "result": ...} or
    {"ok": False, "error": <EngineError class name>, "message": ...}."""
    replies = app.control.broadcast(
        CONTROL_COMMAND, arguments={"command": command, "arguments": arguments},
        destination=[worker], reply=True,
        timeout=settings.KVOPS_CONTROL_TIMEOUT_S if timeout_s is None else timeout_s)
    for reply in replies or []:
        if worker in reply:
            return reply[worker]
    return None
