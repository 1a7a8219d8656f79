"""Operator actions: one command sent to an engine's worker, answered and recorded
in the operator log (with an Idempotency-Key, sent once however often it is retried)."""
from __future__ import annotations

from django.conf import settings
from django.db import IntegrityError, transaction

from engine.serve.commands import STATE_COMMANDS
from kvops import selectors
from kvops.engines import control
from kvops.jobs import idempotency
from kvops.operators import audit_chain
from kvops.jobs.idempotency import KeyReused
from kvops.models import Engine, OperatorAction
from kvops.routing.routing import SHARED_QUEUE


ERROR_STATUS = {"UnknownRequestError": 404, "InvalidStateError": 409, "MigrationFailed": 409,
                "NotEnoughBlocksError": 409, "PrefixNotCachedError": 409,
                "InvalidRequestError": 400, "CommandExpired": 504}


def operator_action(user, engine: Engine, action: str, target: str, arguments: dict,
                    idempotency_key: str = "") -> tuple[int, dict, bool]:
    """Send one operator command to the engine's worker, record it, and answer with
    (HTTP status, body, replayed). With an idempotency key the row is stored first, so
    a retry of the same action (replayed: True) gets the first answer and the command
    is sent once; KeyReused if the key belongs to another action, or its first call is
    not answered yet."""
    params = {k: v for k, v in arguments.items() if k != "request_id"}
    row = OperatorAction(user=user, engine=engine.name, action=action, target=target,
                         params=params, idempotency_key=idempotency_key)
    if idempotency_key:
        try:
            with transaction.atomic():
                row.save()
        except IntegrityError:
            prior = OperatorAction.objects.get(user=user, idempotency_key=idempotency_key)
            if (prior.engine, prior.action, prior.target, prior.params) != \
                    (engine.name, action, target, params):
                raise KeyReused(f"{idempotency.HEADER} {idempotency_key!r} was used for "
                                f"another action ({prior.action} on {prior.engine})") from None
            if not prior.status_code:
                raise KeyReused(f"the first call with {idempotency.HEADER} "
                                f"{idempotency_key!r} is still being answered") from None
            return prior.status_code, prior.result, True
    # the engine names the operator where it explains what the command did (KV stories)
    reply = control.send_engine_command(engine.worker, action,
                                        {**arguments, "by": user.username})
    if reply is None:
        status, body = 504, {"ok": False, "error": "Timeout",
                             "message": f"engine {engine.name} ({engine.worker}) did not answer "
                                        f"within {settings.KVOPS_CONTROL_TIMEOUT_S:g} s"}
    elif reply.get("ok"):
        status, body = 200, reply
    else:
        status, body = ERROR_STATUS.get(reply.get("error"), 500), reply
    row.ok, row.status_code, row.result = status == 200, status, body
    audit_chain.seal(row)
    if status == 200 and action in STATE_COMMANDS:
        # the worker wrote the engine's new state (its heartbeat) before it answered: the
        # next read of the engines must see it
        selectors.forget_recent_engines()
        if action in ("drain", "undrain"):  # a draining worker takes nothing from the shared queue
            consumers = control.app.control
            (consumers.cancel_consumer if action == "drain" else consumers.add_consumer)(
                SHARED_QUEUE, destination=[engine.worker], reply=True,
                timeout=settings.KVOPS_CONTROL_TIMEOUT_S)
    return status, body, False
