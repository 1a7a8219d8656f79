"""A request's way into the engine: a prompt (text or token ids) and its SamplingParams
checked against what this engine can run, tokenised, and made a Request; then queued, or
held while its output constraint compiles beside the step loop. vLLM's InputProcessor,
in-process. It also makes a fork's samples, and numbers every request."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Iterator

from engine.block_hash import root_hash
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv.coordinator import KVCacheCoordinator
from engine.kv.layout import blocks_for
from engine.kv.pins import Pins
from engine.model.runner import Runner
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler


class InputProcessor:
    def __init__(self, config: EngineConfig, runner: Runner, scheduler: Scheduler,
                 kv: KVCacheCoordinator, pins: Pins) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.max_model_len = runner.max_model_len
        self.scheduler = scheduler
        self.kv = kv
        self.pins = pins
        self._indices = itertools.count(1)  # request index 0 means "no owner" in snapshots
        self._structured = None  # engine/text/structured.py, built on the first constrained request
        # (request, its compile) once the compile thread is done: queue_compiled() queues
        # the request or ends it (appended by the compile thread, taken by the loop)
        self._compiled: collections.deque = collections.deque()

    def next_index(self) -> int:
        """A new request's engine-wide number (snapshots' block owner id)."""
        return next(self._indices)

    def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
            priority: int = 0, job_id: str | None = None, cache_salt: str | None = None,
            arrival_time: float | None = None, tenant: str | None = None) -> Request:
        """Check, make and queue a request (LLMEngine.add_request). Raises
        InvalidRequestError for a bad prompt or id."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request {request_id!r} already exists")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        token_ids = self.prompt_ids(prompt)
        self._check_fits(token_ids, params, cache_salt)
        if params.structured is not None:
            structured = self.structured_outputs()  # (the simulator refuses here)
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            index=self.next_index(), root_hash=root_hash(self.runner.model_id, cache_salt),
            pinned_root=root_hash(self.runner.model_id, None) if cache_salt else None,
            block_size=self.config.block_size, priority=priority, job_id=job_id,
            tenant=tenant, eos_token_ids=self.tokenizer.eos_token_ids,
            fork_pending=params.n > 1)
        self.kv.read_ahead(request.block_hashes)  # (its blocks on disk, before admission)
        if params.structured is None:
            self.scheduler.add(request)
        else:  # queued once its grammar is compiled, beside the step loop
            self.scheduler.add(request, compiling=True)
            structured.compile(params.structured).add_done_callback(
                lambda compiled: self._compiled.append((request, compiled)))
        return request

    def _check_fits(self, token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None) -> None:
        """InvalidRequestError for a request this engine could never run."""
        if params.prompt_logprobs is not None and self.config.simulate:
            raise InvalidRequestError("prompt logprobs need a model with logits; the "
                                      "simulated engine has none")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} samples cannot run together: this engine "
                                      f"runs at most {self.config.max_num_seqs} sequences")
        vocab = self.runner.vocab_size
        if any(t >= vocab for t in params.token_ids_used()):
            raise InvalidRequestError(f"stop_token_ids and logit_bias name token ids beyond "
                                      f"the vocabulary (ids must be below {vocab})")
        need_tokens = min(len(token_ids) + params.max_tokens, self.max_model_len)
        need = self._blocks_for(need_tokens)
        gpu = self.kv.gpu
        if need > gpu.num_blocks:
            raise InvalidRequestError(
                f"request needs {need} KV blocks for {need_tokens} tokens; the pool has "
                f"{gpu.num_blocks}: lower max_tokens")
        usable = self.pins.usable_blocks(token_ids, cache_salt)
        if need > usable:  # it would preempt itself for ever: pinned blocks are never freed
            raise InvalidRequestError(
                f"request needs {need} KV blocks for {need_tokens} tokens; the pool has "
                f"{gpu.num_blocks}, of which {gpu.num_pinned} are pinned "
                f"(only {usable} can be its): lower max_tokens, or unpin prefixes")

    def _blocks_for(self, num_tokens: int) -> int:
        """Most GPU blocks a request of num_tokens holds at once: where layers slide, a
        window and a step's chunk (in each sliding layer group's table)."""
        windows = self.runner.kv_group_windows or (self.runner.sliding_window,)
        return blocks_for(num_tokens, self.config.block_size, windows,
                          self.config.max_num_batched_tokens)

    def live_needs(self) -> Iterator[tuple[str, int]]:
        """Each live request's id and the most GPU blocks it holds at once (what a pin
        must leave it)."""
        for request in self.scheduler.requests.values():
            yield request.request_id, self._blocks_for(min(
                request.num_prompt_tokens + request.sampling_params.max_tokens,
                self.max_model_len))

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids (text tokenised); InvalidRequestError for one that is
        empty, too long for the model, or names ids beyond the vocabulary."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            vocab = self.runner.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                       for t in token_ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids")
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; the model's limit is {self.max_model_len} "
                "including at least one generated token")
        return token_ids

    def sample(self, parent: Request, i: int) -> Request:
        """Sample i of a forked request: the parent's prompt and place, its own id
        ("<parent>/<i>"), seed (the parent's + i, if it has one) and grammar matcher.
        The scheduler gives it the parent's blocks."""
        params = dataclasses.replace(
            parent.sampling_params, n=1,
            seed=None if parent.sampling_params.seed is None else parent.sampling_params.seed + i)
        return Request(
            request_id=f"{parent.request_id}/{i}", prompt_token_ids=parent.prompt_token_ids,
            sampling_params=params, arrival_time=parent.arrival_time,
            index=self.next_index(), root_hash=parent.root_hash,
            pinned_root=parent.pinned_root, block_size=parent.block_size,
            priority=parent.priority, job_id=parent.job_id, tenant=parent.tenant,
            eos_token_ids=parent.eos_token_ids,
            grammar=None if parent.compiled_grammar is None
            else self._structured.matcher(parent.compiled_grammar),
            compiled_grammar=parent.compiled_grammar, parent_id=parent.request_id,
            sample_index=i, prompt_logprobs=list(parent.prompt_logprobs))

    # --- structured output ---------------------------------------------------------------
    def structured_outputs(self):
        """This engine's grammar compiler (engine/text/structured.py); InvalidRequestError on
        the simulator, which has no logits to constrain."""
        if self.config.simulate:
            raise InvalidRequestError("structured output needs a model with logits; the "
                                      "simulated engine has none")
        if self._structured is None:
            from engine.text.structured import StructuredOutputs
            self._structured = StructuredOutputs(self.tokenizer, self.runner.vocab_size)
        return self._structured

    @property
    def has_compiled(self) -> bool:
        """Whether a constraint finished compiling since queue_compiled() last ran."""
        return bool(self._compiled)

    def queue_compiled(self) -> list[Request]:
        """Requests whose constraint the compile thread is done with: queued with their
        matcher, or ended alone (finish_reason "error") if xgrammar refused it; returns
        those ended. One aborted while it compiled is gone already."""
        ended = []
        while self._compiled:
            request, compiled = self._compiled.popleft()
            if self.scheduler.compiling.get(request.request_id) is not request:
                continue
            error = compiled.exception()
            if error is None:
                request.compiled_grammar = compiled.result()
                request.grammar = self._structured.matcher(request.compiled_grammar)
                self.scheduler.release(request)
            else:
                request.error = str(error)
                self.scheduler.finish(request, RequestStatus.FINISHED, "error")
                ended.append(request)
        return ended

    def close(self) -> None:
        if self._structured is not None:
            self._structured.close()
