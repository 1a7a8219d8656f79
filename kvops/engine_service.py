"""The engine on a thread of the worker (KVOPS_ENGINE_CORE=thread), and what both ways
into the engine share: the sink protocol and the KVOPS_ENGINE_* configuration. The
default way is the engine core process (kvops/engine_client.py), which offers the same
calls. Tokenizers, chat templates and prompt inspection are in kvops/prompts.py,
operator commands in engine/commands.py.

EngineService owns an LLMEngine and the thread that drives it. Everything that touches
the engine runs on that thread: job tasks submit requests and operator commands as
callables, the loop applies them between two steps, and each step's token ids go to the
sink (the output processor). Hooks run on the loop thread after every step (the live KV
view's feed).
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from engine import EngineConfig, EngineError, InvalidRequestError, LLMEngine
from engine.commands import add_requests, run_command
from engine.errors import error_from_wire
from engine.kv_feed import KVFeed
from engine.outputs import CoreOutput
from kvops.prompts import render_chat

log = logging.getLogger(__name__)

__all__ = ["EngineService", "OutputSink", "EngineError", "InvalidRequestError",
           "config_from_env"]


class OutputSink(Protocol):
    """Where the loop thread hands each step's outputs (kvops/output_processor.py)."""

    def push(self, outputs: list[CoreOutput]) -> None: ...

    def fail(self, request_ids: list[str], message: str) -> None: ...


def config_from_env(environ: dict[str, str]) -> EngineConfig:
    """EngineConfig from KVOPS_ENGINE_<FIELD> variables (e.g. KVOPS_ENGINE_BLOCK_SIZE=32)."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        raw = environ.get(f"KVOPS_ENGINE_{f.name.upper()}")
        if raw is None or raw == "":
            continue
        kwargs[f.name] = _parse_field(f.name, str(f.type), raw)
    return EngineConfig(**kwargs)


def _parse_field(name: str, type_name: str, raw: str) -> Any:
    try:
        if type_name.startswith("bool"):
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            return float(raw)
        return raw
    except ValueError:
        raise InvalidRequestError(
            f"KVOPS_ENGINE_{name.upper()}={raw!r} is not a valid {type_name}") from None


class EngineService:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None,
                 sink: OutputSink | None = None) -> None:
        self.name = config.name
        self.sink = sink  # gets every step's outputs (token ids); None: they are dropped
        self.instance = ""  # set by the worker when it registers (Engine.instance)
        # The step loop reports token ids only; the sink detokenises, off this thread.
        self.engine = engine or LLMEngine(config, detokenize=False)
        self.latest_metrics: dict = self.engine.metrics()  # refreshed by the loop thread
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._hooks: list[Callable[[LLMEngine], None]] = []
        self.feed: KVFeed | None = None  # the live KV view, once attached
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}",
                                        daemon=True)

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self.feed is not None:
            self.feed.close(timeout_s)

    def attach_kv_view(self, on_item: Callable[[dict], None]) -> None:
        """Produce the engine's live KV view (engine/kv_feed.py); on_item gets its items
        on the feed's thread."""
        self.feed = KVFeed(self.name, on_item)
        self.add_hook(self.feed)

    def ask_kv(self, kind: str, argument: Any, timeout_s: float) -> Any:
        """A question to the KV view (see KVFeed.ask)."""
        if self.feed is None:
            raise LookupError("this engine produces no KV view (attach_kv_view)")
        return self.feed.ask_wait(kind, argument, timeout_s)

    def add_hook(self, hook: Callable[[LLMEngine], None]) -> None:
        """Run hook(engine) on the loop thread after each step and each idle tick."""
        self._hooks.append(hook)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- calls from other threads -------------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], Any], timeout_s: float = 30.0) -> Any:
        """Run fn(engine) on the loop thread between two steps and return its result."""
        if not self.alive:
            raise EngineError(f"engine {self.name} is not running")
        future: Future = Future()
        self._commands.put((lambda: fn(self.engine), future))
        self._wake.set()
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            if future.cancel():  # not started yet: the loop drops it, so it never lands late
                raise
            # It started just before the deadline: it is being applied, so wait for it
            # (one command between two steps) and report what it did, never "not applied".
            return future.result()

    def command(self, name: str, arguments: dict, timeout_s: float = 30.0) -> Any:
        """An operator command by name (engine/commands.py)."""
        return self.call(lambda engine: run_command(engine, name, arguments), timeout_s)

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
        """Add several requests between the same two steps (items as
        engine.commands.add_requests takes them); per item None or the error that
        refused it."""
        replies = self.call(lambda engine: add_requests(engine, items))
        return [None if r is None else error_from_wire(*r) for r in replies]

    def finish_request(self, request_id: str) -> None:
        """End a request whose text reached a stop string (applied between two steps;
        does not wait)."""
        self._commands.put((lambda: self.engine.finish_request(request_id), Future()))
        self._wake.set()

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The model's chat template applied to messages (and tools), ready for generation."""
        return render_chat(self.engine.tokenizer, messages, tools)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def describe_config(self) -> dict:
        return self.call(lambda engine: engine.describe_config())

    # --- the loop thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._apply_commands()
            if self.engine.has_work_to_run():
                self._step()
            else:
                self._wake.wait(0.05)
                self._wake.clear()
            self.latest_metrics = self.engine.metrics()
            for hook in self._hooks:
                try:
                    hook(self.engine)
                except Exception:  # a broken publisher must not stop inference
                    log.exception("engine hook failed")

    def _apply_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # delivered to the caller, who decides
                future.set_exception(e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step_core()
        except Exception as e:
            log.exception("engine step failed")
            self._fail_running(e)
            return
        if self.sink is not None:
            self.sink.push(outputs)

    def _fail_running(self, error: Exception) -> None:
        """A step raised: end the requests it was computing, keep serving the rest."""
        failed = self.engine.recover_from_failed_step()
        if self.sink is not None and failed:
            self.sink.fail(failed, f"engine step failed: {type(error).__name__}: {error}")
