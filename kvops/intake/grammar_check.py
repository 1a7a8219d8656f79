"""Structured-output constraints compiled before a job is stored, never in the web's
event loop and never for longer than a deadline.

A constraint that xgrammar refuses must be a 400, not a job that fails later, so the web
compiles each one before storing its job: with the engine's tokenizer where the web can
read the model folder (what the engine will do), else without one (the grammar alone).
Compiling can take seconds for a schema within the bounds of engine/text/structured.py, and
xgrammar cannot be interrupted, so the compiles run in worker processes
(`python -m kvops.intake.grammar_check`, KVOPS_GRAMMAR_WORKERS of them): a compile past
KVOPS_GRAMMAR_TIMEOUT_S is a 400 and its worker is killed and replaced. Verdicts are
cached per (tokenizer, constraint), refusals included, so a repeat costs nothing.

Callers in the event loop use check_async (the wait happens on a thread); synchronous
views call check.
"""
from __future__ import annotations

import json
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgpack

READY_TIMEOUT_S = 120.0  # a worker's start, and its first use of a tokenizer
CACHE_SIZE = 4096  # verdicts kept per web process
QUEUE_PER_WORKER = 8  # checks that may wait for a worker, per worker; more: Busy (503)
_HEADER = struct.Struct("<I")


class Busy(Exception):
    """Every worker is compiling and the queue is full: try again (HTTP 503)."""


class WorkerFailed(Exception):
    """The worker process died or did not answer outside a compile (not the
    constraint's doing: its verdict is not kept)."""


class GrammarWorker:
    """One compile process (started on first use) and the tokenizers it has loaded."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.prepared: set[tuple[str, int]] = set()  # (tokenizer folder, vocab size)

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvops.intake.grammar_check"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.prepared.clear()
        self._call({"op": "ping"}, READY_TIMEOUT_S)

    def prepare(self, tokenizer: tuple[str, int]) -> None:
        """Load a tokenizer's vocabulary in the worker (RuntimeError if it will not)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        if tokenizer not in self.prepared:
            self._call({"op": "tokenizer", "folder": tokenizer[0], "vocab_size": tokenizer[1]},
                       READY_TIMEOUT_S)
            self.prepared.add(tokenizer)

    def compile(self, spec: dict, tokenizer: tuple[str, int] | None,
                timeout_s: float) -> str | None:
        """None if the constraint compiles, else xgrammar's reason. TimeoutError (the
        worker killed) if the compile ran past timeout_s; WorkerFailed if the worker
        failed otherwise."""
        if tokenizer is not None:
            self.prepare(tokenizer)
        elif self.proc is None or self.proc.poll() is not None:
            self._start()
        reply = self._call({"op": "compile", "spec": spec,
                            "tokenizer": list(tokenizer) if tokenizer else None},
                           timeout_s, compiling=True)
        return reply.get("error")

    def _call(self, message: dict, timeout_s: float, compiling: bool = False) -> dict:
        data = msgpack.packb(message)  # (the caller checked that it packs)
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
            header = self._read(_HEADER.size, time.monotonic() + timeout_s)
            reply = msgpack.unpackb(self._read(_HEADER.unpack(header)[0],
                                               time.monotonic() + READY_TIMEOUT_S))
        except TimeoutError:
            self.kill()
            if compiling:
                raise
            raise WorkerFailed("the grammar worker did not answer") from None
        except (OSError, ValueError) as e:
            self.kill()
            raise WorkerFailed(f"the grammar worker failed: {e}") from None
        if "fatal" in reply:  # the worker could not do what it was asked at all
            self.kill()
            raise RuntimeError(reply["fatal"])
        return reply

    def _read(self, n: int, deadline: float) -> bytes:
        out = b""
        fd = self.proc.stdout.fileno()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise OSError("the grammar worker exited")
            out += chunk
        return out

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class GrammarChecker:
    """This process's compile workers, the checks waiting for them (bounded) and its
    cache of verdicts. Checks of the same constraint at once share one compile."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        if workers < 1:
            raise ValueError("KVOPS_GRAMMAR_WORKERS must be at least 1")
        self.timeout_s = timeout_s
        self._idle: queue.Queue[GrammarWorker] = queue.Queue()
        for _ in range(workers):
            self._idle.put(GrammarWorker())
        self._slots = threading.BoundedSemaphore(workers * (1 + QUEUE_PER_WORKER))
        # the threads async callers wait on (not the event loop's default executor,
        # which the rest of the web shares)
        self.executor = ThreadPoolExecutor(workers * (1 + QUEUE_PER_WORKER),
                                           thread_name_prefix="grammar-check")
        self._verdicts: OrderedDict[tuple, str | None] = OrderedDict()
        self._pending: dict[tuple, Future] = {}  # compiles under way, by key
        self._unloadable: set[tuple[str, int]] = set()  # tokenizers a worker could not load
        self._lock = threading.Lock()  # guards the three above
        self.num_compiles = 0  # compiles a worker ran (not answered from the cache)
        self.num_timeouts = 0

    def verdict(self, spec: dict, tokenizer: tuple[str, int] | None) -> str | None:
        """None if the constraint compiles (with this tokenizer: its model folder and
        vocabulary size), else why not, in words for the client. Busy if too many
        checks wait already."""
        kind = next(iter(spec))
        try:
            msgpack.packb(spec)
        except (OverflowError, ValueError, TypeError) as e:  # e.g. an integer past 64 bits
            return f"structured {kind}: it holds a value the compiler cannot take ({e})"
        key = (tokenizer, json.dumps(spec, sort_keys=True))
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
            pending = self._pending.get(key)
            lead = pending is None
            if lead:
                pending = self._pending[key] = Future()
        if not lead:
            return pending.result()
        try:
            verdict, keep = self._compile(spec, tokenizer)
        except BaseException as e:
            with self._lock:
                del self._pending[key]
            pending.set_exception(e)
            raise
        with self._lock:
            del self._pending[key]
            if keep:
                self._verdicts[key] = verdict
                while len(self._verdicts) > CACHE_SIZE:
                    self._verdicts.popitem(last=False)
        pending.set_result(verdict)
        return verdict

    def _compile(self, spec: dict, tokenizer: tuple[str, int] | None) -> tuple[str | None, bool]:
        """(verdict, whether to keep it) from a worker."""
        if not self._slots.acquire(blocking=False):
            raise Busy("structured-output constraints are being checked for many requests "
                       "at once; try again shortly")
        try:
            worker = self._idle.get()
            try:
                self.num_compiles += 1
                if tokenizer in self._unloadable:
                    tokenizer = None
                for attempt in (1, 2):
                    try:
                        return worker.compile(spec, tokenizer, self.timeout_s), True
                    except RuntimeError:  # the tokenizer will not load there: the grammar
                        self._unloadable.add(tokenizer)  # alone, from now on
                        tokenizer = None
                    except WorkerFailed:
                        if attempt == 2:
                            raise Busy("the constraint could not be checked now (its "
                                       "worker failed); try again") from None
                return worker.compile(spec, None, self.timeout_s), True
            except TimeoutError:
                self.num_timeouts += 1
                return (f"structured {next(iter(spec))}: compiling it took longer than "
                        f"{self.timeout_s:g} s (KVOPS_GRAMMAR_TIMEOUT_S); simplify the "
                        "constraint"), True
            finally:
                self._idle.put(worker)
        finally:
            self._slots.release()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


_checker: GrammarChecker | None = None
_checker_lock = threading.Lock()


def get_checker() -> GrammarChecker:
    """This process's checker, made on first use from the settings."""
    global _checker
    with _checker_lock:
        if _checker is None:
            from django.conf import settings
            _checker = GrammarChecker(settings.KVOPS_GRAMMAR_WORKERS,
                                      settings.KVOPS_GRAMMAR_TIMEOUT_S)
        return _checker


def tokenizer_of(engines: list) -> tuple[str, int] | None:
    """The model folder and vocabulary of the first of these engines (Engine rows) whose
    tokenizer this process can read: the constraint is compiled as that engine will."""
    from kvops.intake.prompts import inspector
    for engine in engines:
        config = engine.config or {}
        if config.get("simulate") or not config.get("vocab_size"):
            continue
        if inspector.tokenizer(config) is not None:
            return str(config["model_path"]), int(config["vocab_size"])
    return None


def check(spec: dict | None, param: str, engine_name: str = "",
          model: str | None = None) -> None:
    """limits.InvalidParam (HTTP 400) naming `param` if the constraint does not compile,
    or not within the deadline, for the engines that may run its job (named, or serving
    `model`: selectors.candidate_engines), with their tokenizer where it is readable.
    Busy (HTTP 503) if too many checks wait already."""
    if spec is None:
        return
    from kvops import selectors
    from kvops.intake.limits import InvalidParam
    engines = selectors.candidate_engines(engine_name, model)
    verdict = get_checker().verdict(spec, tokenizer_of(engines))
    if verdict is not None:
        raise InvalidParam(param, f"`{param}`: {verdict}")


async def check_async(spec: dict | None, param: str, engine_name: str = "",
                      model: str | None = None) -> None:
    """check, waiting on one of the checker's own threads: the event loop, and the
    threads the rest of the web shares, go on meanwhile."""
    if spec is None:
        return
    import asyncio
    await asyncio.get_running_loop().run_in_executor(
        get_checker().executor, check, spec, param, engine_name, model)


# --- the worker process ------------------------------------------------------------------
def _serve() -> None:
    """Answer compile requests on stdin/stdout (length-prefixed msgpack) until stdin
    closes. Nothing else may write to stdout."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints (imports') go nowhere
    import xgrammar  # noqa: F401  (loaded before the first ping's answer, so that no
    # compile's deadline pays for it)

    from engine.errors import InvalidRequestError
    from engine.text.structured import StructuredOutputs, grammar_of
    stdin = sys.stdin.buffer
    compilers: dict[tuple[str, int], Any] = {}
    while True:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        message = msgpack.unpackb(stdin.read(_HEADER.unpack(header)[0]))
        op = message["op"]
        try:
            if op == "tokenizer":
                from engine.text.tokenizer import HFTokenizer
                key = (message["folder"], message["vocab_size"])
                structured = StructuredOutputs(HFTokenizer.from_folder(key[0]), key[1])
                structured._compiler_for()  # the tokenizer's vocabulary, read once
                compilers[key] = structured
                reply: dict = {}
            elif op == "compile":
                tokenizer = tuple(message["tokenizer"]) if message["tokenizer"] else None
                spec = message["spec"]
                try:
                    if tokenizer is None:
                        grammar_of(spec)
                    else:
                        compilers[tokenizer]._compile(spec)
                    reply = {}
                except InvalidRequestError as e:
                    reply = {"error": str(e)}
            else:
                reply = {}
        except Exception as e:  # noqa: BLE001  (said to the parent, which replaces us)
            reply = {"fatal": f"{type(e).__name__}: {e}"}
        data = msgpack.packb(reply)
        out.write(_HEADER.pack(len(data)) + data)
        out.flush()


if __name__ == "__main__":
    _serve()
