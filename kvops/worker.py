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

from celery import signals
from celery.worker.control import control_command

log = logging.getLogger(__name__)

_client = None  # the EngineClient of this process, if it is an engine worker
_processor = None  # its OutputProcessor
_stop = threading.Event()
_shutting_down = threading.Event()  # the worker got its stop signal (warm or cold)


def get_engine_client():
    if _client is None:
        raise RuntimeError("this process is not an engine worker (KVOPS_ENGINE_WORKER=1)")
    return _client


def get_output_processor():
    if _processor is None:
        raise RuntimeError("this process is not an engine worker (KVOPS_ENGINE_WORKER=1)")
    return _processor


@signals.worker_init.connect
def _start_engine(sender=None, **kwargs) -> None:
    global _client, _processor
    if os.environ.get("KVOPS_ENGINE_WORKER") != "1":
        return
    import django
    django.setup()
    from django.conf import settings

    from kvops import live, services
    from kvops.engine_client import make_engine_client
    from kvops.engine_config import config_from_env
    from kvops.job_stream import StreamProducer
    from kvops.output_processor import OutputProcessor
    from kvops.prompts import tokenizer_for
    from kvops.publisher import EnginePublisher

    config = config_from_env(os.environ)
    if not os.environ.get("KVOPS_ENGINE_MAX_BATCH_SHARE"):  # the service-wide share
        config = dataclasses.replace(config, max_batch_share=settings.KVOPS_MAX_BATCH_SHARE)
    mode = os.environ.get("KVOPS_ENGINE_CORE", "process")
    log.info("starting engine %s (core: %s)", config.name, mode)
    tokenizer = tokenizer_for(config)
    if tokenizer is None:
        raise SystemExit(f"engine {config.name}: its tokenizer is not readable from the worker "
                         f"({config.model})")
    # The processor and the publisher reach the client through these closures: none is
    # called before the client has started.
    _processor = OutputProcessor(config.name, StreamProducer(live.redis_client(), config.name),
                                 tokenizer, lambda request_id: client.finish_request(request_id))
    try:
        client = make_engine_client(mode, config, _processor,
                                    on_kv_item=lambda item: publisher.on_item(item),
                                    tokenizer=tokenizer, worker_stopping=_shutting_down.is_set)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    publisher = EnginePublisher(config.name, source=client)
    client.start()
    _client = client
    hostname = getattr(sender, "hostname", None) or f"engine-{config.name}@{socket.gethostname()}"
    services.register_engine(config.name, hostname, socket.gethostname(), client.instance,
                             client.describe_config())
    # Jobs a previous run of this engine left `running` will never finish: move them on.
    services.reap()


@signals.worker_ready.connect
def _engine_ready(sender=None, **kwargs) -> None:
    """Celery's consumer is up, remote control included: only now is the engine `ready`.
    (Registered ready at worker_init, an operator's command sent in between went to no
    one: control is a broadcast, and a worker not yet listening never sees it.)"""
    if _client is None:
        return
    from django.db import connection

    from kvops import services
    try:
        services.heartbeat(_client.name, _client.instance, _client.latest_metrics)
    finally:
        connection.close()
    threading.Thread(target=_heartbeat, args=(_client.name, _client.instance),
                     name="kvops-heartbeat", daemon=True).start()


def _beat_now(client) -> None:
    from django.db import connection

    from kvops import services
    try:
        services.heartbeat(client.name, client.instance, client.latest_metrics)
    except Exception as e:  # the next beat says it
        log.warning("heartbeat after a state command failed: %s", e)
    finally:
        connection.close()


def _heartbeat(name: str, instance: str) -> None:
    from django.conf import settings
    from django.db import connection

    from kvops import services
    from kvops.routing import reset_pending_load

    while not _stop.wait(settings.KVOPS_HEARTBEAT_S):
        try:
            if _client is not None and _client.alive:
                services.heartbeat(name, instance, _client.latest_metrics)
                reset_pending_load(name)
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
    if _client is None:
        return
    from kvops import services
    try:
        services.mark_engine_stopped(_client.name)
    except Exception as e:
        log.warning("could not mark engine stopped: %s", e)
    _client.stop()
    if _processor is not None:
        _processor.close()


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
        client = get_engine_client()
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
