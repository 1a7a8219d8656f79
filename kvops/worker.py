"""Engine worker bootstrap: one engine per Celery worker process.

A worker started with KVOPS_ENGINE_WORKER=1 starts its engine when Celery initialises
(configuration from KVOPS_ENGINE_* variables): its client (kvops/engine_client.py) runs
the engine core in a process of its own by default, or on a thread
(KVOPS_ENGINE_CORE=thread), with the output processor and the live KV view's publisher
as its sinks. It registers an Engine row, beats its heart, and answers the
`kvops_engine` control command.
Start one with `python manage.py engine_worker --name NAME`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from typing import Any

from celery import signals
from celery.worker.control import control_command

from kvops.group_commit import GroupCommit

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerContext:
    """What an engine worker process holds: its engine client, the output processor that
    streams and stores its jobs' progress, and the batcher that claims jobs delivered
    together in one transaction. Made once, at the worker's start (or by a test, for an
    engine in its own process), and reached through `context()`."""
    client: Any  # an EngineClient (kvops/engine_client.py)
    processor: Any  # its OutputProcessor
    claim: GroupCommit = dataclasses.field(
        default_factory=lambda: GroupCommit(_claim_jobs))

    def close(self) -> None:
        self.client.stop()
        self.processor.close()


def _claim_jobs(claims):
    from kvops import job_store
    return job_store.claim_jobs(claims)


_context: WorkerContext | None = None
_stop = threading.Event()
_shutting_down = threading.Event()  # the worker got its stop signal (warm or cold)


def context() -> WorkerContext:
    """This process's worker context; a RuntimeError where it is not an engine worker."""
    if _context is None:
        raise RuntimeError("this process is not an engine worker (KVOPS_ENGINE_WORKER=1)")
    return _context


def install(ctx: WorkerContext | None) -> WorkerContext | None:
    """Make `ctx` this process's worker context (None: none); returns the one before."""
    global _context
    before, _context = _context, ctx
    return before


@signals.worker_init.connect
def _start_engine(sender=None, **kwargs) -> None:
    from django.conf import settings
    if not settings.KVOPS_ENGINE_WORKER:
        return
    import django
    django.setup()

    from kvops import live, registry
    from kvops.reaper import reap
    from kvops.engine_client import make_engine_client
    from kvops.engine_config import config_from_env
    from kvops.job_stream import StreamProducer
    from kvops.output_processor import OutputProcessor
    from kvops.prefix_index import PrefixIndex
    from kvops.prompts import tokenizer_for
    from kvops.publisher import EnginePublisher

    # the share of a batch one user may hold: the service-wide one unless set per engine
    config = config_from_env(os.environ, {"max_batch_share": settings.KVOPS_MAX_BATCH_SHARE})
    mode = settings.KVOPS_ENGINE_CORE
    log.info("starting engine %s (core: %s)", config.name, mode)
    tokenizer = tokenizer_for(config)
    if tokenizer is None:
        raise SystemExit(f"engine {config.name}: its tokenizer is not readable from the worker "
                         f"({config.model})")
    # The processor and the publisher reach the client through these closures: none is
    # called before the client has started.
    processor = OutputProcessor(config.name, StreamProducer(live.redis_client(), config.name),
                                tokenizer, lambda request_id: client.finish_request(request_id))
    try:
        client = make_engine_client(mode, config, processor,
                                    on_kv_item=lambda item: publisher.on_item(item),
                                    tokenizer=tokenizer, worker_stopping=_shutting_down.is_set,
                                    **_core_process_settings(settings))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    publisher = EnginePublisher(config.name, source=client,
                                prefix_index=PrefixIndex(config.name, client))
    client.start()
    install(WorkerContext(client, processor))
    hostname = getattr(sender, "hostname", None) or f"engine-{config.name}@{socket.gethostname()}"
    registry.register_engine(config.name, hostname, socket.gethostname(), client.instance,
                             client.describe_config())
    # Jobs a previous run of this engine left `running` will never finish: move them on.
    reap()


def _core_process_settings(settings) -> dict:
    out = {"log_level": settings.KVOPS_LOG_LEVEL}
    if settings.KVOPS_ENGINE_CORE_NICE is not None:
        out["core_nice"] = settings.KVOPS_ENGINE_CORE_NICE
    return out


@signals.worker_ready.connect
def _engine_ready(sender=None, **kwargs) -> None:
    """Celery's consumer is up, remote control included: only now is the engine `ready`.
    (Registered ready at worker_init, an operator's command sent in between went to no
    one: control is a broadcast, and a worker not yet listening never sees it.)"""
    if _context is None:
        return
    from django.db import connection

    from kvops import registry
    client = _context.client
    try:
        registry.heartbeat(client.name, client.instance, client.latest_metrics)
    finally:
        connection.close()
    threading.Thread(target=_heartbeat, args=(client,),
                     name="kvops-heartbeat", daemon=True).start()


def _beat_now(client) -> None:
    from django.db import connection

    from kvops import registry
    try:
        registry.heartbeat(client.name, client.instance, client.latest_metrics)
    except Exception as e:  # the next beat says it
        log.warning("heartbeat after a state command failed: %s", e)
    finally:
        connection.close()


def _heartbeat(client) -> None:
    from django.conf import settings
    from django.db import connection

    from kvops import registry
    from kvops.routing import reset_pending_load

    while not _stop.wait(settings.KVOPS_HEARTBEAT_S):
        try:
            if client.alive:
                registry.heartbeat(client.name, client.instance, client.latest_metrics)
                reset_pending_load(client.name)
        except Exception as e:  # database briefly away: try again next beat
            log.warning("heartbeat failed: %s", e)
        finally:
            connection.close()


@signals.worker_shutting_down.connect
def _note_shutting_down(**kwargs) -> None:
    _shutting_down.set()


@signals.worker_shutdown.connect
def _stop_engine(**kwargs) -> None:
    _stop.set()
    ctx = install(None)
    if ctx is None:
        return
    from kvops import registry
    try:
        registry.mark_engine_stopped(ctx.client.name)
    except Exception as e:
        log.warning("could not mark engine stopped: %s", e)
    ctx.close()


@control_command(args=[("command", str), ("arguments", dict), ("deadline", float)],
                 signature="<command> [arguments] [deadline]")
def kvops_engine(state, command: str, arguments: dict | None = None,
                 deadline: float | None = None) -> dict:
    """Apply an operator command to this worker's engine between two steps. `deadline`
    (Unix time) is when the web stops waiting for the answer: a command the engine has
    not reached by then is dropped, never applied late."""
    from django.conf import settings

    from engine import EngineError
    from engine.commands import STATE_COMMANDS

    started = time.monotonic()
    timeout_s = settings.KVOPS_CONTROL_TIMEOUT_S
    if deadline is not None:
        timeout_s = min(timeout_s, deadline - time.time())
    try:
        if timeout_s <= 0:
            raise TimeoutError("the command arrived after its deadline")
        client = context().client
        result = client.command(command, dict(arguments or {}), timeout_s=timeout_s)
        if command in STATE_COMMANDS:
            # The engine's row says its new state before the web hears the answer (its
            # metrics, which the core sent before the reply, written as a heartbeat: the
            # row's one writer is this worker, with what its core reports)
            _beat_now(client)
        return {"ok": True, "result": result, "ms": round(1000 * (time.monotonic() - started))}
    except TimeoutError as e:
        return {"ok": False, "error": "CommandExpired", "message": f"not applied: {e}"}
    except EngineError as e:
        return {"ok": False, "error": type(e).__name__, "message": str(e)}
    except (KeyError, TypeError) as e:
        return {"ok": False, "error": "InvalidRequestError", "message": f"bad arguments: {e}"}
    except Exception as e:
        log.exception("control command %s failed", command)
        return {"ok": False, "error": type(e).__name__, "message": str(e)}
