"""The worker's side of an engine core process (engine/core_proc.py): it starts the
process, sends it requests, stop-string ends and operator commands, and hands each
step's outputs to the output processor, like EngineService does for an engine on a
thread of the worker.

If the core process dies (killed, out of memory), every request it was running fails
with the reason, every waiting command is answered with it, and a new core is started;
after MAX_RESTARTS in a row the worker reports itself dead (`alive` is False, so its
heartbeat stops and the reaper moves its jobs elsewhere).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import zmq

from engine import EngineConfig, EngineError
from engine.errors import error_from_wire
from engine.core_proc import SPIN_COUNT, SPIN_NICE, core_nice, may_take_niceness, pack, unpack
from engine.outputs import CoreOutput
from kvops.engine_service import OutputSink
from kvops.prompts import load_tokenizer, render_chat

log = logging.getLogger(__name__)

MAX_RESTARTS = 3  # core deaths in a row before the worker gives up
# A core stopped by one of these while its worker shuts down is not replaced (starting a
# new one then would load a model for nothing and outlive the worker while it loads).
STOP_SIGNALS = {-signal.SIGTERM, -signal.SIGINT, -signal.SIGQUIT}
STOP_GRACE_S = 2.0  # how long after such a death the worker's shutdown may be seen
POLL_MS = 200


class CoreDied(EngineError):
    """The engine core process exited while this was in flight."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig, sink: OutputSink | None = None,
                 startup_timeout_s: float = 900.0,
                 worker_stopping: Callable[[], bool] = lambda: False) -> None:
        self.name = config.name
        # True once the worker is shutting down: a core that dies then is not replaced
        self.worker_stopping = worker_stopping
        self.config = config
        self.instance = ""  # set by the worker when it registers (Engine.instance)
        self.sink = sink  # gets every step's outputs
        self.on_kv_item: Callable[[dict], None] | None = None  # gets the KV view's items
        self.startup_timeout_s = startup_timeout_s
        self.latest_metrics: dict = {}  # refreshed from the core's metrics messages
        self.described: dict = {}  # the core's describe_config(), from its ready message
        self.tokenizer = None  # loaded here from the described model, for chat templates
        self.restarts = 0  # core deaths in a row
        self._dir = tempfile.mkdtemp(prefix="kvops-core-")
        self._context = zmq.Context()
        self._to_core = self._context.socket(zmq.PUSH)
        self._to_core.bind(f"ipc://{self._dir}/in")
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.bind(f"ipc://{self._dir}/out")
        self._send_lock = threading.Lock()  # a ZMQ socket is used by one thread at a time
        self._lock = threading.Lock()
        self._calls: dict[int, Future] = {}  # under _lock
        self._in_flight: set[str] = set()  # request ids the core runs; under _lock
        self._ids = itertools.count(1)
        self._ready = threading.Event()
        self._stopping = False
        self._dead = False  # gave up restarting
        self._proc: subprocess.Popen | None = None
        self._reader = threading.Thread(target=self._read, name=f"engine-core-{self.name}",
                                        daemon=True)

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._spawn()
        self._reader.start()
        if not self._ready.wait(self.startup_timeout_s):
            raise EngineError(f"engine core {self.name} did not start within "
                              f"{self.startup_timeout_s:.0f} s")
        if self._dead:
            raise EngineError(f"engine core {self.name} could not start (see the log)")

    def _spawn(self) -> None:
        log.info("engine core %s: starting its process", self.name)
        self._ready.clear()
        fields = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)}
        self._proc = subprocess.Popen([
            sys.executable, "-m", "engine.core_proc", "--config", json.dumps(fields),
            "--input", f"ipc://{self._dir}/in", "--output", f"ipc://{self._dir}/out"],
            env=core_environment(os.environ))

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._send(["shutdown"])
        if self._proc is not None:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._reader.join(timeout_s)
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self._reader.is_alive() and not self._dead and self._ready.is_set()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # --- calls from the worker's threads -----------------------------------------------
    def command(self, name: str, arguments: dict, timeout_s: float = 30.0) -> Any:
        """An operator command by name (engine/commands.py), applied between two steps.
        One deadline for both sides: past it the core drops the command."""
        return self._call(["cmd", None, name, arguments, time.time() + timeout_s], timeout_s)

    def submit(self, request_id: str, prompt: str | list[int], params: dict,
               priority: int = 0, job_id: str | None = None,
               cache_salt: str | None = None, tenant: str | None = None) -> None:
        """Add a request; raises InvalidRequestError (bad prompt/params) synchronously.
        Its outputs go to the sink."""
        [refusal] = self.submit_many([[request_id, prompt, params, priority, job_id,
                                       cache_salt, tenant]])
        if refusal is not None:
            raise refusal

    def submit_many(self, items: list[list]) -> list[EngineError | None]:
        """Add several requests in one message, applied between the same two steps:
        items as engine.commands.add_requests takes them. Per item None (added) or the
        error that refused it. Their outputs go to the sink."""
        ids = [item[0] for item in items]
        with self._lock:
            self._in_flight.update(ids)
        try:
            replies = self._call(["adds", None, [list(item) for item in items]], 60.0)
        except BaseException:
            with self._lock:
                self._in_flight.difference_update(ids)
            raise
        refusals = [None if r is None else error_from_wire(*r) for r in replies]
        with self._lock:
            self._in_flight.difference_update(i for i, e in zip(ids, refusals) if e is not None)
        return refusals

    def finish_request(self, request_id: str) -> None:
        """End a request whose text reached a stop string (does not wait)."""
        self._send(["stop", request_id])

    def describe_config(self) -> dict:
        return dict(self.described)

    def attach_kv_view(self, on_item: Callable[[dict], None]) -> None:
        """Hand the core's live KV view (engine/kv_feed.py) to on_item, on the reader
        thread (on_item must not block)."""
        self.on_kv_item = on_item

    def ask_kv(self, kind: str, argument: Any, timeout_s: float) -> Any:
        """A question to the core's KV view (see KVFeed.ask)."""
        return self._call(["kvask", None, kind, argument], timeout_s)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return render_chat(self.tokenizer, messages, tools)

    def _call(self, message: list, timeout_s: float) -> Any:
        if not self.alive:
            raise EngineError(f"engine {self.name} is not running")
        call_id = next(self._ids)
        message[1] = call_id
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

    def _send(self, message: list) -> None:
        with self._send_lock:
            self._to_core.send(pack(message))

    def _stopped_with_worker(self) -> bool:
        """Whether the signal that stopped the core came to the worker too, as `make
        run`'s Ctrl-C, `docker stop` and systemd send it to the whole process group. The
        worker may handle it a moment after the core died of it."""
        deadline = time.monotonic() + STOP_GRACE_S
        while not self.worker_stopping():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    # --- the reader thread ---------------------------------------------------------------
    def _read(self) -> None:
        while not self._stopping:
            if self._from_core.poll(POLL_MS):
                self._dispatch(unpack(self._from_core.recv()))
                continue
            code = self._proc.poll() if self._proc is not None else None
            if code is not None and not self._stopping:
                self._core_died(code)
                if self._dead:
                    return

    def _dispatch(self, message: list) -> None:
        kind = message[0]
        if kind == "out":
            outputs = [CoreOutput.from_wire(row) for row in message[1]]
            ended = [o.request_id for o in outputs if o.finished]
            # A forked request's samples ("<id>/<i>") stand for it from their first
            # output on: they are what a dead core leaves to fail.
            samples = [o.request_id for o in outputs if "/" in o.request_id
                       and not o.finished and o.request_id not in self._in_flight]
            if samples:
                with self._lock:
                    self._in_flight.update(samples)
                    self._in_flight.difference_update(s.rsplit("/", 1)[0] for s in samples)
            if ended:
                with self._lock:
                    self._in_flight.difference_update(ended)
                    self._in_flight.difference_update(e.rsplit("/", 1)[0] for e in ended
                                                      if "/" in e)
            if self.sink is not None:
                self.sink.push(outputs)
        elif kind == "reply":
            _, call_id, ok, result = message
            with self._lock:
                future = self._calls.get(call_id)
            if future is not None and not future.done():
                if ok:
                    future.set_result(result)
                else:
                    future.set_exception(error_from_wire(*result))
        elif kind == "metrics":
            self.latest_metrics = message[1]
        elif kind == "kv":
            if self.on_kv_item is not None:
                self.on_kv_item(message[1])
        elif kind == "failed":
            _, request_ids, reason = message
            with self._lock:
                self._in_flight.difference_update(request_ids)
            if self.sink is not None:
                self.sink.fail(request_ids, reason)
        elif kind == "ready":
            self.described, self.latest_metrics = message[1], message[2]
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(self.described)
            self.restarts = 0
            self._ready.set()
            log.info("engine core %s ready (pid %s)", self.name, self.pid)

    def _core_died(self, code: int) -> None:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        reason = f"the engine core process of {self.name} stopped ({how})"
        log.error("%s", reason)
        self._ready.clear()
        with self._lock:
            calls, self._calls = dict(self._calls), {}
            lost, self._in_flight = sorted(self._in_flight), set()
        for future in calls.values():
            if not future.done():
                future.set_exception(CoreDied(reason))
        if lost and self.sink is not None:
            self.sink.fail(lost, reason)
        if code in STOP_SIGNALS and self._stopped_with_worker():
            log.info("engine core %s stopped with its worker: not replaced", self.name)
            self._dead = True
            self._ready.set()  # wakes start() if the worker is stopped while it starts
            return
        self.restarts += 1
        if self.restarts > MAX_RESTARTS:
            log.error("engine core %s died %d times in a row: the worker reports itself dead",
                      self.name, self.restarts)
            self._dead = True
            self._ready.set()  # wakes start() if it is still waiting
            return
        self._spawn()


def core_environment(environ) -> dict[str, str]:
    """The core process's environment: the worker's, with the wait of the OpenMP threads
    (torch's CPU threads, libgomp) chosen unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is
    set. A core that will run at SPIN_NICE or lower (engine.core_proc) spins briefly at a
    barrier (GOMP_SPINCOUNT=SPIN_COUNT) and sleeps after that: it outranks the service's
    processes, and a step on the CPU runs about a fifth faster (on 2 cores the service
    delivers 9-25% more tokens a second, README). Any other core sleeps at once
    (OMP_WAIT_POLICY=PASSIVE): at equal rank a spinning thread holds the CPU that the
    service, or the other thread's work, needs."""
    env = dict(environ)
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return env
    nice = core_nice(environ)
    if nice <= SPIN_NICE and may_take_niceness(nice):
        env["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    else:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env
