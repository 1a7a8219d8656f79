"""Operator commands from the web to one engine worker, over Celery remote control."""
from __future__ import annotations

import time

from django.conf import settings

from kvops.celery import app
from kvops.engines.stack_id import stack_id

CONTROL_COMMAND = "kvops_engine"
REPLY_GRACE_S = 1.0  # the answer to a command applied just before its deadline


def send_engine_command(worker: str, command: str, arguments: dict,
                        timeout_s: float | None = None) -> dict | None:
    """Ask the worker to apply `command` between two steps; its reply, or None if it
    did not answer in time. A reply is {"ok": True, "result": ...} or
    {"ok": False, "error": <EngineError class name>, "message": ...}. The command carries
    this deployment's stack id: a worker of another one ignores it (kvops/worker/worker.py),
    which reads here as no answer."""
    timeout_s = settings.KVOPS_CONTROL_TIMEOUT_S if timeout_s is None else timeout_s
    # One deadline for both sides: the engine drops the command once it has passed, and
    # the answer is awaited a little longer, so an action reported as timed out did not
    # happen.
    deadline = time.time() + timeout_s
    replies = app.control.broadcast(
        CONTROL_COMMAND, arguments={"command": command, "arguments": arguments,
                                    "deadline": deadline, "stack": stack_id()},
        destination=[worker], reply=True, timeout=timeout_s + REPLY_GRACE_S)
    for reply in replies or []:
        if worker in reply:
            return reply[worker]
    return None
