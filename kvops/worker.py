"""Engine worker bootstrap: one engine per Celery worker process.

A worker started with KVOPS_ENGINE_WORKER=1 starts its engine when Celery initialises
(configuration from KVOPS_ENGINE_* variables): an engine core process of its own by
default, or a thread (KVOPS_ENGINE_CORE=thread). It wires the output processor and the
live KV view's publisher to it, registers an Engine row, beats its heart, and answers the
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
import uuid

from celery import signals
from celery.worker.control import control_command

log = logging.getLogger(__name__)

_service = None  # the EngineService of this process, if it is an engine worker
_processor = None  # its OutputProcessor
_stop = threading.Event()
_shutting_down = threading.Event()  # the worker got its stop signal (warm or cold)


def get_engine_service():
    if _service is None:
        raise RuntimeError("this process is not an engine worker (KVOPS_ENGINE_WORKER=1)")
    return _service


def get_output_processor():
    if _processor is None:
        raise RuntimeError("this process is not an engine worker (KVOPS_ENGINE_WORKER=1)")
    return _processor


@signals.worker_init.connect
def _start_engine(sender=None, **kwargs) -> None:
    global _service, _processor
    if os.environ.get("KVOPS_ENGINE_WORKER") != "1":
        return
    import django
    django.setup()
    from django.conf import settings

    from kvops import live, services
    from kvops.engine_client import EngineCoreClient
    from kvops.engine_service import EngineService, config_from_env
    from kvops.job_stream import StreamProducer
    from kvops.output_processor import OutputProcessor
    from kvops.publisher import EnginePublisher

    config = config_from_env(os.environ)
    if not os.environ.get("KVOPS_ENGINE_MAX_BATCH_SHARE"):  # the service-wide share
        config = dataclasses.replace(config, max_batch_share=settings.KVOPS_MAX_BATCH_SHARE)
    mode = os.environ.get("KVOPS_ENGINE_CORE", "process")
    log.info("starting engine %s (core: %s)", config.name, mode)
    if mode == "process":
        _service = EngineCoreClient(config, worker_stopping=_shutting_down.is_set)
    elif mode == "thread":
        _service = EngineService(config)
    else:
        raise SystemExit(f"KVOPS_ENGINE_CORE={mode!r}: use `thread` or `process`")
    _service.start()  # no request before the sink is set: the worker takes no job yet
    if _service.tokenizer is None:
        raise SystemExit(f"engine {config.name}: its tokenizer is not readable from the worker "
                         f"({_service.describe_config().get('model_path')})")
    _processor = OutputProcessor(config.name, StreamProducer(live.redis_client(), config.name),
                                 _service.tokenizer, _service.finish_request)
    _service.sink = _processor
    _service.attach_kv_view(EnginePublisher(config.name, source=_service).on_item)
    hostname = getattr(sender, "hostname", None) or f"engine-{config.name}@{socket.gethostname()}"
    describe = _service.describe_config()
    _service.instance = uuid.uuid4().hex
    services.register_engine(config.name, hostname, socket.gethostname(), _service.instance,
                             describe)
    # Jobs a previous run of this engine left `running` will never finish: move them on.
    services.reap()


@signals.worker_ready.connect
def _engine_ready(sender=None, **kwargs) -> None:
    """Celery's consumer is up, remote control included: only now is the engine `ready`.
    (Registered ready at worker_init, an operator's command sent in between went to no
    one: control is a broadcast, and a worker not yet listening never sees it.)"""
    if _service is None:
        return
    from django.db import connection

    from kvops import services
    try:
        services.heartbeat(_service.name, _service.instance, _service.latest_metrics)
    finally:
        connection.close()
    threading.Thread(target=_heartbeat, args=(_service.name, _service.instance),
                     name="kvops-heartbeat", daemon=True).start()


def _heartbeat(name: str, instance: str) -> None:
    from django.conf import settings
    from django.db import connection

    from kvops import services
    from kvops.routing import reset_pending_load

    while not _stop.wait(settings.KVOPS_HEARTBEAT_S):
        try:
            if _service is not None and _service.alive:
                services.heartbeat(name, instance, _service.latest_metrics)
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
    if _service is None:
        return
    from kvops import services
    try:
        services.mark_engine_stopped(_service.name)
    except Exception as e:
        log.warning("could not mark engine stopped: %s", e)
    _service.stop()
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

    from engine.commands import STATE_COMMANDS
    from kvops.engine_service import EngineError

    started = time.monotonic()
    timeout_s = settings.KVOPS_CONTROL_TIMEOUT_S
    if deadline is not None:
        timeout_s = min(timeout_s, deadline - time.time())
    try:
        if timeout_s <= 0:
            raise TimeoutError("the command arrived after its deadline")
        service = get_engine_service()
        result = service.command(command, dict(arguments or {}), timeout_s=timeout_s)
        if isinstance(result, dict) and command in STATE_COMMANDS:
            # the next heartbeat must carry the new state, not metrics read before it
            service.latest_metrics = {**service.latest_metrics, "state": result["state"]}
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
