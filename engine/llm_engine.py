"""LLMEngine: the public face of the engine (the engine's contract in docs/design.md).

One thread drives it. step() is schedule -> run -> update -> outputs; operator commands
act immediately and must be called between steps from the same thread (the service
queues them and applies them between steps).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Set as AbstractSet

from engine.block_hash import hash_blocks, root_hash
from engine.config import EVICTION_POLICIES, EngineConfig
from engine.text.detokenizer import IncrementalDetokenizer, SimTokenizer
from engine.errors import (InvalidRequestError, InvalidStateError, NotEnoughBlocksError,
                           PrefixNotCachedError)
from engine.kv.events import EventLog, KVEvent
from engine.kv.block_pool import BlockPool
from engine.kv.coordinator import KVCacheCoordinator
from engine.kv.tiers.base import PrefixTier
from engine.kv.layout import blocks_for
from engine.observe.story import STORY_QUEUE_MAX, StoryBook
from engine.transfer import migration
from engine.outputs import CoreOutput, RequestOutput
from engine.observe.rate_meter import RateMeter
from engine.request import Request, RequestStatus
from engine.model.runner import Runner
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.kv.export import KVExport
from engine.observe.snapshot import EVICTION_ORDER_LEN

_ENDED = frozenset({RequestStatus.FINISHED, RequestStatus.ABORTED})
log = logging.getLogger(__name__)
SIMULATED_MAX_MODEL_LEN = 4096
SIMULATED_NUM_GPU_BLOCKS = 4096


def simulated_tokenizer_path(config: EngineConfig) -> str | None:
    """The HF folder the simulator reads its tokenizer from (config.simulate_tokenizer),
    or None for the byte tokenizer."""
    choice = config.simulate_tokenizer
    if choice == "bytes":
        return None
    if choice == "default":
        from engine.model.default_model import default_model_dir
        folder = default_model_dir()
        if not (folder / "tokenizer.json").is_file():
            log.warning("simulate_tokenizer=default: %s is not converted (make setup); "
                        "the simulator counts UTF-8 bytes as tokens", folder)
            return None
        return str(folder)
    return choice


def simulated_tokenizer(path: str | None):
    """The simulator's tokenizer at simulated_tokenizer_path(): SimTokenizer for None,
    else the HF folder's. The worker reads it too, to detokenise."""
    if path is None:
        return SimTokenizer()
    from engine.text.tokenizer import HFTokenizer
    return HFTokenizer.from_folder(path)


def build_runner(config: EngineConfig) -> Runner:
    if config.simulate:
        from engine.model.simulated_runner import SimulatedRunner
        num_gpu = config.num_gpu_blocks or SIMULATED_NUM_GPU_BLOCKS
        num_cpu = num_gpu // 2 if config.num_cpu_blocks is None else config.num_cpu_blocks
        path = simulated_tokenizer_path(config)
        tokenizer = simulated_tokenizer(path)
        # with a real tokenizer, its vocabulary (every id it encodes is a valid prompt)
        vocab = tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else config.vocab_size
        runner = SimulatedRunner(num_gpu, num_cpu, config.block_size, vocab,
                                 config.max_model_len or SIMULATED_MAX_MODEL_LEN,
                                 step_ms=config.simulate_step_ms,
                                 token_us=config.simulate_token_us,
                                 sliding_window=config.simulate_sliding_window,
                                 hybrid=config.simulate_hybrid,
                                 avoid=frozenset(tokenizer.eos_token_ids),
                                 kv_bytes_per_token=config.simulate_kv_bytes_per_token)
        runner.tokenizer = tokenizer
        runner.tokenizer_path = path
        return runner
    from engine.model.model_runner import ModelRunner  # imports torch: only for real models
    return ModelRunner(config)


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: Runner | None = None,
                 detokenize: bool = True, kv_events=None) -> None:
        """kv_events: where the prefix cache's changes go as vLLM KVEventBatch events
        (anything with publish(events)); by default the ZMQ publisher of
        config.kv_events_endpoint, if set."""
        self.config = config
        # False: the caller drives step_core() and turns token ids into text itself (the
        # engine core process, whose worker detokenises, as vLLM's frontend does).
        self.detokenize = detokenize
        self.runner = runner or build_runner(config)
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.events = EventLog(config.max_pending_events)
        # a table per layer group (a model mixing sliding and global layers), or one
        windows = self.runner.kv_group_windows or (self.runner.sliding_window,)
        if config.disk_cache_dir and getattr(self.runner, "tensor_parallel_size", 1) > 1:
            raise InvalidRequestError("a disk tier with a model split over ranks is not "
                                      "supported yet")
        self.kv = KVCacheCoordinator(config.block_size, self.runner.num_gpu_blocks,
                                     self.runner.num_cpu_blocks, config.enable_prefix_caching,
                                     self.events, windows,
                                     cpu_prefix_cache=config.cpu_prefix_cache,
                                     eviction_policy=config.eviction_policy,
                                     disk_tier=self._disk_tier if config.disk_cache_dir
                                     else None)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len, self.events)
        # requests' KV stories (engine/observe/story.py), read from the event stream
        self.stories = StoryBook(config.name, config.kv_history_blocks,
                                 self.events.subscribe(STORY_QUEUE_MAX),
                                 sample=config.kv_metrics_sample) \
            if config.kv_history_blocks else None
        self.kv.stories = self.stories
        # requests being copied here from another engine: (request, blocks cached here)
        self.incoming_migrations: dict[str, tuple[Request, int]] = {}
        self.pin_budget = config.pin_budget  # (set_retention changes it)
        self.step_count = 0
        self.step_seconds = 0.0  # wall time inside the steps that ran (schedule to outputs)
        self.version = 0  # grows with every change to requests or blocks (for publishers)
        self._indices = itertools.count(1)  # request index 0 means "no owner" in snapshots
        self._snapshot_seq = itertools.count(1)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._structured = None  # engine/text/structured.py, built on the first constrained request
        # (request, its compile) once the compile thread is done: the step loop queues the
        # request or ends it (appended by the compile thread, taken by the loop)
        self._compiled: collections.deque = collections.deque()
        self.scheduler.make_sample = self._make_sample
        self._pending: list[Request] = []  # ended by abort or finish_request, not reported yet
        # moved here or away since the last step (engine/transfer/migration.py): their first or
        # last output, not reported yet
        self._moved: list[CoreOutput] = []
        self._inflight = None  # the SchedulerOutput being run, until its update is done
        self._prompt_rate = RateMeter()
        self._gen_rate = RateMeter()
        # An operator's pause: no step runs (requests and their KV stay) until resume()
        self.paused = False
        # An operator's drain: the service routes no new jobs here; the engine reports
        # draining until its last request ends, then drained (it still runs what it gets)
        self.draining = False
        # set_limits may lower the batch limits and raise them back, never above these:
        # the worker's threads and a GPU's activation memory were sized for them
        self.limit_caps = {"max_num_seqs": config.max_num_seqs,
                           "max_num_batched_tokens": config.max_num_batched_tokens}
        # The vLLM-format publisher (engine/observe/vllm_events.py) and what it reads: the event
        # stream with full hashes, translated after each step and each cache command
        self._kv_publisher = kv_events
        if kv_events is None and config.kv_events_endpoint:
            from engine.observe.vllm_events import ZmqKVEventPublisher

            self._kv_publisher = ZmqKVEventPublisher(config.kv_events_endpoint,
                                                     config.kv_events_replay_endpoint)
        self._kv_translator = self._kv_events = None
        if self._kv_publisher is not None:
            from engine.observe.vllm_events import VllmTranslator

            self._kv_events = self.events.subscribe(full=True)
            self._kv_translator = VllmTranslator(
                config.block_size, self.kv.gpu.num_blocks + self.kv.cpu.num_blocks)

    # --- requests ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, job_id: str | None = None,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    tenant: str | None = None) -> None:
        """Queue a request. Raises InvalidRequestError for a bad prompt or id. `tenant`:
        who asked (Request.tenant), for the batch share and for viewers."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request {request_id!r} already exists")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        token_ids = self._prompt_ids(prompt)
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
        if need > self.kv.gpu.num_blocks:
            raise InvalidRequestError(
                f"request needs {need} KV blocks for {need_tokens} tokens; the pool has "
                f"{self.kv.gpu.num_blocks}: lower max_tokens")
        usable = self._usable_blocks(token_ids, cache_salt) if self.kv.gpu.num_pinned else need
        if need > usable:  # it would preempt itself for ever: pinned blocks are never freed
            raise InvalidRequestError(
                f"request needs {need} KV blocks for {need_tokens} tokens; the pool has "
                f"{self.kv.gpu.num_blocks}, of which {self.kv.gpu.num_pinned} are pinned "
                f"(only {usable} can be its): lower max_tokens, or unpin prefixes")
        if params.structured is not None:
            structured = self.structured_outputs()  # (the simulator refuses here)
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            index=next(self._indices), root_hash=root_hash(self.runner.model_id, cache_salt),
            pinned_root=root_hash(self.runner.model_id, None) if cache_salt else None,
            block_size=self.config.block_size, priority=priority, job_id=job_id,
            tenant=tenant, eos_token_ids=self.tokenizer.eos_token_ids,
            fork_pending=params.n > 1)
        self._follow_text(request_id, params)
        self.kv.read_ahead(request.block_hashes)  # (its blocks on disk, before admission)
        if params.structured is None:
            self.scheduler.add(request)
        else:  # queued once its grammar is compiled, beside the step loop
            self.scheduler.add(request, compiling=True)
            structured.compile(params.structured).add_done_callback(
                lambda compiled: self._compiled.append((request, compiled)))
        self.version += 1

    def _make_sample(self, parent: Request, i: int) -> Request:
        """Sample i of a forked request: the parent's prompt and place, its own id
        ("<parent>/<i>"), seed (the parent's + i, if it has one), detokenizer and grammar
        matcher. The scheduler gives it the parent's blocks."""
        params = dataclasses.replace(
            parent.sampling_params, n=1,
            seed=None if parent.sampling_params.seed is None else parent.sampling_params.seed + i)
        request_id = f"{parent.request_id}/{i}"
        self._detok.pop(parent.request_id, None)  # the parent itself never outputs
        self._follow_text(request_id, params)
        return Request(
            request_id=request_id, prompt_token_ids=parent.prompt_token_ids,
            sampling_params=params, arrival_time=parent.arrival_time,
            index=next(self._indices), root_hash=parent.root_hash,
            pinned_root=parent.pinned_root, block_size=parent.block_size,
            priority=parent.priority, job_id=parent.job_id, tenant=parent.tenant,
            eos_token_ids=parent.eos_token_ids,
            grammar=None if parent.compiled_grammar is None
            else self._structured.matcher(parent.compiled_grammar),
            compiled_grammar=parent.compiled_grammar, parent_id=parent.request_id,
            sample_index=i, prompt_logprobs=list(parent.prompt_logprobs))

    def _follow_text(self, request_id: str, params: SamplingParams) -> None:
        """Detokenise the request's output here, if this engine keeps text."""
        if self.detokenize:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop,
                                                             params.min_tokens)

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

    def _queue_compiled(self) -> None:
        """Requests whose constraint the compile thread is done with: queued with their
        matcher, or ended alone (finish_reason "error") if xgrammar refused it. One
        aborted while it compiled is gone already."""
        while self._compiled:
            request, compiled = self._compiled.popleft()
            if self.scheduler.compiling.get(request.request_id) is not request:
                continue
            self.version += 1
            error = compiled.exception()
            if error is None:
                request.compiled_grammar = compiled.result()
                request.grammar = self._structured.matcher(request.compiled_grammar)
                self.scheduler.release(request)
            else:
                request.error = str(error)
                self.scheduler.finish(request, RequestStatus.FINISHED, "error")
                self._pending.append(request)

    def _usable_blocks(self, token_ids: list[int], cache_salt: str | None) -> int:
        """Blocks a request with this prompt could ever hold: the unpinned ones, plus the
        pinned blocks of its own cached prefix (it shares those)."""
        shared = 0
        for salt in {cache_salt, None}:  # a salted request shares pinned unsalted blocks
            hashes = hash_blocks(root_hash(self.runner.model_id, salt), token_ids,
                                 self.config.block_size)
            shared = max(shared, sum(b.pinned for b in self.kv.cached_chain(hashes)))
        return self.kv.gpu.num_blocks - self.kv.gpu.num_pinned + shared

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or bool(self._moved)

    # --- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns outputs of requests that made progress or ended."""
        return [self._output(core) for core in self.step_core()]

    def step_core(self) -> list[CoreOutput]:
        """Run one batch and report progress as token ids only (no text): each request
        that made progress or ended, with the tokens it gained this step (and its KV
        story, when that changed)."""
        outputs = self._step_core()
        if self.stories is not None:
            self._attach_stories(outputs)
        return outputs

    def _attach_stories(self, outputs: list[CoreOutput]) -> None:
        stories = self.stories
        stories.drain()
        if stories.awaiting_first_token:
            now, requests = time.time(), self.scheduler.requests
            for rid in list(stories.awaiting_first_token):
                request = requests.get(rid)
                if request is not None and request.output_token_ids:
                    stories.first_token(rid, now)
        changed = stories.changed
        if changed:
            for o in outputs:
                if o.request_id in changed:
                    o.kv_story = stories.story(o.request_id)
                    changed.discard(o.request_id)
            stories.forget_ended_changes()

    def kv_story(self, request_id: str) -> dict | None:
        """The request's KV story (engine/observe/story.py) while it runs and for a while
        after it ended; None if unknown or kv_history_blocks is 0."""
        if self.stories is None:
            return None
        self.stories.drain()
        return self.stories.story(request_id)

    def _step_core(self) -> list[CoreOutput]:
        if self._compiled:
            self._queue_compiled()
        ended, self._pending = self._pending, []
        outputs = [self.core_output(request, []) for request in ended]
        if self._moved:
            outputs += self._moved
            self._moved = []
        if self.paused:  # (aborts still end while paused)
            return outputs
        started = time.perf_counter()
        self.events.step = self.step_count + 1
        out = self.scheduler.schedule()
        if not out.has_work:
            return outputs
        self.step_count += 1
        self.version += 1
        self._inflight = out
        result = self.runner.execute(out)
        if result.prompt_logprobs:  # before update_from_output, which may fork
            self._keep_prompt_logprobs(out, result.prompt_logprobs)
        progressed = self.scheduler.update_from_output(out, result.tokens)
        self._inflight = None
        # As core_output, inline: this runs for every request in every step.
        ended_states = _ENDED
        outputs += [CoreOutput(r.request_id, [r.output_token_ids[-1]],
                               r.status in ended_states, r.finish_reason,
                               len(r.prompt_token_ids), r.num_cached_tokens or 0,
                               r.num_preemptions, None, r) for r in progressed]
        for o in outputs:  # the prompt's logprobs travel once, with the first token
            if o.request.prompt_logprobs and len(o.request.output_token_ids) == 1 \
                    and o.new_token_ids:
                o.prompt_logprobs = o.request.prompt_logprobs
        logprobs = result.logprobs
        if logprobs:  # only requests that asked for them
            for o in outputs:
                entry = logprobs.get(o.request_id)
                if entry is not None:
                    o.logprobs = [entry]
                    o.request.output_logprobs.append(entry)
        now = time.time()
        self._prompt_rate.record(now, self.scheduler.counters.num_prompt_tokens)
        self._gen_rate.record(now, self.scheduler.counters.num_generation_tokens)
        if self._kv_events is not None:
            self._publish_kv_events()
        self.step_seconds += time.perf_counter() - started
        return outputs

    def _publish_kv_events(self) -> None:
        """This step's (or command's) prefix-cache changes, as one vLLM KVEventBatch."""
        self._kv_publisher.publish(self._kv_translator.translate(self._kv_events.take()))

    @staticmethod
    def _keep_prompt_logprobs(out, computed: dict[str, list]) -> None:
        """Append this step's prompt-token logprobs to their requests, in prompt order
        (positions a recompute scores again are not appended twice)."""
        requests = {s.request.request_id: s.request for s in out.scheduled}
        for request_id, entries in computed.items():
            request = requests[request_id]
            kept = request.prompt_logprobs
            if not kept:
                kept.append([request.prompt_token_ids[0], None, [], []])
            for position, logprob, ids, values in entries:
                if position == len(kept) - 1:
                    kept.append([request.prompt_token_ids[position + 1], logprob, ids, values])

    @staticmethod
    def core_output(request: Request, new_token_ids: list[int]) -> CoreOutput:
        # Positional and without the status property: this runs for every request in
        # every step.
        return CoreOutput(request.request_id, new_token_ids, request.status in _ENDED,
                          request.finish_reason, len(request.prompt_token_ids),
                          request.num_cached_tokens or 0, request.num_preemptions, None,
                          request, None, request.error)

    def _output(self, core: CoreOutput) -> RequestOutput:
        """The full output of a request, its text detokenised here (a stop string found
        now ends the request)."""
        request = core.request
        detok = self._detok.get(request.request_id)
        if detok is not None:
            detok.add(core.new_token_ids)
            if detok.stopped and not request.status.is_finished:
                self.scheduler.finish(request, RequestStatus.FINISHED, "stop")
        finished = request.status.is_finished
        delta = detok.take_delta(finished) if detok is not None else ""
        output = self._request_output(request, delta)
        if finished:
            self._detok.pop(request.request_id, None)
        return output

    def _request_output(self, request: Request, text_delta: str = "") -> RequestOutput:
        """A request's output as it stands (its text so far, if this engine keeps it)."""
        detok = self._detok.get(request.request_id)
        return RequestOutput(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            text=detok.text if detok is not None else "",
            finished=request.status.is_finished, finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_preemptions=request.num_preemptions, text_delta=text_delta,
            logprobs=list(request.output_logprobs)
            if request.sampling_params.logprobs is not None else None,
            prompt_logprobs=list(request.prompt_logprobs)
            if request.sampling_params.prompt_logprobs is not None else None,
            error=request.error)

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order."""
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("give one SamplingParams, or one per prompt")
        base = f"gen-{next(self._snapshot_seq)}-"
        ids = [f"{base}{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p)
        # A prompt with n > 1 ends when its n samples have.
        waiting = {sid for rid, p in zip(ids, params)
                   for sid in ([rid] if p.n == 1 else [f"{rid}/{i}" for i in range(p.n)])}
        final: dict[str, RequestOutput] = {}
        while waiting:
            for o in self.step():
                if o.error is not None:  # (before it forked, with n > 1)
                    for other in ids:
                        if other != o.request_id and self.scheduler.live_requests(other):
                            self.abort(other)
                    raise InvalidRequestError(f"request {o.request_id}: {o.error}")
                if o.finished:
                    final[o.request_id] = o
                    waiting.discard(o.request_id)
        outputs = []
        for rid, p in zip(ids, params):
            if p.n == 1:
                outputs.append(final[rid])
                continue
            samples = [final[f"{rid}/{i}"] for i in range(p.n)]
            outputs.append(dataclasses.replace(samples[0], request_id=rid, samples=samples))
        return outputs

    def recover_from_failed_step(self) -> list[str]:
        """After step() raised: end the requests of the failed batch (their K/V may be
        half-written), forget cache entries the batch was to fill, and leave every other
        request as it was. Returns the ids of the ended requests."""
        self.version += 1
        out, self._inflight = self._inflight, None
        self.kv.forget_uncomputed()
        victims = [s.request for s in out.scheduled] if out is not None else []
        ended = []
        for request in victims:
            if request.status.is_finished:
                continue
            self.scheduler.finish(request, RequestStatus.ABORTED, "abort")
            self._detok.pop(request.request_id, None)
            ended.append(request.request_id)
        return ended

    # --- operator commands -------------------------------------------------------------
    def abort(self, request_id: str) -> RequestOutput:
        """End a request now; the next step reports it (finish_reason "abort"). Returns
        its output so far."""
        self.version += 1
        ended = self.scheduler.abort(request_id)
        self._pending.extend(ended)
        return self._request_output(ended[-1])

    def finish_request(self, request_id: str, reason: str = "stop") -> bool:
        """End a request as finished (its caller found a stop string in its text); the
        next step reports it. False if it had ended already. A forked request's id ends
        all its live samples."""
        ended = self.scheduler.live_requests(request_id)
        if not ended:
            return False
        self.version += 1
        for request in ended:
            self.scheduler.finish(request, RequestStatus.FINISHED, reason)
        self._pending.extend(ended)
        return True

    # --- moving a request to another engine (engine/transfer/migration.py) ---------------------
    def migration_offer(self, request_id: str) -> dict:
        """Source: a running request's state and block hashes, for a destination's check."""
        migration.check_movable(self)
        samples = migration.live_fork(self, request_id)  # (a fork: all its samples)
        if samples is not None:
            return migration.fork_state(self, request_id, samples)
        request = self.scheduler.get_live(request_id)
        if request.status is not RequestStatus.RUNNING:
            raise InvalidStateError(f"request {request_id!r} is {request.status.value}: only "
                                    "a running request moves")
        if request.fork_pending or request.parent_id is not None:
            raise InvalidStateError(f"request {request_id!r} is (part of) a fork: its samples "
                                    "move together, by its id, once it has forked")
        return migration.state_of(self, request)

    def migration_check(self, offer: dict) -> dict:
        """Destination: refuses a request that cannot come here; else the leading blocks
        it caches already ({"cached_blocks": k, "free_blocks": n})."""
        return migration.check(self, offer)

    def migrate_out(self, request_id: str, skip_blocks: int = 0) -> tuple[dict, object]:
        """Source: the request leaves the batch (its blocks kept until migration_done);
        its state and its computed tokens' K/V from block skip_blocks on."""
        self.version += 1
        return migration.take_out(self, request_id, skip_blocks)

    def migration_commit(self, state: dict, blocks, skip_blocks: int = 0) -> dict:
        """Destination: the request runs here from the next step (MigrationFailed, and
        nothing changed, if it cannot now)."""
        result = migration.commit(self, state, blocks, skip_blocks)
        if self.detokenize:  # the text so far was the source's to deliver
            for sample in state.get("samples") or [state]:
                self._follow_text(sample["request_id"], self.scheduler.requests[
                    sample["request_id"]].sampling_params)
                detok = self._detok.get(sample["request_id"])
                if detok is not None:
                    detok.add(sample["output_token_ids"])
                    detok.take_delta(False)
        return result

    def migration_reserve(self, offer: dict) -> dict:
        """Destination, for a staged copy: blocks held for the offer's full computed
        blocks ({"cached_blocks": k}: the source stages from k on)."""
        return migration.reserve(self, offer)

    def migration_stage(self, request_id: str, start_block: int,
                        end_block: int | None = None) -> tuple[object, int]:
        """Source, while the request runs: its full computed blocks' K/V from
        start_block on (below end_block: what the destination holds), and the index
        after them."""
        return migration.stage(self, request_id, start_block, end_block)

    def migration_write(self, request_id: str, start_block: int, blocks) -> None:
        """Destination: staged K/V into the held blocks."""
        migration.write(self, request_id, start_block, blocks)

    def migration_cancel(self, request_id: str) -> None:
        """Destination: a staged copy stopped; its held blocks go back."""
        migration.cancel(self, request_id)

    def migration_done(self, request_id: str, moved: bool, to: str | None = None,
                       reason: str = "migration") -> None:
        """Source: the request ended here (moved to engine `to`; `reason`: "migration",
        or "decode" for a prefill engine's hand-over), or runs on here (the commit
        failed)."""
        self.version += 1
        migration.done(self, request_id, moved, to, reason)
        if moved:
            self._detok.pop(request_id, None)

    def report_moved(self, output: CoreOutput) -> None:
        """A moved request's last output here or first one (engine/transfer/migration.py): the
        next step reports it."""
        self._moved.append(output)

    def unreport_moved(self, request_id: str) -> None:
        """A request that came here and was given back: its first output is not said."""
        self._moved = [o for o in self._moved if o.request_id != request_id]

    def next_request_index(self) -> int:
        """A new request's engine-wide number (snapshots' block owner id)."""
        return next(self._indices)

    def preempt(self, request_id: str, by: str = "operator") -> dict:
        """Preempt a running request (by: who asked, for its KV story)."""
        self.version += 1
        request = self.scheduler.preempt(request_id, by)
        return {"request_id": request_id, "status": request.status.value,
                "num_preemptions": request.num_preemptions}

    def swap_out(self, request_id: str, by: str = "operator") -> dict:
        self.version += 1
        mapping = self.scheduler.swap_out(request_id, by)
        self.runner.swap_out(mapping)
        return {"request_id": request_id, "status": "swapped", "num_blocks": len(mapping),
                "cpu_block_table": self.kv.cpu_block_ids(request_id)}

    def swap_in(self, request_id: str) -> dict:
        self.version += 1
        mapping = self.scheduler.swap_in(request_id)
        self.runner.swap_out(self.kv.flush_offloads())  # reused cached blocks' data first
        self.runner.swap_in(mapping)
        table = self.kv.block_ids(request_id)
        return {"request_id": request_id, "status": "running",
                "num_blocks": self.kv.num_blocks_held(request_id),
                "num_blocks_copied": len(mapping), "block_table": table}

    def pause(self) -> dict:
        """Stop running steps; every request keeps its place and its KV blocks, and new
        ones wait (vLLM's /pause). Operator commands still apply."""
        self.paused = True
        self.version += 1
        return {"state": "paused", "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting)}

    def resume(self) -> dict:
        self.paused = False
        self.version += 1
        return {"state": self.state}

    def drain(self) -> dict:
        self.draining = True
        self.version += 1
        return {"state": self.state, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting)}

    def undrain(self) -> dict:
        self.draining = False
        self.version += 1
        return {"state": self.state}

    def set_limits(self, max_num_seqs: int | None = None,
                   max_num_batched_tokens: int | None = None) -> dict:
        """Change the batch limits between two steps (an operator's live tuning). Each
        must lie in [1 (16 for the token budget), its value at start]. A lower
        max_num_seqs preempts nobody: admissions wait until the batch is below it."""
        changes = {"max_num_seqs": max_num_seqs,
                   "max_num_batched_tokens": max_num_batched_tokens}
        for name, value in changes.items():
            if value is None:
                continue
            low = 16 if name == "max_num_batched_tokens" else 1
            if isinstance(value, bool) or not isinstance(value, int) or \
                    not low <= value <= self.limit_caps[name]:
                raise InvalidRequestError(
                    f"{name} must be an integer in [{low}, {self.limit_caps[name]}] (its "
                    f"value at start bounds it), got {value!r}")
        for name, value in changes.items():
            if value is not None:
                setattr(self.config, name, value)
        self.version += 1
        return {"max_num_seqs": self.config.max_num_seqs,
                "max_num_batched_tokens": self.config.max_num_batched_tokens,
                "caps": dict(self.limit_caps)}

    @property
    def state(self) -> str:
        """ready, paused, draining (requests left) or drained: an operator's doing."""
        if self.paused:
            return "paused"
        if self.draining:
            return "draining" if self.has_unfinished_requests() else "drained"
        return "ready"

    def has_work_to_run(self) -> bool:
        """Whether a step now would do anything: requests and not paused, or ended
        requests (an abort while paused) to report."""
        return bool(self._pending) or bool(self._compiled) or bool(self._moved) or (
            not self.paused and self.scheduler.has_queued())

    def evict_cached_blocks(self, n: int | None = None, by: str = "operator") -> int:
        """Drop up to n refcount-0 cached blocks (all if None), LRU first (by: who
        asked, named where the blocks' hashes are explained)."""
        self.version += 1
        if n is not None and (not isinstance(n, int) or n < 0):
            raise InvalidRequestError("n must be a non-negative integer or None")
        evicted = self.kv.evict(n, by)
        if self._kv_events is not None:
            self._publish_kv_events()
        return evicted

    def reset_prefix_cache(self, by: str = "operator") -> dict:
        self.version += 1
        result = self.kv.reset_prefix_cache(by)
        if self._kv_events is not None:
            self._publish_kv_events()
        return result

    def pin_prefix(self, prompt: str | list[int], cache_salt: str | None = None,
                   soft: bool = False, priority: int = 0, ttl_s: float = 3600.0) -> dict:
        """Pin the cached blocks of this prefix so they are never evicted. soft: keep
        them over every block not soft-pinned instead, for ttl_s (each hit renews it),
        by priority among soft pins (a lower value is kept longer): they are evicted
        when nothing else is left, so a soft pin takes nothing from a request."""
        self.version += 1
        blocks = self._prefix_blocks(prompt, cache_salt)
        if soft:
            if not ttl_s > 0:
                raise InvalidRequestError("a soft pin's ttl_s must be positive")
            newly = self.kv.soft_pin(blocks, priority, ttl_s)
            return {"block_ids": [b.block_id for b in blocks], "num_newly_pinned": len(newly),
                    "num_tokens": len(blocks) * self.config.block_size, "soft": True,
                    "priority": priority, "ttl_s": ttl_s}
        self._check_pin_budget(blocks)
        self._check_pin_leaves_room(blocks)
        newly = self.kv.pin(blocks)
        return {"block_ids": [b.block_id for b in blocks], "num_newly_pinned": len(newly),
                "num_tokens": len(blocks) * self.config.block_size}

    def _blocks_for(self, num_tokens: int) -> int:
        """Most GPU blocks a request of num_tokens holds at once: where layers slide, a
        window and a step's chunk (in each sliding layer group's table)."""
        windows = self.runner.kv_group_windows or (self.runner.sliding_window,)
        return blocks_for(num_tokens, self.config.block_size, windows,
                          self.config.max_num_batched_tokens)

    def _check_pin_budget(self, blocks: list) -> None:
        """NotEnoughBlocksError if, with these blocks pinned too, pins would hold more
        of the pool than the pin budget allows."""
        gpu = self.kv.gpu
        newly = sum(1 for b in blocks if not b.pinned)
        allowed = int(self.pin_budget * gpu.num_blocks)
        if gpu.num_pinned + newly > allowed:
            raise NotEnoughBlocksError(
                f"pinning {newly} more blocks would make {gpu.num_pinned + newly} pinned, over "
                f"the pin budget of {allowed} blocks ({self.pin_budget:.0%} of "
                f"{gpu.num_blocks}): unpin a prefix, or raise the budget")

    def set_retention(self, pin_budget: float | None = None,
                      eviction_policy: str | None = None) -> dict:
        """Change what the prefix cache keeps, live: the pin budget (a share of the GPU
        pool, 0-1; pins above a lowered budget stay, new ones are refused) and the GPU
        pool's eviction policy (its free blocks ranked anew, in their order)."""
        if pin_budget is not None and (
                isinstance(pin_budget, bool) or not isinstance(pin_budget, (int, float))
                or not 0.0 <= pin_budget <= 1.0):
            raise InvalidRequestError("pin_budget must be a number in [0, 1]")
        if eviction_policy is not None and eviction_policy not in EVICTION_POLICIES:
            raise InvalidRequestError(f"eviction_policy must be one of "
                                      f"{', '.join(EVICTION_POLICIES)}")
        if pin_budget is not None:
            self.pin_budget = float(pin_budget)
        if eviction_policy is not None:
            self.kv.gpu.set_eviction_policy(eviction_policy)
        self.version += 1
        return self.retention()

    def retention(self) -> dict:
        gpu = self.kv.gpu
        return {"pin_budget": self.pin_budget,
                "pin_budget_blocks": int(self.pin_budget * gpu.num_blocks),
                "num_pinned_blocks": gpu.num_pinned, "eviction_policy": gpu.eviction_policy}

    def _check_pin_leaves_room(self, blocks: list) -> None:
        """NotEnoughBlocksError if, with these blocks pinned too, a request already here
        could never hold all the blocks it needs (it would preempt itself for ever)."""
        pinned = {b.block_id for b in self.kv.gpu.blocks if b.pinned} | \
            {b.block_id for b in blocks}
        free_for_all = self.kv.gpu.num_blocks - len(pinned)
        for request in self.scheduler.requests.values():
            need = self._blocks_for(min(request.num_prompt_tokens
                                        + request.sampling_params.max_tokens, self.max_model_len))
            own = sum(b in pinned for b in self.kv.block_ids(request.request_id))
            if need > free_for_all + own:
                raise NotEnoughBlocksError(
                    f"pinning {len(blocks)} blocks would leave {free_for_all} unpinned blocks "
                    f"of {self.kv.gpu.num_blocks}; request {request.request_id} needs {need}: "
                    "it could never run. Pin later, or a shorter prefix")

    def unpin_prefix(self, prompt: str | list[int], cache_salt: str | None = None,
                     soft: bool = False) -> dict:
        self.version += 1
        blocks = self._prefix_blocks(prompt, cache_salt)
        released = self.kv.soft_unpin(blocks) if soft else self.kv.unpin(blocks)
        return {"block_ids": [b.block_id for b in blocks], "num_unpinned": len(released),
                "num_tokens": len(blocks) * self.config.block_size}

    unpin = unpin_prefix

    def _prefix_blocks(self, prompt: str | list[int], cache_salt: str | None) -> list:
        token_ids = self._prompt_ids(prompt)
        bs = self.config.block_size
        if len(token_ids) < bs:
            raise InvalidRequestError(
                f"a prefix needs at least one full block ({bs} tokens); got {len(token_ids)}")
        hashes = hash_blocks(root_hash(self.runner.model_id, cache_salt), token_ids, bs)
        blocks = self.kv.cached_chain(hashes)
        if not blocks:
            raise PrefixNotCachedError(
                "no block of this prefix is cached; run a request with it first")
        return blocks

    # --- observation ---------------------------------------------------------------
    def snapshot(self, compact: bool = False) -> dict:
        """JSON-serialisable KV state; compact=True encodes per-block arrays in base64.
        Built as the live view builds its own (engine/observe/view.py's KVMirror), from one
        full export: one builder for this, the dashboard and the timeline's keyframes."""
        from engine.observe.view import KVMirror

        mirror = KVMirror(self.config.name, "", self.describe_config())
        mirror.apply(self.export_kv([], full_scan=True, pins=True))
        doc = mirror.snapshot(compact)
        del doc["type"], doc["epoch"]
        doc["seq"] = self.next_snapshot_seq()
        return doc

    def export_kv(self, events: list[KVEvent], full_scan: bool, pins: bool) -> KVExport:
        """The KV state as viewers may keep it (engine/kv/export.py), built by its owners
        on this (the loop's) thread: the scheduler's request rows, the KV core's tables
        per pool (with pins and a copy of the hash map when asked), the eviction order,
        the metrics, and `events` (taken by the caller) riding along."""
        kv = self.kv
        rows, index_of = self.scheduler.export_rows(kv.window_freed_counts)
        return KVExport(
            ts=time.time(), step=self.step_count, version=self.version, requests=rows,
            gpu=kv.export_pool("gpu", index_of, full_scan, pins),
            cpu=kv.export_pool("cpu", index_of, full_scan, pins),
            eviction_order=kv.gpu.eviction_order(EVICTION_ORDER_LEN), metrics=self.metrics(),
            events=events, events_on=self.config.max_pending_events > 0)

    def next_snapshot_seq(self) -> int:
        return next(self._snapshot_seq)

    def take_events(self) -> list[KVEvent]:
        return self.events.take()

    def _disk_tier(self, above: BlockPool, unwritten: AbstractSet[int]) -> PrefixTier:
        """The disk tier of config.disk_cache_dir below the pool `above` (the KV core
        builds its chain with it), its blocks marked with what they mean here (a block
        of another model, K/V format or block size is never read); `unwritten`: that
        pool's blocks whose data the coming step writes."""
        from engine.kv.tiers.disk import DiskStore, DiskTier
        identity = {"model": self.runner.model_id, "kv_format": migration.kv_format(self),
                    "block_size": self.config.block_size,
                    "block_bytes": self.runner.block_bytes}
        secret = self.config.secret.encode() if self.config.secret is not None else None
        store = DiskStore(self.config.disk_cache_dir, self.config.disk_cache_bytes, identity,
                          secret)
        return DiskTier(store, above, self.events,
                        functools.partial(self.runner.read_pool_block, above.pool),
                        functools.partial(self.runner.write_pool_block, above.pool),
                        self.config.disk_cache_min_hits, unwritten)

    def close(self) -> None:
        """Release what the runner started (a split model's rank processes) and the KV
        event publisher's sockets."""
        if self._kv_publisher is not None:
            close = getattr(self._kv_publisher, "close", None)
            if close is not None:
                close()
            self._kv_publisher = None
        if self._structured is not None:
            self._structured.close()
        self.kv.close()  # (the disk tier's writes under way finish first)
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def describe_config(self) -> dict:
        return {"block_size": self.config.block_size, "num_gpu_blocks": self.kv.gpu.num_blocks,
                "num_cpu_blocks": self.kv.cpu.num_blocks, "model": self.runner.model_id,
                "dtype": self.runner.dtype, "device": self.runner.device,
                "max_model_len": self.max_model_len, "vocab_size": self.runner.vocab_size,
                "max_num_seqs": self.config.max_num_seqs,
                "max_num_batched_tokens": self.config.max_num_batched_tokens,
                "preemption_mode": self.config.preemption_mode,
                "scheduling_policy": self.config.scheduling_policy,
                "enable_prefix_caching": self.config.enable_prefix_caching,
                "cpu_prefix_cache": self.kv.cpu_tier,
                "eviction_policy": self.kv.gpu.eviction_policy,
                "pin_budget": self.pin_budget,
                # the disk tier below it (disk_cache_dir): where, and how many bytes
                "disk_cache_dir": self.config.disk_cache_dir or None,
                "disk_cache_bytes": self.config.disk_cache_bytes
                if self.config.disk_cache_dir else 0,
                # one block's K/V, every layer (what a tier or a move copies per block)
                "kv_bytes_per_block": self.runner.block_bytes,
                # how K/V is stored: the model's dtype ("auto") or fp8, and how its
                # bytes read (an fp8 cache's scales; blocks move only between alike)
                "kv_cache_dtype": self.config.kv_cache_dtype,
                "kv_cache_scales": self.config.kv_cache_scales
                if self.config.kv_cache_dtype != "auto" else None,
                "kv_format": self.runner.kv_format,
                "simulate": self.config.simulate,
                "sliding_window": self.runner.sliding_window,
                # a hybrid model's layer groups: each one's window (None: global)
                "kv_group_windows": list(self.runner.kv_group_windows)
                if self.runner.kv_group_windows else None,
                "tensor_parallel_size": getattr(self.runner, "tensor_parallel_size", 1),
                "role": self.config.role,
                # per rank: device, weight, KV and swap bytes (a real model)
                "rank_memory": getattr(self.runner, "rank_memory", None),
                "model_path": getattr(self.runner, "model_path", None),
                # the HF folder of the tokenizer (a real model's folder; the simulator's
                # when it has one; None: the simulator's byte tokenizer)
                "tokenizer_path": getattr(self.runner, "tokenizer_path",
                                          getattr(self.runner, "model_path", None))}

    def metrics(self) -> dict:
        now = time.time()
        sched = self.scheduler
        c = sched.counters
        return {
            "kv_usage": self.kv.gpu.usage,
            "cpu_kv_usage": self.kv.cpu.usage,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "num_cached_blocks": len(self.kv.gpu.cached),
            # the tiers of the prefix cache (the CPU tier's, the disk's), each its own
            # hits (blocks the disk read back into the CPU tier are the disk's)
            **self.kv.tier_metrics(self.runner.block_bytes),
            "num_pinned_blocks": self.kv.gpu.num_pinned,
            "num_soft_pinned_blocks": self.kv.gpu.num_soft_pinned,
            "pin_budget": self.pin_budget,
            "eviction_policy": self.kv.gpu.eviction_policy,
            "num_preemptions": c.num_preemptions,
            "num_swaps_out": c.num_swaps_out,
            "num_swaps_in": c.num_swaps_in,
            "preemptions_by_reason": dict(c.preemptions_by_reason),
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "swapped": len(sched.swapped),
            "num_prompt_tokens": c.num_prompt_tokens,
            "num_generation_tokens": c.num_generation_tokens,
            "prompt_tokens_per_s": self._prompt_rate.rate(now),
            "generation_tokens_per_s": self._gen_rate.rate(now),
            "num_steps": self.step_count,
            "step_seconds": self.step_seconds,
            "state": self.state,  # (an operator's pause or drain)
            # Load, for routing: tokens the engine still has to hold or compute.
            "running_tokens": sum(r.num_tokens for r in sched.running),
            "waiting_tokens": sum(r.num_tokens for r in sched.waiting),
            # the KV history's: tokens missed by reason, block residency histograms
            **(self.stories.metrics() if self.stories is not None else {}),
        }
