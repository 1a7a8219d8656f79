"""Moving running requests between engines, as the service does it: an operator's move
of one request, and a drain that moves every request off an engine.

The move itself runs between the two engine cores (engine/transfer/link.py): the
source's worker resolves the destination (its migration address, from the registry)
and hands the command to its core, which answers once the request runs there. The jobs
follow by themselves: the source's output processor hands the job's row over when it
sees the request end there as `migrated`, and the destination's picks the job up from
the request's first output there (kvops/worker/output_processor.py). The client's stream goes
on from the destination's producer at the offset where the source's stopped.
"""
from __future__ import annotations

import logging
import threading
import time

from django.conf import settings

from engine.transfer import ticket as move_ticket
from engine.errors import InvalidRequestError, InvalidStateError
from kvops import selectors
from kvops.operators import audit_chain
from kvops.engines.engine_config import engine_secret
from kvops.routing.routing import load_tokens
from kvops.models import Engine, Job, OperatorAction

log = logging.getLogger(__name__)

DRAIN_MOVE_TIMEOUT_S = 30.0  # one move of a drain
DRAIN_ROUNDS = 50  # passes over the engine's requests before a drain by migration stops
DRAIN_IDLE_S = 0.2  # between passes, while requests wait to be admitted


def _address(engine: Engine) -> str:
    address = (engine.config or {}).get("migration_address")
    if not address:
        raise InvalidStateError(f"engine {engine.name} takes no moving requests (its core "
                                "has no migration address)")
    return address


def destination(source: str, to: str) -> tuple[Engine, str]:
    """The engine named `to`, as the destination of a request running on `source`, with
    its migration address; InvalidRequestError (unknown, or the source itself) or
    InvalidStateError (not running, paused or draining)."""
    if not isinstance(to, str) or not to:
        raise InvalidRequestError("`to` must name the engine to move the request to")
    if to == source:
        raise InvalidRequestError(f"the request already runs on engine {to}")
    engine = Engine.objects.filter(name=to).first()
    if engine is None:
        raise InvalidRequestError(f"no engine is named {to!r}")
    state = selectors.engine_state(engine)
    if not selectors.engine_alive(engine) or state != "ready":
        raise InvalidStateError(f"engine {to} is {state if state != 'ready' else 'not live'}: "
                                "it takes no request now")
    return engine, _address(engine)


def route(source: str, to: str, request_id: str, expires: float,
          job_id: str | None = None) -> dict:
    """Where the request `request_id` of engine `source` moves to reach engine `to`, and
    the ticket that lets it ({"address", "to", "ticket"}), good until `expires` (Unix
    time): the destination takes only moves the service signed (engine/transfer/ticket.py).
    The ticket names the request's job (`job_id`, else the job whose attempt it is)."""
    _, address = destination(source, to)
    if job_id is None:
        pk = Job.objects.filter(request_id=request_id).values_list("pk", flat=True).first()
        job_id = None if pk is None else str(pk)
    return {"address": address, "to": to,
            "ticket": move_ticket.sign(engine_secret(settings.SECRET_KEY), request_id, job_id, source, to, expires)}


def destinations(source: Engine) -> list[Engine]:
    """The engines a request of `source` may move to: live, ready, serving its model,
    the least loaded first."""
    model = selectors.model_name(source)
    out = [e for e in Engine.objects.exclude(name=source.name)
           if selectors.engine_alive(e) and selectors.engine_state(e) == "ready"
           and selectors.model_name(e) == model and (e.config or {}).get("migration_address")]
    return sorted(out, key=lambda e: (load_tokens(e), e.name))


def migrate(client, request_id: str, to: str, staged: bool = True,
            timeout_s: float | None = None) -> dict:
    """Move the request `request_id` of this worker's engine (`client`) to engine `to`;
    the core's answer once it runs there. Raises what refuses it."""
    timeout_s = timeout_s or settings.KVOPS_CONTROL_TIMEOUT_S
    return client.command("migrate", {"request_id": request_id, "staged": staged,
                                      **route(client.name, to, request_id,
                                              time.time() + timeout_s)},
                          timeout_s=timeout_s)


def drain_targets(source: str, to: str | None = None) -> list[str]:
    """Where a drain by migration of `source` moves its requests: `to` if named, else
    every other live engine of its model; InvalidStateError if there is none."""
    if to is not None:
        return [destination(source, to)[0].name]
    engine = Engine.objects.get(name=source)
    targets = destinations(engine)
    if not targets:
        raise InvalidStateError(f"no other live engine serves {selectors.model_name(engine)}: "
                                "there is nowhere to move the requests to")
    return [t.name for t in targets]


def start_drain(client, targets: list[str]) -> None:
    """The engine is draining: move its requests to `targets` on a thread of the
    worker, until none is left. A request no engine takes runs on here until it ends."""
    threading.Thread(target=_drain, args=(client, targets),
                     name=f"kvops-drain-{client.name}", daemon=True).start()


def _drain(client, targets: list[str]) -> None:
    """Pass after pass: every running request moves (side by side, spread over the
    destinations by their free blocks as their last heartbeat said); requests still
    waiting here are admitted as the moves free blocks, and move in a later pass."""
    from django.db import connection
    try:
        failed: set[str] = set()
        for _ in range(DRAIN_ROUNDS):
            live = client.command("live-requests", {}, timeout_s=10.0)
            running = [rid for rid in live["running"] if rid not in failed]
            if not live["running"] and not live["waiting"]:
                break
            if not running:
                time.sleep(DRAIN_IDLE_S)
                continue
            moves = {}
            for i, rid in enumerate(running):
                to = targets[i % len(targets)]
                try:
                    where = route(client.name, to, rid, time.time() + DRAIN_MOVE_TIMEOUT_S)
                except (InvalidRequestError, InvalidStateError) as e:
                    failed.add(rid)
                    _audit(client.name, rid, to, {"ok": False, "message": str(e)})
                    continue
                moves[rid] = (to, client.command_async("migrate", {
                    "request_id": rid, "staged": True, "by": "drain", **where},
                    DRAIN_MOVE_TIMEOUT_S))
            for rid, (to, future) in moves.items():
                try:
                    result = {"ok": True, "result": future.result(DRAIN_MOVE_TIMEOUT_S + 5)}
                except Exception as e:  # noqa: BLE001  (it runs on here)
                    failed.add(rid)
                    result = {"ok": False, "error": type(e).__name__, "message": str(e)}
                _audit(client.name, rid, to, result)
        log.info("drain of %s by migration: done (%d requests could not move)",
                 client.name, len(failed))
    except Exception:  # noqa: BLE001  (the engine drains as `wait` does from here)
        log.exception("drain of %s by migration failed", client.name)
    finally:
        connection.close()


def _audit(engine: str, request_id: str, to: str, result: dict) -> None:
    """Each move of a drain, in the operator log."""
    try:
        audit_chain.seal(OperatorAction(
            user=None, engine=engine, action="migrate", target=request_id,
            params={"to": to, "by": "drain"}, ok=bool(result.get("ok")),
            status_code=200 if result.get("ok") else 409, result=result))
    except Exception as e:  # noqa: BLE001
        log.warning("drain of %s: the move of %s was not logged: %s", engine, request_id, e)


def watch_moved_in(client, processor, job, handle) -> None:
    """A job whose request moved to this worker's engine: its deadline is watched here
    as its task watched it on the engine it left (kvops/jobs/job_deadline.py: past it, it ends
    as failed), and a cancel asked for while it moved is applied."""
    from kvops.jobs import job_deadline, job_store

    def watch() -> None:
        from django.db import connection
        try:
            if job_store.cancels_requested([job.pk]):
                client.abort_quietly(job.request_id)
            job_deadline.wait_or_end(client, processor, job, handle)
        except Exception:  # noqa: BLE001  (the reaper moves what is left)
            log.exception("job %s: watching it after its move failed", job.pk)
        finally:
            connection.close()

    threading.Thread(target=watch, name=f"kvops-moved-in-{job.pk}", daemon=True).start()
