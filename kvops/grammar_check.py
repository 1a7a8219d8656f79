"""Structured-output constraints compiled before a job is stored, never in the web's
event loop and never for longer than a deadline.

A constraint that xgrammar refuses must be a 400, not a job that fails later, so the web
compiles each one before storing its job: with the engine's tokenizer where the web can
read the model folder (what the engine will do), else without one (the grammar alone).
Compiling can take seconds for a schema within the bounds of engine/structured.py, and
xgrammar cannot be interrupted, so the compiles run in worker processes
(`python -m kvops.grammar_check`, KVOPS_GRAMMAR_WORKERS of them): a compile past
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
from typing import Any

import msgpack

READY_TIMEOUT_S = 120.0  # a worker's start, and its first use of a tokenizer
CACHE_SIZE = 4096  # verdicts kept per web process
_HEADER = struct.Struct("<I")


class GrammarWorker:
    """One compile process (started on first use) and the tokenizers it has loaded."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.prepared: set[tuple[str, int]] = set()  # (tokenizer folder, vocab size)

    def _start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvops.grammar_check"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        self.prepared.clear()
        self._call({"op": "ping"}, READY_TIMEOUT_S)

    def compile(self, spec: dict, tokenizer: tuple[str, int] | None,
                timeout_s: float) -> str | None:
        """None if the constraint compiles, else xgrammar's reason. TimeoutError (the
        worker killed) past timeout_s."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        if tokenizer is not None and tokenizer not in self.prepared:
            self._call({"op": "tokenizer", "folder": tokenizer[0], "vocab_size": tokenizer[1]},
                       READY_TIMEOUT_S)
            self.prepared.add(tokenizer)
        reply = self._call({"op": "compile", "spec": spec,
                            "tokenizer": list(tokenizer) if tokenizer else None}, timeout_s)
        return reply.get("error")

    def _call(self, message: dict, timeout_s: float) -> dict:
        data = msgpack.packb(message)
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
            header = self._read(_HEADER.size, time.monotonic() + timeout_s)
            reply = msgpack.unpackb(self._read(_HEADER.unpack(header)[0],
                                               time.monotonic() + READY_TIMEOUT_S))
        except (TimeoutError, OSError, ValueError):
            self.kill()
            raise TimeoutError from None
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
    """This process's compile workers and its cache of verdicts."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._idle: queue.Queue[GrammarWorker] = queue.Queue()
        for _ in range(workers):
            self._idle.put(GrammarWorker())
        self._verdicts: OrderedDict[tuple, str | None] = OrderedDict()
        self._lock = threading.Lock()  # guards _verdicts
        self.num_compiles = 0  # compiles a worker ran (not answered from the cache)
        self.num_timeouts = 0

    def verdict(self, spec: dict, tokenizer: tuple[str, int] | None) -> str | None:
        """None if the constraint compiles (with this tokenizer: its model folder and
        vocabulary size), else why not, in words for the client."""
        key = (tokenizer, json.dumps(spec, sort_keys=True))
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        worker = self._idle.get()
        try:
            self.num_compiles += 1
            try:
                try:
                    verdict = worker.compile(spec, tokenizer, self.timeout_s)
                except RuntimeError:  # the tokenizer would not load there: the grammar
                    verdict = worker.compile(spec, None, self.timeout_s)  # alone, then
            except TimeoutError:
                self.num_timeouts += 1
                kind = next(iter(spec))
                verdict = (f"structured {kind}: compiling it took longer than "
                           f"{self.timeout_s:g} s (KVOPS_GRAMMAR_TIMEOUT_S); simplify the "
                           "constraint")
        finally:
            self._idle.put(worker)
        with self._lock:
            self._verdicts[key] = verdict
            while len(self._verdicts) > CACHE_SIZE:
                self._verdicts.popitem(last=False)
        return verdict

    def close(self) -> None:
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
    from kvops.prompts import inspector
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
    `model`: selectors.candidate_engines), with their tokenizer where it is readable."""
    if spec is None:
        return
    from kvops import selectors
    from kvops.limits import InvalidParam
    engines = selectors.candidate_engines(engine_name, model)
    verdict = get_checker().verdict(spec, tokenizer_of(engines))
    if verdict is not None:
        raise InvalidParam(param, f"`{param}`: {verdict}")


async def check_async(spec: dict | None, param: str, engine_name: str = "",
                      model: str | None = None) -> None:
    """check, waiting on a thread: the event loop goes on meanwhile."""
    if spec is None:
        return
    from asgiref.sync import sync_to_async
    await sync_to_async(check, thread_sensitive=False)(spec, param, engine_name, model)


# --- the worker process ------------------------------------------------------------------
def _serve() -> None:
    """Answer compile requests on stdin/stdout (length-prefixed msgpack) until stdin
    closes. Nothing else may write to stdout."""
    import xgrammar  # noqa: F401  (loaded before the first ping's answer, so that no
    # compile's deadline pays for it)

    from engine.errors import InvalidRequestError
    from engine.structured import StructuredOutputs, grammar_of

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints go nowhere
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
                from engine.hf_tokenizer import HFTokenizer
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
