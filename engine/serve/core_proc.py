"""The engine core as a process of its own: `python -m engine.serve.core_proc`.

One per GPU, with no Django and no Celery: the step loop, scheduler, KV manager and
model, and nothing else under its interpreter lock (vLLM V1 splits its EngineCore from
its API server for the same reason: on a GPU a step takes milliseconds, and Python work
beside it under one lock is taken from the GPU). Its worker (engine/serve/client.py)
talks to it over two ZMQ sockets, the messages engine/wire.py's: in, Adds (answered by
Added), Command and KVAsk (answered by a Reply), Stop and Shutdown; out, Ready, one
Outputs per step, StepFailed, Metrics (a few times a second) and the live KV view's
KVItems (engine/observe/feed.py: up to 10 a second). A "migrate" command is answered once
the request runs at the destination (engine/transfer/link.py).

Every message is decoded once and checked whole before it is applied; one that is not of
the protocol is refused (MalformedMessage, answered when it carries a call id) and the
core serves on.

Commands and new requests are applied between two steps. A command whose deadline has
passed when the core reaches it is dropped (its caller has given up) and answered
`CommandExpired`, so a late operator action never lands after its caller saw a timeout. The
core exits when its worker does.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from engine import wire
from engine.serve.commands import STATE_COMMANDS, add_requests, run_command
from engine.config import EngineConfig
from engine.errors import CommandExpired, EngineError, InvalidRequestError, MalformedMessage
from engine.observe.feed import KVFeed
from engine.llm_engine import LLMEngine
from engine.keys import random_secret
from engine.transfer.link import MigrationLink

log = logging.getLogger("engine.core")

IDLE_POLL_MS = 50  # how long an idle core waits for input before looking again
METRICS_S = 0.25  # metrics are sent this often


class CoreServer:
    """The step loop: the one that drives an engine, in a core process or on a worker's
    thread (engine/serve/client.py's two transports)."""

    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket,
                 kv_view: bool = True, link: MigrationLink | None = None) -> None:
        self.engine = engine
        self.inbox = inbox  # PULL: the worker's messages
        self.outbox = outbox  # PUSH: to the worker; the loop and the feed's thread send
        # requests moving in and out (engine/transfer/link.py); None: none can
        self.link = link
        # requests to hand to a decode engine once their first token is out (a prefill
        # engine's): request id -> where
        self.handoffs: dict[str, wire.HandOff] = {}
        self._poller = zmq.Poller()
        self._polled: list[zmq.Socket] = []
        self._send_lock = threading.Lock()
        # the live KV view (engine/observe/feed.py), unless nobody watches (kv_view False)
        self.feed = KVFeed(engine.config.name, lambda item: self._send(wire.KVItem(item))) \
            if kv_view else None
        self.parent = os.getppid()
        self._next_metrics = 0.0

    def run(self) -> None:
        engine = self.engine
        described = engine.describe_config()
        described["migration_address"] = self.link.address if self.link is not None else None
        self._send(wire.Ready(described, engine.metrics()))
        while True:
            busy = engine.has_work_to_run() or (self.link is not None and self.link.busy)
            if not self._take_input(0 if busy else IDLE_POLL_MS):
                return
            if engine.has_work_to_run():
                self._step()
            if self.link is not None:
                self.link.advance()
                self.link.expire()
            if self.feed is not None:
                self.feed(engine)
            now = time.monotonic()
            if now >= self._next_metrics:
                self._next_metrics = now + METRICS_S
                self._send(wire.Metrics(self.metrics()))
                if os.getppid() != self.parent:  # the worker is gone: so are we
                    log.warning("engine core: its worker exited; stopping")
                    return

    def metrics(self) -> dict:
        """The engine's metrics, and what its live KV view costs (`kv_view`, FeedStats)."""
        metrics = self.engine.metrics()
        if self.feed is not None:
            metrics["kv_view"] = dataclasses.asdict(self.feed.stats)
        return metrics

    def _send(self, message: wire.FromCore) -> None:
        data = wire.FROM_CORE.encode(message)
        with self._send_lock:
            self.outbox.send(data)

    def _reply(self, call_id: int, result: Any = None, error: wire.Refusal | None = None) -> None:
        try:
            self._send(wire.Reply(call_id, result, error))
        except MalformedMessage as e:  # (a result over the limit, or msgpack cannot carry it)
            log.warning("engine core: call %d could not be answered: %s", call_id, e)
            self._send(wire.Reply(call_id, error=wire.Refusal.of(e)))

    def _reply_later(self, call_id: int) -> Callable[[bool, Any], None]:
        """The callback that answers a call once it is done: (True, result) or (False,
        [error type, message])."""
        return lambda ok, result: self._reply(call_id, result) if ok else \
            self._reply(call_id, error=wire.Refusal(*result))

    def _take_input(self, timeout_ms: int) -> bool:
        """Apply every message waiting (waiting up to timeout_ms for the first); False
        once told to shut down."""
        sockets = [self.inbox, *(self.link.sockets() if self.link is not None else ())]
        if sockets != self._polled:  # (a move out connected a new destination)
            self._poller = zmq.Poller()
            for sock in sockets:
                self._poller.register(sock, zmq.POLLIN)
            self._polled = sockets
        ready = dict(self._poller.poll(timeout_ms))
        for sock in sockets[1:]:
            if sock in ready:
                self.link.on_readable(sock)
        if self.inbox not in ready:
            return True
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                message = wire.TO_CORE.decode(data)
            except MalformedMessage as e:
                self._refuse(data, e)
                continue
            if isinstance(message, wire.Shutdown):
                return False
            self._apply(message)

    def _refuse(self, data: bytes, error: MalformedMessage) -> None:
        """A message not of the protocol: answered if it names a call, said in the log."""
        log.warning("engine core: %s", error)
        head = wire.TO_CORE.head(data, 2)
        if head is not None and head[0] in wire.CALL_KINDS and type(head[1]) is int:
            self._reply(head[1], error=wire.Refusal.of(error))

    def _apply(self, message: wire.ToCore) -> None:
        if isinstance(message, wire.Stop):
            self.engine.finish_request(message.request_id)
            return
        call_id = message.call_id
        if isinstance(message, wire.KVAsk):
            if self.feed is None:
                self._reply(call_id, error=wire.Refusal("LookupError",
                                                        "this engine keeps no KV view"))
            else:  # answered by the feed's thread, the loop goes on
                self.feed.ask(message.kind, message.argument, lambda ok, result: self._reply(
                    call_id, result) if ok else self._reply(
                    call_id, error=wire.Refusal("LookupError", str(result))))
            return
        try:
            if isinstance(message, wire.Adds):
                self._send(wire.Added(call_id, self._add(message.requests)))
                return
            name, deadline = message.name, message.deadline
            if deadline is not None and time.time() > deadline:
                raise CommandExpired(f"{name}: its caller had stopped waiting; not applied")
            if name == "migrate":  # answered once the request runs at the destination
                if self.link is None:
                    raise InvalidRequestError("this engine core moves no requests")
                self.link.start(dict(message.arguments), deadline, self._reply_later(call_id))
                return
            result = run_command(self.engine, name, dict(message.arguments))
            if name in STATE_COMMANDS:  # the worker's metrics carry the new state before
                self._send(wire.Metrics(self.metrics()))  # the reply reaches it
        except EngineError as e:
            self._reply(call_id, error=wire.Refusal.of(e))
            return
        except (KeyError, TypeError, ValueError) as e:
            self._reply(call_id, error=wire.Refusal("InvalidRequestError", f"bad arguments: {e}"))
            return
        except Exception as e:  # reported to the caller; the core keeps serving
            log.exception("engine core: %s failed", wire.kind_of(message))
            self._reply(call_id, error=wire.Refusal.of(e))
            return
        self._reply(call_id, result)

    def _add(self, requests: list[wire.AddRequest]) -> list[wire.Refusal | None]:
        """Add new requests; those of a prefill engine that decode elsewhere are handed
        over once their first token is out (_hand_over)."""
        if self.link is not None:
            for item in requests:
                if item.decode_on is not None:
                    self.handoffs[item.request_id] = item.decode_on
        refusals = add_requests(self.engine, requests)
        for item, refusal in zip(requests, refusals):
            if refusal is not None:
                self.handoffs.pop(item.request_id, None)
        return refusals

    def _step(self) -> None:
        try:
            outputs = self.engine.step_core()
        except Exception as e:
            log.exception("engine step failed")
            failed = self.engine.recover_from_failed_step()
            self._send(wire.StepFailed(failed, f"engine step failed: {type(e).__name__}: {e}"))
            return
        if outputs:
            self._send(wire.Outputs([wire.StepOutput.of(o) for o in outputs]))
            if self.handoffs:
                self._hand_over(outputs)

    def _hand_over(self, outputs: list) -> None:
        """Prefill/decode: a request whose first token is out moves to its decode engine
        (the same move as an operator's, with the full blocks copied while it goes on
        decoding here); should the move fail, it decodes here."""
        for out in outputs:
            target = self.handoffs.get(out.request_id)
            if target is None:
                continue
            if out.finished or not out.new_token_ids:
                if out.finished:
                    del self.handoffs[out.request_id]
                continue
            del self.handoffs[out.request_id]
            rid = out.request_id
            try:
                self.link.start({"request_id": rid, "address": target.address,
                                 "to": target.to, "ticket": target.ticket,
                                 "staged": True, "reason": "decode"},
                                None, lambda ok, result, rid=rid: None if ok else log.info(
                                    "request %s decodes here: %s", rid, result))
            except EngineError as e:  # (a fork, a structured output: it decodes here)
                log.info("request %s decodes here: %s", rid, e)


def serve(config: EngineConfig, input_address: str, output_address: str,
          context: zmq.Context | None = None, kv_view: bool = True) -> None:
    """Build the engine and serve until told to stop (or the worker is gone). In a
    process of its own (main), or on a thread of the worker's with the worker's
    `context` (inproc:// addresses): the same loop either way."""
    own = context is None
    context = context or zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.MAXMSGSIZE, wire.MAX_CORE_MESSAGE_BYTES)  # (over ipc:// or tcp://)
    inbox.connect(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(output_address)
    try:
        engine = LLMEngine(config, detokenize=False)
        link = MigrationLink(engine, config.secret or random_secret(), config.migration_host,
                             config.migration_port)
        server = CoreServer(engine, inbox, outbox, kv_view, link)
        try:
            server.run()
        finally:
            link.close()
            if server.feed is not None:
                server.feed.close()
            engine.close()  # a split model's other ranks
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        if own:
            context.term()


# The core's niceness unless KVOPS_ENGINE_CORE_NICE says otherwise.
#
# A core that feeds a GPU spends a few milliseconds of CPU a step, and the GPU idles while
# that core waits for a CPU behind the web server or the worker's threads: it must win the
# CPU whenever it wants it (-19 weighs about 70 times a default process under Linux's
# scheduler; -5 only 3 times, and on a 2-core machine running 256 streams the simulated
# core's steps then took 0.5-1 ms longer than alone, and none longer at -19). A core that
# computes the model on the CPU takes -19 too: each time the service takes a core from one
# of its torch threads, the step waits for that thread. On the 2-core machine, the default
# model at 32 streams, four pairs of runs alternating -5 and -19: 0.62 / 0.83, 0.49 / 0.60,
# 0.53 / 0.88, 0.74 / 0.74 of the engine alone, with first tokens and chunks no later at
# -19 (the service runs while the torch threads wait between steps and at barriers).
CORE_NICE = -19


# With the core at this niceness or lower, its OpenMP threads spin for a moment at a barrier
# before they sleep (SPIN_COUNT turns of libgomp's wait loop, about 30 us) instead of
# sleeping at once (engine.serve.client.core_environment). A parallel region then starts
# without a futex wake-up, and a model computed on the CPU runs many of them a step: on the
# 2-core machine the default model's decode step at 32 requests took 70-74 ms (median of
# 40) spinning 3,000 turns, 77 ms at libgomp's default (300,000, about 3 ms) and 95-112 ms
# sleeping at once, the core at -19. A short spin because a long one fails badly when both
# threads land on one CPU, as they do when a busy process holds the other: each barrier then
# waits out the other's spin, and beside a busy nice-0 process the same model's steps
# through the service took 1.9 s at 300,000 turns, 245 ms at 3,000 and 191 ms sleeping.
# At a higher niceness the spinner takes a CPU from the service (beside the busy process,
# at nice 0: 175 ms at 3,000 turns, 134 ms sleeping).
SPIN_NICE = -10
SPIN_COUNT = 3000


def may_take_niceness(nice: int) -> bool:
    """Whether a process started from this one may lower its niceness to `nice` (root,
    CAP_SYS_NICE or RLIMIT_NICE). Tried on the calling thread, which Linux gives a
    niceness of its own, and put back at once."""
    thread = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, thread)
        if nice >= before:
            return True
        os.setpriority(os.PRIO_PROCESS, thread, nice)
    except OSError:
        return False
    os.setpriority(os.PRIO_PROCESS, thread, before)  # raising it needs no right
    return True


def raise_priority(nice: int) -> None:
    """Run ahead of the service's processes on the CPU (see CORE_NICE). Needs the
    right to lower niceness (root or CAP_SYS_NICE); without it the core runs at the
    default priority."""
    if nice >= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as e:
        log.info("engine core: priority left as it is (%s)", e)


def core_command(config: EngineConfig, input_address: str, output_address: str,
                 *options: str) -> tuple[list[str], bytes]:
    """The command line that starts a core of `config`, and what its stdin must carry:
    the secret (EngineConfig.secret) never goes on a command line, which every user of
    the machine may read (/proc/<pid>/cmdline), but through the core's stdin."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name != "secret"}
    argv = [sys.executable, "-m", "engine.serve.core_proc", "--config", json.dumps(fields),
            "--input", input_address, "--output", output_address, *options]
    if config.secret is None:
        return argv, b""
    return argv + ["--secret-on-stdin"], config.secret.encode() + b"\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run an engine core for its worker.")
    parser.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    parser.add_argument("--input", required=True, help="ZMQ address to read messages from")
    parser.add_argument("--output", required=True, help="ZMQ address to send messages to")
    parser.add_argument("--no-kv-view", action="store_true",
                        help="keep no live KV view (nobody watches this engine's blocks)")
    parser.add_argument("--nice", type=int, default=CORE_NICE,
                        help=f"the niceness the core takes (default {CORE_NICE})")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--secret-on-stdin", action="store_true",
                        help="read EngineConfig.secret from stdin's first line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s engine-core: %(message)s")
    fields = json.loads(args.config)
    if "secret" in fields:
        parser.error("the secret is read from stdin (--secret-on-stdin), never from the "
                     "command line, which other users of the machine can read")
    if args.secret_on_stdin:
        fields["secret"] = sys.stdin.readline().rstrip("\n")
    config = EngineConfig(**fields)
    raise_priority(args.nice)
    if not config.disk_cache_dir:
        serve(config, args.input, args.output, kv_view=not args.no_kv_view)
        return 0
    # With a disk tier, a stop signal (a process group's SIGTERM or Ctrl-C) first closes
    # the engine, which finishes the disk's writes under way, then ends the process by
    # the same signal, as its worker expects of a core that stops with it.
    caught: list[int] = []

    def stop(signum, frame) -> None:
        if not caught:
            caught.append(signum)
            raise _Stopped

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        serve(config, args.input, args.output, kv_view=not args.no_kv_view)
    except _Stopped:
        pass
    if caught:
        signal.signal(caught[0], signal.SIG_DFL)
        os.kill(os.getpid(), caught[0])
    return 0


class _Stopped(BaseException):
    """A stop signal, raised out of the step loop so that the engine closes."""


if __name__ == "__main__":
    sys.exit(main())
