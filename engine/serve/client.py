"""A worker's handle on its engine core: one contract (EngineClient), two transports.

The engine core (engine/serve/core_proc.py: CoreServer, the one step loop) runs either in a
process of its own (MPClient, the default: KVOPS_ENGINE_CORE=process) or on a thread of
the worker (InprocClient: KVOPS_ENGINE_CORE=thread, one process less but the worker's
Python work shares the step loop's interpreter lock). Either way the worker talks to it
with the same messages (engine/wire.py) over two ZMQ sockets (ipc:// or inproc://), as
vLLM's EngineCoreClient does with its in-process and multiprocess clients: it sends requests,
stop-string ends, operator commands and questions to the KV view, and hands each step's
outputs to the sink it was given (the output processor) and the KV view's items to
on_kv_item (the publisher).

If the core dies (its process killed, out of memory; its thread raised), every request
it was running fails with the reason and every waiting command is answered with it. A
core process is started again; after MAX_RESTARTS in a row the worker reports itself
dead (`alive` is False, so its heartbeat stops and the reaper moves its jobs elsewhere).
A core that ends because its worker stops (halt(), stop(), or a stop signal to the
worker's process group that reaches the core too) is not replaced; its requests fail only
once the worker has handed their jobs back to the queue (kvops/worker/worker.py). Nothing sent
to a core blocks once it has exited.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

import zmq

from engine import wire
from engine.config import EngineConfig
from engine.errors import EngineError, MalformedMessage, error_from_wire
from engine.serve.core_proc import CORE_NICE, SPIN_COUNT, SPIN_NICE, core_command, \
    may_take_niceness, serve

log = logging.getLogger(__name__)

MAX_RESTARTS = 3  # core deaths in a row before the worker gives up
# A core stopped by one of these while its worker shuts down is not replaced (starting a
# new one then would load a model for nothing and outlive the worker while it loads).
STOP_SIGNALS = {-signal.SIGTERM, -signal.SIGINT, -signal.SIGQUIT}
STOP_GRACE_S = 2.0  # how long after such a death the worker's shutdown may be seen
POLL_MS = 200


class OutputSink(Protocol):
    """Where each step's outputs go (the service's output processor): each a
    wire.StepOutput, read as a CoreOutput is (the same fields, but no Request), as it was
    decoded: no second pass over a step's outputs."""

    def push(self, outputs: list[wire.StepOutput]) -> None: ...

    def fail(self, request_ids: list[str], message: str) -> None: ...


class CoreDied(EngineError):
    """The engine core exited while this was in flight."""


class EngineClient(ABC):
    """The contract, and what both transports share: the messages, the calls waiting
    for their replies, the requests in flight, and the reader thread that dispatches
    the core's messages."""
    address_scheme: str  # "ipc" or "inproc"

    def __init__(self, config: EngineConfig, sink: OutputSink,
                 on_kv_item: Callable[[dict], None] | None = None,
                 startup_timeout_s: float = 900.0) -> None:
        """sink: gets every step's outputs (on the reader thread; it must not block);
        on_kv_item: gets the KV view's items (engine/observe/feed.py), likewise."""
        self.name = config.name
        self.config = config
        self.sink = sink
        self.on_kv_item = on_kv_item
        self.instance = uuid.uuid4().hex  # this worker's run of the engine (Engine.instance)
        self.startup_timeout_s = startup_timeout_s
        self.latest_metrics: dict = {}  # the core's, from its metrics messages
        self.described: dict = {}  # the core's describe_config(), from its ready message
        self._dir = tempfile.mkdtemp(prefix="kvops-core-")
        self._context = zmq.Context()
        self._in_address = f"{self.address_scheme}://{self._dir}/in"
        self._out_address = f"{self.address_scheme}://{self._dir}/out"
        self._to_core = self._context.socket(zmq.PUSH)
        self._to_core.bind(self._in_address)
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.MAXMSGSIZE, wire.MAX_CORE_MESSAGE_BYTES)
        self._from_core.bind(self._out_address)
        self._send_lock = threading.Lock()  # a ZMQ socket is used by one thread at a time
        self._lock = threading.Lock()
        self._calls: dict[int, Future] = {}  # under _lock
        self._in_flight: set[str] = set()  # request ids the core runs; under _lock
        self._ids = itertools.count(1)
        self._ready = threading.Event()
        self._stopping = False
        self._halting = False  # halt() or stop() ends the core: it is not replaced
        self._dead = False  # gave up on the core
        self._reader = threading.Thread(target=self._read, name=f"engine-core-{self.name}",
                                        daemon=True)

    # --- what a transport provides -------------------------------------------------------
    @abstractmethod
    def _launch(self) -> None:
        """Start the core, serving on self._in_address / self._out_address."""

    @abstractmethod
    def _exit_code(self) -> int | None:
        """The core's exit code if it has stopped (negative: a signal), else None."""

    @abstractmethod
    def _await_exit(self, timeout_s: float) -> None:
        """Wait for a core told to shut down (ending it if it does not)."""

    def _replace(self, code: int) -> bool:
        """The core died of `code`: start a new one (True), or give up (False)."""
        return False

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._launch()
        self._reader.start()
        if not self._ready.wait(self.startup_timeout_s):
            raise EngineError(f"engine core {self.name} did not start within "
                              f"{self.startup_timeout_s:.0f} s")
        if self._dead:
            raise EngineError(f"engine core {self.name} could not start (see the log)")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the core down and close the client, within about timeout_s whatever the
        core does: a core that does not exit is ended. A core that died before it was
        told to (e.g. of the stop signal its worker got too) is first said by the reader
        thread, which fails its requests."""
        deadline = time.monotonic() + timeout_s
        self._halting = True  # nothing replaces the core from now on
        if self._exit_code() is not None:
            while (self._reader.is_alive() and not self._dead
                   and time.monotonic() < deadline - timeout_s / 2):
                time.sleep(0.02)
        self._stopping = True
        if self._exit_code() is None:
            self._send_nowait(wire.Shutdown(), max(0.0, deadline - time.monotonic()))
        self._await_exit(max(0.1, deadline - time.monotonic()))
        self._reader.join(max(0.1, deadline - time.monotonic()))
        with self._send_lock_within(1.0) as locked:
            if locked:  # (else a thread is stuck sending to the dead core: leave it be)
                self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        if locked:  # term() waits for every socket to close
            self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def halt(self, timeout_s: float = 2.0) -> None:
        """End the core's work now, without waiting for its requests, as a worker does
        that stops (kvops/worker/worker.py, once it has handed its jobs back): the core is told
        to shut down, and ended if it has not exited within timeout_s. Its requests and
        the calls waiting for it then fail, as when a core dies, and no new core is
        started. stop() still closes the client."""
        self._halting = True
        if self._exit_code() is None:
            self._send_nowait(wire.Shutdown(), timeout_s)
        self._await_exit(timeout_s)

    def _send_nowait(self, message: wire.ToCore, timeout_s: float) -> bool:
        """Send, waiting at most timeout_s in all (for the send lock too) while the core
        lives and cannot take it (stuck, or starting). Whether it was sent."""
        deadline = time.monotonic() + timeout_s
        data = wire.TO_CORE.encode(message)
        while True:
            with self._send_lock_within(max(0.0, deadline - time.monotonic())) as locked:
                if locked:
                    try:
                        self._to_core.send(data, zmq.NOBLOCK)
                        return True
                    except zmq.Again:
                        pass
                    except zmq.ZMQError:  # closed already
                        return False
            if self._exit_code() is not None or time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    @contextlib.contextmanager
    def _send_lock_within(self, timeout_s: float):
        """The send lock if it is free within timeout_s (yields whether it is held): a
        thread waiting to send to a core that is stuck must not hold the client's stop."""
        locked = self._send_lock.acquire(timeout=timeout_s)
        try:
            yield locked
        finally:
            if locked:
                self._send_lock.release()

    @property
    def alive(self) -> bool:
        return self._reader.is_alive() and not self._dead and self._ready.is_set()

    # --- calls from the worker's threads -----------------------------------------------
    def command(self, name: str, arguments: dict, timeout_s: float = 30.0) -> Any:
        """An operator command by name (engine/serve/commands.py), applied between two steps.
        One deadline for both sides: past it the core drops the command."""
        return self._call(wire.Command(0, name, arguments, time.time() + timeout_s), timeout_s)

    def command_async(self, name: str, arguments: dict, timeout_s: float = 30.0) -> Future:
        """command() without waiting: a future of its result, so that several commands
        are in flight at once (a drain's moves, which the core runs side by side). The
        core answers each by its deadline (a move, when its link gives up)."""
        if not self.alive:
            raise EngineError(f"engine {self.name} is not running")
        call_id = next(self._ids)
        future: Future = Future()
        with self._lock:
            self._calls[call_id] = future

        def forget(_: Future) -> None:
            with self._lock:
                self._calls.pop(call_id, None)

        future.add_done_callback(forget)
        self._send(wire.Command(call_id, name, arguments, time.time() + timeout_s))
        return future

    def submit(self, request_id: str, prompt: str | list[int], params: dict,
               priority: int = 0, job_id: str | None = None,
               cache_salt: str | None = None, tenant: str | None = None) -> None:
        """Add a request; raises InvalidRequestError (bad prompt/params) synchronously.
        Its outputs go to the sink."""
        [refusal] = self.submit_many([wire.add_request(request_id, prompt, params, priority,
                                                       job_id, cache_salt, tenant)])
        if refusal is not None:
            raise refusal

    def submit_many(self, items: list[wire.AddRequest]) -> list[EngineError | None]:
        """Add several requests in one message, applied between the same two steps
        (items: wire.add_request's). Per item None (added) or the error that refused it.
        Their outputs go to the sink."""
        ids = [item.request_id for item in items]
        with self._lock:
            self._in_flight.update(ids)
        try:
            replies = self._call(wire.Adds(0, items), 60.0)
        except BaseException:
            with self._lock:
                self._in_flight.difference_update(ids)
            raise
        refusals = [None if r is None else error_from_wire(r.type, r.message) for r in replies]
        with self._lock:
            self._in_flight.difference_update(i for i, e in zip(ids, refusals) if e is not None)
        return refusals

    def abort_quietly(self, request_id: str) -> None:
        """Abort a request that may have ended meanwhile, or never been added: that it is
        gone is all the caller needs."""
        try:
            self.command("abort", {"request_id": request_id})
        except Exception:  # noqa: BLE001  (it ended on its own, or the core did)
            pass

    def finish_request(self, request_id: str) -> None:
        """End a request whose text reached a stop string (does not wait)."""
        try:
            self._send(wire.Stop(request_id))
        except CoreDied:  # the request ended with its core
            pass

    def describe_config(self) -> dict:
        return dict(self.described)

    def ask_kv(self, kind: str, argument: Any, timeout_s: float) -> Any:
        """A question to the core's KV view (see KVFeed.ask)."""
        return self._call(wire.KVAsk(0, kind, argument), timeout_s)

    def _call(self, message: wire.Adds | wire.Command | wire.KVAsk, timeout_s: float) -> Any:
        """Send a call (its call_id is set here) and wait for its answer."""
        if not self.alive:
            raise EngineError(f"engine {self.name} is not running")
        call_id = next(self._ids)
        message.call_id = call_id
        future: Future = Future()
        with self._lock:
            self._calls[call_id] = future
        self._send(message)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"engine {self.name} did not answer within {timeout_s:g} s") \
                from None
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    def _send(self, message: wire.ToCore) -> None:
        """Send to the core, waiting while it cannot take the message (starting, or
        behind); CoreDied once it has exited: a PUSH socket with no peer would wait for
        one forever, and a thread stuck here (the output processor, stopping a request
        of a core that died) would hold the worker's stop. MalformedMessage (typed) for a
        message the core would refuse (over its size limit)."""
        data = wire.TO_CORE.encode(message)
        with self._send_lock:
            while True:
                try:
                    self._to_core.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    if self._exit_code() is not None:
                        raise CoreDied(f"the engine core of {self.name} is not running") \
                            from None
                    self._to_core.poll(POLL_MS, zmq.POLLOUT)

    # --- the reader thread ---------------------------------------------------------------
    def _read(self) -> None:
        while not self._stopping:
            if self._from_core.poll(POLL_MS):
                self._receive(self._from_core.recv())
                continue
            code = self._exit_code()
            if code is not None and not self._stopping:
                self._core_died(code)
                if self._dead:
                    return

    def _receive(self, data: bytes) -> None:
        """Decode (checked whole) and dispatch one message of the core's; one not of the
        protocol is said in the log, and fails its call if it names one."""
        try:
            message = wire.FROM_CORE.decode(data)
        except MalformedMessage as e:
            log.error("engine core %s: %s", self.name, e)
            head = wire.FROM_CORE.head(data, 2)
            if head is not None and head[0] in (wire.Kind.REPLY, wire.Kind.ADDED) and \
                    type(head[1]) is int:
                self._answer(head[1], error=e)
            return
        self._dispatch(message)

    def _answer(self, call_id: int, result: Any = None, error: EngineError | None = None) -> None:
        with self._lock:
            future = self._calls.get(call_id)
        if future is not None and not future.done():
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def _dispatch(self, message: wire.FromCore) -> None:
        if isinstance(message, wire.Outputs):
            outputs = message.outputs
            ended = [o.request_id for o in outputs if o.finished]
            # A forked request's samples ("<id>/<i>") stand for it from their first
            # output on: they are what a dead core leaves to fail.
            samples = [o.request_id for o in outputs if "/" in o.request_id
                       and not o.finished and o.request_id not in self._in_flight]
            # A request that moved here from another engine is this core's from now on.
            moved_in = [o.request_id for o in outputs if o.migration and not o.finished
                        and "from" in o.migration]
            if moved_in:
                with self._lock:
                    self._in_flight.update(moved_in)
            if samples:
                with self._lock:
                    self._in_flight.update(samples)
                    self._in_flight.difference_update(s.rsplit("/", 1)[0] for s in samples)
            if ended:
                with self._lock:
                    self._in_flight.difference_update(ended)
                    self._in_flight.difference_update(e.rsplit("/", 1)[0] for e in ended
                                                      if "/" in e)
            self.sink.push(outputs)
        elif isinstance(message, wire.Reply):
            error = message.error
            self._answer(message.call_id, message.result,
                         None if error is None else error_from_wire(error.type, error.message))
        elif isinstance(message, wire.Added):
            self._answer(message.call_id, message.refusals)
        elif isinstance(message, wire.Metrics):
            self.latest_metrics = message.metrics
        elif isinstance(message, wire.KVItem):
            if self.on_kv_item is not None:
                self.on_kv_item(message.item)
        elif isinstance(message, wire.StepFailed):
            with self._lock:
                self._in_flight.difference_update(message.request_ids)
            self.sink.fail(message.request_ids, message.message)
        elif isinstance(message, wire.Ready):
            self.described, self.latest_metrics = message.config, message.metrics
            self._ready.set()
            log.info("engine core %s ready (%s)", self.name, self._where())

    def _where(self) -> str:
        return "on a thread of the worker"

    def _core_died(self, code: int) -> None:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        reason = f"the engine core of {self.name} stopped ({how})"
        (log.info if self._halting else log.error)("%s", reason)
        self._ready.clear()
        # Decided before its requests fail: a worker that stops hands their jobs back
        # first (see MPClient's worker_stopping), and then nothing replaces the core.
        with_worker = self._halting or self._stopping or self._stops_with_worker(code)
        with self._lock:
            calls, self._calls = dict(self._calls), {}
            lost, self._in_flight = sorted(self._in_flight), set()
        for future in calls.values():
            if not future.done():
                future.set_exception(CoreDied(reason))
        if lost:
            self.sink.fail(lost, reason)
        if with_worker:
            log.info("engine core %s stopped with its worker: not replaced", self.name)
        if with_worker or not self._replace(code):
            self._dead = True
            self._ready.set()  # wakes start() if it is still waiting

    def _stops_with_worker(self, code: int) -> bool:
        """Whether the core died of `code` because its worker is stopping (then it is
        not replaced)."""
        return False


class MPClient(EngineClient):
    """The core in a process of its own (`python -m engine.serve.core_proc`), started again
    when it dies, MAX_RESTARTS times in a row at most."""
    address_scheme = "ipc"

    def __init__(self, config: EngineConfig, sink: OutputSink,
                 on_kv_item: Callable[[dict], None] | None = None,
                 startup_timeout_s: float = 900.0,
                 worker_stopping: Callable[[], bool] = lambda: False,
                 core_nice: int = CORE_NICE, log_level: str = "INFO") -> None:
        super().__init__(config, sink, on_kv_item, startup_timeout_s)
        # True once the worker is shutting down: a core that dies of a stop signal then
        # is not replaced. Asked before that core's requests fail, so the worker may
        # hand their jobs back to the queue before it answers True.
        self.worker_stopping = worker_stopping
        self.core_nice, self.log_level = core_nice, log_level
        self.restarts = 0  # core deaths in a row
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _launch(self) -> None:
        log.info("engine core %s: starting its process", self.name)
        self._ready.clear()
        argv, stdin = core_command(
            self.config, self._in_address, self._out_address, "--nice", str(self.core_nice),
            "--log-level", self.log_level,
            *([] if self.on_kv_item is not None else ["--no-kv-view"]))
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                      env=core_environment(os.environ, self.core_nice))
        self._proc.stdin.write(stdin)
        self._proc.stdin.close()

    def _exit_code(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def _await_exit(self, timeout_s: float) -> None:
        if self._proc is not None:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("engine core %s did not exit within %.1f s: killing it",
                            self.name, timeout_s)
                self._proc.kill()
                try:
                    self._proc.wait(5)
                except subprocess.TimeoutExpired:  # (uninterruptible, in the kernel)
                    log.error("engine core %s (pid %s) did not die", self.name, self.pid)

    def _dispatch(self, message: wire.FromCore) -> None:
        if isinstance(message, wire.Ready):
            self.restarts = 0
        super()._dispatch(message)

    def _where(self) -> str:
        return f"pid {self.pid}"

    def _stops_with_worker(self, code: int) -> bool:
        return code in STOP_SIGNALS and self._stopped_with_worker()

    def _replace(self, code: int) -> bool:
        if self._stopping or self._halting:  # (stop() came while the death was said)
            return False
        self.restarts += 1
        if self.restarts > MAX_RESTARTS:
            log.error("engine core %s died %d times in a row: the worker reports itself dead",
                      self.name, self.restarts)
            return False
        self._launch()
        return True

    def _stopped_with_worker(self) -> bool:
        """Whether the signal that stopped the core came to the worker too, as `make
        run`'s Ctrl-C, `docker stop` and systemd send it to the whole process group. The
        worker may handle it a moment after the core died of it."""
        deadline = time.monotonic() + STOP_GRACE_S
        while not self.worker_stopping():
            if self._stopping or self._halting:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True


class InprocClient(EngineClient):
    """The core on a thread of this process, over inproc:// sockets: the same loop and
    messages as a core process, without a process."""
    address_scheme = "inproc"

    def __init__(self, config: EngineConfig, sink: OutputSink,
                 on_kv_item: Callable[[dict], None] | None = None,
                 startup_timeout_s: float = 900.0) -> None:
        super().__init__(config, sink, on_kv_item, startup_timeout_s)
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def _launch(self) -> None:
        self._thread = threading.Thread(target=self._serve, name=f"engine-{self.name}",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            serve(self.config, self._in_address, self._out_address, context=self._context,
                  kv_view=self.on_kv_item is not None)
        except BaseException as e:  # said as the core's death by the reader thread
            log.exception("engine core %s failed", self.name)
            self._failure = e

    def _exit_code(self) -> int | None:
        if self._thread is None or self._thread.is_alive():
            return None
        return 1 if self._failure is not None else 0

    def _await_exit(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)


def make_engine_client(mode: str, config: EngineConfig, sink: OutputSink,
                       on_kv_item: Callable[[dict], None] | None = None,
                       worker_stopping: Callable[[], bool] = lambda: False,
                       core_nice: int = CORE_NICE, log_level: str = "INFO") -> EngineClient:
    """The client for KVOPS_ENGINE_CORE's `mode`: `process` (its niceness `core_nice`)
    or `thread`."""
    if mode == "process":
        return MPClient(config, sink, on_kv_item, worker_stopping=worker_stopping,
                        core_nice=core_nice, log_level=log_level)
    if mode == "thread":
        return InprocClient(config, sink, on_kv_item)
    raise ValueError(f"KVOPS_ENGINE_CORE={mode!r}: use `thread` or `process`")


def core_environment(environ, nice: int = CORE_NICE) -> dict[str, str]:
    """The core process's environment: the worker's, with the wait of the OpenMP threads
    (torch's CPU threads, libgomp) chosen unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is
    set. A core that will run (at niceness `nice`) at SPIN_NICE or lower (engine.core_proc) spins briefly at a
    barrier (GOMP_SPINCOUNT=SPIN_COUNT) and sleeps after that: it outranks the service's
    processes, and a step on the CPU runs about a fifth faster (on 2 cores the service
    delivers 9-25% more tokens a second, docs/history/streaming.md). Any other core sleeps at once
    (OMP_WAIT_POLICY=PASSIVE): at equal rank a spinning thread holds the CPU that the
    service, or the other thread's work, needs."""
    env = dict(environ)
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return env
    if nice <= SPIN_NICE and may_take_niceness(nice):
        env["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    else:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env
