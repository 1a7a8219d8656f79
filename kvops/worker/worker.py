"""Engine worker bootstrap: one engine per Celery worker process.

A worker started with KVOPS_ENGINE_WORKER=1 starts its engine when Celery initialises
(configuration from KVOPS_ENGINE_* variables): its client (engine/serve/client.py) runs
the engine core in a process of its own by default, or on a thread
(KVOPS_ENGINE_CORE=thread), with the output processor and the live KV view's publisher
as its sinks. It registers an Engine row, beats its heart, and answers the
`kvops_engine` control command.
Start one with `python manage.py engine_worker --name NAME`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from celery import signals
from celery.worker.control import control_command

from engine import EngineError
from kvops.engines.engine_claim import EngineClaim, EngineNameTaken
from kvops.jobs.group_commit import GroupCommit

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerContext:
    """What an engine worker process holds: its engine client, the output processor that
    streams and stores its jobs' progress, its deployment's stack id, its hold on the
    engine's name, and the batcher that claims jobs delivered together in one
    transaction. Made once, at the worker's start (or by a test, for an engine in its own
    process), and reached through `context()`."""
    client: Any  # an EngineClient (engine/serve/client.py)
    processor: Any  # its OutputProcessor
    stack_id: str  # its deployment's (kvops/engines/stack_id.py): others' commands are ignored
    name_claim: EngineClaim | None = None  # None: a test's engine, its name not claimed
    claim: GroupCommit = dataclasses.field(
        default_factory=lambda: GroupCommit(_claim_jobs))

    def close(self) -> None:
        self.client.stop()
        self.processor.close()
        if self.name_claim is not None:  # (after the engine: no two run under one name)
            self.name_claim.release()


def _claim_jobs(claims):
    from kvops.jobs import job_store
    if _shutting_down.is_set():  # (see _refuse)
        _refuse(claims)
        return [None] * len(claims)
    jobs = job_store.claim_jobs(claims)
    if _shutting_down.is_set() and any(job is not None for job in jobs):
        # The stop came while they were claimed: back to the queue with the others.
        _requeue([job.pk for job in jobs if job is not None], claims[0].engine)
        return [None] * len(jobs)
    return jobs


_context: WorkerContext | None = None
_stop = threading.Event()  # heartbeats stop
_shutting_down = threading.Event()  # the worker got its stop signal (warm or cold)

# A worker told to stop (SIGTERM, SIGINT, SIGQUIT: each a warm shutdown, see
# _install_stop_signals) does not wait for its jobs, which may run for minutes while Celery's warm shutdown waits for
# their tasks. It hands them back to the queue at once (_hand_back: they run again from
# their prompt on the next engine, as the reaper moves the jobs of a killed worker, only
# sooner) and ends its core's work (EngineClient.halt), so their tasks return and the
# warm shutdown completes within a second or two. A worker still running STOP_DEADLINE_S
# after the signal (a thread stuck, on the database say) exits there and then, as if
# killed: the reaper moves whatever it left.
STOP_DEADLINE_S = 6.0
_handed_back = threading.Event()
_hand_back_lock = threading.Lock()
_stopping_context: WorkerContext | None = None  # the context the stop signal found
_heartbeat_thread: threading.Thread | None = None
_refused: set[tuple[int, str]] = set()  # (job id, task id) delivered while stopping
_refused_lock = threading.Lock()


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

    from kvops.engines.engine_config import config_from_env, engine_secret
    from kvops.engines.stack_id import stack_id

    # the share of a batch one user may hold: the service-wide one unless set per engine;
    # the deployment's secret (engine/keys.py), derived from SECRET_KEY
    config = config_from_env(os.environ, {"max_batch_share": settings.KVOPS_MAX_BATCH_SHARE,
                                          "secret": engine_secret(settings.SECRET_KEY)})
    mode = settings.KVOPS_ENGINE_CORE
    log.info("starting engine %s (core: %s)", config.name, mode)
    hostname = getattr(sender, "hostname", None) or f"engine-{config.name}@{socket.gethostname()}"
    stack = stack_id()
    name_claim = _claim_name(config.name, stack, hostname)
    try:
        _start_engine_as(config, mode, stack, hostname, name_claim)
    except BaseException:  # (refused or failed: the name is free for whoever comes next)
        name_claim.release()
        raise


def _claim_name(name: str, stack: str, hostname: str) -> EngineClaim:
    """This worker's hold on its engine's name, before its engine starts; SystemExit,
    naming both, if a live worker of another deployment holds it (kvops/engines/engine_claim.py)."""
    from django.conf import settings

    from kvops import live
    name_claim = EngineClaim(live.redis_client(), name, stack, socket.gethostname(), hostname,
                             ttl_s=settings.KVOPS_ENGINE_DEAD_AFTER_S,
                             renew_s=settings.KVOPS_HEARTBEAT_S)
    try:
        name_claim.take()
    except EngineNameTaken as e:
        log.error("refused: %s", e)
        raise SystemExit(f"engine worker refused: {e}") from None
    log.info("engine name %s claimed for stack %s", name, stack)
    return name_claim


def _start_engine_as(config, mode: str, stack: str, hostname: str,
                     name_claim: EngineClaim) -> None:
    from django.conf import settings

    from kvops import live
    from kvops.engines import registry
    from kvops.jobs.reaper import reap
    from engine.serve.client import make_engine_client
    from kvops.stream.job_stream import StreamProducer
    from kvops.operators.moves import watch_moved_in
    from kvops.worker.output_processor import OutputProcessor
    from kvops.routing.prefix_index import PrefixIndex
    from kvops.intake.prompts import tokenizer_for
    from kvops.worker.publisher import EnginePublisher

    tokenizer = tokenizer_for(config)
    if tokenizer is None:
        raise SystemExit(f"engine {config.name}: its tokenizer is not readable from the worker "
                         f"({config.model})")
    # The processor and the publisher reach the client through these closures: none is
    # called before the client has started.
    processor = OutputProcessor(config.name, StreamProducer(live.redis_client(), config.name),
                                tokenizer, lambda request_id: client.finish_request(request_id),
                                on_adopt=lambda job, handle: watch_moved_in(
                                    client, processor, job, handle))
    try:
        client = make_engine_client(mode, config, processor,
                                    on_kv_item=lambda item: publisher.on_item(item),
                                    worker_stopping=_worker_stopping,
                                    **_core_process_settings(settings))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    processor.instance = client.instance
    publisher = EnginePublisher(config.name, source=client,
                                prefix_index=PrefixIndex(config.name, client))
    client.start()
    install(WorkerContext(client, processor, stack, name_claim))
    registry.register_engine(config.name, hostname, socket.gethostname(), client.instance,
                             client.describe_config(), stack)
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
    global _heartbeat_thread
    if _context is None or _shutting_down.is_set():
        return
    from django.db import connection

    from kvops.engines import registry
    client = _context.client
    try:
        registry.heartbeat(client.name, client.instance, client.latest_metrics)
    finally:
        connection.close()
    _heartbeat_thread = threading.Thread(target=_heartbeat, args=(client,),
                                         name="kvops-heartbeat", daemon=True)
    _heartbeat_thread.start()
    _install_stop_signals(getattr(sender, "hostname", None))


def _beat_now(client) -> None:
    from django.db import connection

    from kvops.engines import registry
    if _stop.is_set():  # stopping: the row says so, and stays so
        return
    try:
        registry.heartbeat(client.name, client.instance, client.latest_metrics)
    except Exception as e:  # the next beat says it
        log.warning("heartbeat after a state command failed: %s", e)
    finally:
        connection.close()


def _heartbeat(client) -> None:
    from django.conf import settings
    from django.db import connection

    from kvops.engines import registry
    from kvops.routing.routing import reset_pending_load

    while not _stop.wait(settings.KVOPS_HEARTBEAT_S):
        try:
            if client.alive:
                registry.heartbeat(client.name, client.instance, client.latest_metrics)
                reset_pending_load(client.name)
        except Exception as e:  # database briefly away: try again next beat
            log.warning("heartbeat failed: %s", e)
        finally:
            connection.close()


def _install_stop_signals(hostname: str | None) -> None:
    """SIGTERM, SIGINT and SIGQUIT, once or again, each make Celery's warm shutdown (on
    Celery's handlers, installed by now: the consumer is up). The stop hands the jobs
    back at once, so a warm shutdown takes a second or two; Celery's cold one (its
    SIGQUIT, its second SIGINT) cannot cancel a threads pool's tasks (NotImplementedError
    in the signal handler) and then waits for them, minutes for a long job."""
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            signal.signal(sig, functools.partial(_on_stop_signal, hostname))
    except ValueError:  # not the main thread: Celery's handlers stay
        log.warning("the stop signals keep Celery's handlers")


def _on_stop_signal(hostname: str | None, signum: int, frame) -> None:
    """Celery's warm shutdown, as its own SIGTERM handler starts it."""
    from celery.platforms import EX_FAILURE, EX_OK
    from celery.worker import state
    if state.should_stop is not None:  # (a signal again: the stop goes on)
        return
    exitcode = EX_OK if signum == signal.SIGTERM else EX_FAILURE
    try:
        print(f"worker: Warm shutdown (MainProcess) on {signal.Signals(signum).name}",
              file=sys.__stdout__, flush=True)
        signals.worker_shutting_down.send(sender=hostname, sig=signal.Signals(signum).name,
                                          how="Warm", exitcode=exitcode)
    finally:
        state.should_stop = exitcode


@signals.worker_shutting_down.connect
def _note_shutting_down(sig=None, how=None, **kwargs) -> None:
    """The stop signal (Celery's handler, on the main thread): hand the jobs back and end
    the core's work on a thread of its own; a later signal changes nothing."""
    global _stopping_context
    if _shutting_down.is_set():
        return
    _shutting_down.set()
    ctx = _stopping_context = _context
    if ctx is None:  # not an engine worker
        return
    log.warning("%s: stopping (%s shutdown); running jobs go back to the queue", sig, how)
    threading.Thread(target=_exit_by, args=(time.monotonic() + STOP_DEADLINE_S, ctx.client),
                     name="kvops-stop-deadline", daemon=True).start()
    threading.Thread(target=_stop_now, args=(ctx,), name="kvops-stop", daemon=True).start()


def _stop_now(ctx: WorkerContext) -> None:
    _hand_back(ctx.client)
    try:
        ctx.client.halt()  # its requests fail now (their jobs are queued): the tasks return
    except Exception:  # (the deadline ends it)
        log.exception("stopping: ending the engine core failed")


def _worker_stopping() -> bool:
    """For the engine client (worker_stopping): whether this worker is stopping; once it
    is, its jobs have been handed back by the time this answers True."""
    if not _shutting_down.is_set():
        return False
    ctx = _stopping_context
    if ctx is not None:
        _hand_back(ctx.client)
    return True


def _hand_back(client) -> None:
    """Once: mark the engine stopped (no job is routed to it, and its instance is no
    longer live) and requeue every job running on it, to run again from its prompt on the
    next engine. From then on its engine requests' ends, failures and progress are
    ignored (they are written only while their attempt owns the job), so whatever the
    core and the tasks do next loses nothing. Should the database be away, the jobs stay
    `running` on an instance that no longer beats, and the reaper moves them."""
    with _hand_back_lock:
        if _handed_back.is_set():
            return
        from django.db import connection

        from kvops.engines import registry
        from kvops.models import Job
        _stop.set()  # a heartbeat would mark the engine ready again
        beating = _heartbeat_thread
        if beating is not None and beating is not threading.current_thread():
            beating.join(1.0)  # (one under way)
        try:
            registry.mark_engine_stopped(client.name, client.instance)
            running = list(Job.objects.filter(status=Job.Status.RUNNING,
                                              engine_instance=client.instance)
                           .values_list("pk", flat=True))
            if running:
                log.warning("stopping: handing jobs %s back to the queue", running)
            _requeue(running, client.name)
        except Exception as e:  # noqa: BLE001  (the database away)
            log.warning("stopping: could not hand the running jobs back (%s); the reaper "
                        "moves them", e)
        finally:
            connection.close()
            _handed_back.set()


def _requeue(job_ids: list[int], engine: str) -> None:
    from kvops.jobs.job_store import requeue_job
    for job_id in job_ids:
        try:
            requeue_job(job_id, f"engine {engine} stopped while running it")
        except Exception as e:  # noqa: BLE001  (the reaper moves it)
            log.warning("stopping: could not requeue job %s: %s", job_id, e)


def _refuse(claims) -> None:
    """Deliveries that reach the worker after its stop signal (Celery's consumer takes a
    moment to stop, and the jobs handed back may come straight back to it) are not run:
    their tasks end, and once the consumer has stopped the jobs are sent again
    (_send_again), for the next worker."""
    with _refused_lock:
        _refused.update((c.job_id, c.task_id) for c in claims)
    log.info("stopping: jobs %s are sent again once the worker takes no more",
             [c.job_id for c in claims])


def _send_again() -> None:
    """Send anew (routed again, under a new task id) the jobs whose delivery the worker
    refused as it stopped, unless they moved on meanwhile (ended, claimed, sent again)."""
    with _refused_lock:
        refused = sorted(_refused)
        _refused.clear()
    if not refused:
        return
    from django.db import connection

    from kvops.models import Job
    from kvops.jobs.outbox import dispatch_job
    try:
        for job_id, task_id in refused:
            if Job.objects.filter(pk=job_id, status=Job.Status.QUEUED,
                                  celery_task_id=task_id).exists():
                dispatch_job(job_id)
    except Exception as e:  # noqa: BLE001  (queued still: the reaper's outbox pass sends
        # them again, KVOPS_RESEND_AFTER_S after their last send)
        log.warning("stopping: could not send jobs %s again: %s", refused, e)
    finally:
        connection.close()


def _exit_by(deadline: float, client) -> None:
    """The stop's bound: a worker still here at the deadline exits at once, its core
    with it (what the stop handed back is safe; what it did not, the reaper moves)."""
    time.sleep(max(0.0, deadline - time.monotonic()))
    log.error("the worker did not stop within %.0f s of its stop signal: exiting now",
              STOP_DEADLINE_S)
    pid = getattr(client, "pid", None)  # a core process (MPClient)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110  (exiting all the same)
            pass
    os._exit(1)


@signals.worker_shutdown.connect
def _stop_engine(**kwargs) -> None:
    _stop.set()
    ctx = install(None)
    if ctx is None:
        return
    _hand_back(ctx.client)  # (already done if a signal stopped the worker)
    _send_again()  # (Celery's consumer has stopped: they cannot come back here)
    ctx.close()


DRAIN_MODES = ("wait", "migrate", "abort")


def _drain(client, arguments: dict, timeout_s: float) -> dict:
    """Drain the engine: take no new jobs, and let its requests finish here (`wait`),
    move them to other engines (`migrate`, to `to` or the router's choice), or end them
    (`abort`: their jobs end as cancelled)."""
    from engine.errors import InvalidRequestError
    from kvops.operators import moves
    mode = arguments.get("mode") or "wait"
    if mode not in DRAIN_MODES:
        raise InvalidRequestError(f"mode must be one of {', '.join(DRAIN_MODES)}")
    targets = moves.drain_targets(client.name, arguments.get("to")) \
        if mode == "migrate" else []  # (refused before the engine drains)
    result = client.command("drain", {}, timeout_s=timeout_s)
    result["mode"] = mode
    if mode == "migrate":
        moves.start_drain(client, targets)
        result["to"] = targets
    elif mode == "abort":
        live = client.command("live-requests", {}, timeout_s=timeout_s)
        aborted = []
        for rid in [*live["running"], *live["waiting"], *live["moving"]]:
            try:
                client.command("abort", {"request_id": rid, "by": arguments.get("by")},
                               timeout_s=timeout_s)
                aborted.append(rid)
            except EngineError:  # (it ended meanwhile)
                pass
        result["aborted"] = aborted
    return result


@control_command(args=[("command", str), ("arguments", dict), ("deadline", float),
                       ("stack", str)],
                 signature="<command> [arguments] [deadline] [stack]")
def kvops_engine(state, command: str, arguments: dict | None = None,
                 deadline: float | None = None, stack: str | None = None) -> dict | None:
    """Apply an operator command to this worker's engine between two steps. `deadline`
    (Unix time) is when the web stops waiting for the answer: a command the engine has
    not reached by then is dropped, never applied late. `stack` is the sender's stack id
    (kvops/engines/stack_id.py): a command of another deployment on the same Redis database, or
    of none, is ignored and answered None, which its sender reports as no answer (a 504,
    as for an engine that is not there): a refusal would tell the other deployment that
    an engine of this name runs here under another stack, and its answer could shadow the
    one its own engine (same Celery name) gives."""
    from django.conf import settings

    from engine import EngineError
    from engine.serve.commands import STATE_COMMANDS

    own_stack = _context.stack_id if _context is not None else None
    if stack is None or stack != own_stack:
        log.warning("ignored control command %r from stack %r: this engine worker is of "
                    "stack %r", command, stack, own_stack)
        return None
    started = time.monotonic()
    timeout_s = settings.KVOPS_CONTROL_TIMEOUT_S
    if deadline is not None:
        timeout_s = min(timeout_s, deadline - time.time())
    try:
        if timeout_s <= 0:
            raise TimeoutError("the command arrived after its deadline")
        client = context().client
        arguments = dict(arguments or {})
        if command == "migrate":  # the destination's address, from the registry
            from kvops.operators import moves
            result = moves.migrate(client, arguments.get("request_id"),
                                       arguments.get("to"), bool(arguments.get("staged", True)),
                                       timeout_s)
        elif command == "drain":
            result = _drain(client, arguments, timeout_s)
        else:
            result = client.command(command, arguments, timeout_s=timeout_s)
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
