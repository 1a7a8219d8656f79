"""LLMEngine: the public face of the engine (the engine's contract in docs/design.md).

One thread drives it. step() is schedule -> run -> update -> outputs; the rest is the
job of a component each, built here over the same scheduler, KV core and runner:
* InputProcessor (engine/input_processor.py): a prompt and its SamplingParams checked,
  tokenised, made a Request and queued; a fork's samples;
* OutputProcessor (engine/output_processor.py): a step's progress as outputs, and their
  text (a stop string ends the request);
* Migrator (engine/transfer/migration.py): a request moving to or from another engine;
* Pins (engine/kv/pins.py): the pinned prefixes and the pin budget;
* Reporter (engine/observe/reporter.py): the description, the metrics and the KV export.
Operator commands act immediately and must be called between steps from the same thread
(the service queues them and applies them between steps).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import time

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.input_processor import InputProcessor
from engine.kv.coordinator import KVCacheCoordinator
from engine.kv.events import EventLog, KVEvent
from engine.kv.export import KVExport
from engine.kv.pins import Pins
from engine.kv.tenant_cache import check_share
from engine.model.build import build_disk_tier, build_runner
from engine.model.runner import Flight, Runner, StepResult
from engine.observe.reporter import Reporter
from engine.observe.step_cost import StepCostModel, StepShape
from engine.observe.story import STORY_QUEUE_MAX, StoryBook
from engine.output_processor import OutputProcessor
from engine.outputs import CoreOutput, RequestOutput, core_output
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.sched.fairness import check_weight
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.transfer.migration import Migrator


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: Runner | None = None,
                 detokenize: bool = True, kv_events=None) -> None:
        """detokenize: False when the caller drives step_core() and turns token ids into
        text itself (the engine core process, whose worker detokenises). kv_events: where
        the prefix cache's changes go as vLLM KVEventBatch events (anything with
        publish(events)); by default the ZMQ publisher of config.kv_events_endpoint, if
        set."""
        self.config = config
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
                                     tenant_cache_quota=config.tenant_cache_quota,
                                     disk_tier=functools.partial(build_disk_tier, config,
                                                                 self.runner, self.events)
                                     if config.disk_cache_dir else None)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len, self.events)
        # requests' KV stories (engine/observe/story.py), read from the event stream
        self.stories = StoryBook(config.name, config.kv_history_blocks,
                                 self.events.subscribe(STORY_QUEUE_MAX),
                                 sample=config.kv_metrics_sample,
                                 held=self.kv.block_seconds.spent) \
            if config.kv_history_blocks else None
        self.kv.stories = self.stories
        self.pins = Pins(self.kv, self.runner.model_id, config.pin_budget)
        self.input_processor = InputProcessor(config, self.runner, self.scheduler, self.kv,
                                              self.pins)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, detokenize)
        # a request moving to or from another engine: callers drive it (migrator.offer...)
        self.migrator = Migrator(config, self.scheduler, self.kv, self.runner, self.stories,
                                 self.input_processor, self.output_processor,
                                 lambda: self.state, lambda: self.settle())
        self.reporter = Reporter(config, self.runner, self.kv, self.scheduler, self.pins,
                                 self.stories)
        self.scheduler.make_sample = self._make_sample
        self.step_count = 0
        self.step_seconds = 0.0  # wall time inside the steps that ran (schedule to outputs)
        self.step_costs = StepCostModel()  # what a step of each shape costs (the what-if's)
        self.last_step_shape: StepShape | None = None
        self._changes = 0  # this object's share of version (the Migrator counts its own)
        self._snapshot_seq = itertools.count(1)
        self._pending: list[Request] = []  # ended by abort or finish_request, not reported yet
        self._inflight = None  # the SchedulerOutput being run, until its update is done
        # Async scheduling: the step after is scheduled and issued before a step's tokens
        # are read back (on the device they feed the next step; Runner.launch), so the
        # host's work overlaps the device's. _flight: the step issued and sampled, not read
        # back; _settled: outputs of a flight that a command read back early (settle),
        # handed out with the next step's
        wanted = config.async_scheduling
        if wanted is None:
            wanted = self.runner.device == "cuda"
        self.async_scheduling = bool(wanted) and self.runner.supports_async
        self._flight: tuple[SchedulerOutput, Flight] | None = None
        self._settled: list[CoreOutput] = []
        # An operator's pause: no step runs (requests and their KV stay) until resume()
        self.paused = False
        # An operator's drain: the service routes no new jobs here; the engine reports
        # draining until its last request ends, then drained (it still runs what it gets)
        self.draining = False
        # the prefix cache's changes in vLLM's format (engine/observe/vllm_events.py), if
        # anyone reads them
        self._kv_events_out = None
        if kv_events is not None or config.kv_events_endpoint:
            from engine.observe.vllm_events import KVEventsOut
            self._kv_events_out = KVEventsOut(
                config, self.events, self.kv.gpu.num_blocks + self.kv.cpu.num_blocks, kv_events)

    # --- requests ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, job_id: str | None = None,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    tenant: str | None = None) -> None:
        """Queue a request. Raises InvalidRequestError for a bad prompt or id. `tenant`:
        who asked (Request.tenant), for the batch share and for viewers."""
        request = self.input_processor.add(request_id, prompt, params, priority, job_id,
                                           cache_salt, arrival_time, tenant)
        self.output_processor.follow(request.request_id, params)
        self._changes += 1

    def _make_sample(self, parent: Request, i: int) -> Request:
        """Sample i of a forked request (InputProcessor.sample), its text followed."""
        sample = self.input_processor.sample(parent, i)
        self.output_processor.forked(parent.request_id, sample.request_id,
                                     sample.sampling_params)
        return sample

    @property
    def version(self) -> int:
        """Grows with every change to requests or blocks (for publishers)."""
        return self._changes + self.migrator.changes

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or \
            self.migrator.has_reports or self._flight is not None or bool(self._settled)

    # --- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns outputs of requests that made progress or ended."""
        return [self.output_processor.output(core) for core in self.step_core()]

    def step_core(self) -> list[CoreOutput]:
        """Run one batch and report progress as token ids only (no text): each request
        that made progress or ended, with the tokens it gained this step (and its KV
        story, when that changed)."""
        outputs = self._step_core()
        if self.stories is not None:
            self.stories.hand_out(outputs, self.scheduler.requests)
        return outputs

    def _step_core(self) -> list[CoreOutput]:
        if self.input_processor.has_compiled:
            self._changes += 1
            self._pending += self.input_processor.queue_compiled()
        ended, self._pending = self._pending, []
        outputs, self._settled = self._settled, []
        outputs += [core_output(request, []) for request in ended]
        outputs += self.migrator.take_reports()  # (moved here or away since the last step)
        if self.paused:  # (aborts still end while paused)
            return outputs
        if self.async_scheduling:
            return self._step_ahead(outputs)
        started = time.perf_counter()
        self.events.step = self.step_count + 1
        out = self.scheduler.schedule()
        if not out.has_work:
            return outputs
        self.step_costs.step_started(started)
        self.step_count += 1
        self._changes += 1
        self._inflight = out
        self._apply(out, self.runner.execute(out), outputs, advance=True)
        self._inflight = None
        self._step_done(started, out)
        return outputs

    def _step_ahead(self, outputs: list[CoreOutput]) -> list[CoreOutput]:
        """One step with async scheduling: the flight before advanced (its K/V is
        written, its sampled tokens pending), the next step scheduled and issued with
        those tokens as its decodes' inputs on the device, then the flight before read
        back and applied (stops, outputs) while the device runs the new one, which then
        samples from its requests' state as updated. Every token is the one a step at a
        time would give; a request that stopped on the token read back has computed one
        more, which is dropped. A step whose requests ask for prompt logprobs or fork is
        read back at once."""
        started = time.perf_counter()
        before, self._flight = self._flight, None
        if before is not None:
            self.scheduler.advance(before[0])
        self.events.step = self.step_count + 1
        out = self.scheduler.schedule()
        flight = None
        if out.has_work or before is not None:
            self.step_costs.step_started(started)
        if out.has_work:
            self.step_count += 1
            self._changes += 1
            self._inflight = (out, before[0]) if before is not None else out
            flight = self.runner.launch(out, before[1] if before is not None else None)
        if before is not None:
            self._apply(before[0], self.runner.collect(before[1]), outputs, advance=False)
        if flight is not None:
            self.runner.sample(flight)
            if _reads_back_at_once(out):
                self._apply(out, self.runner.collect(flight), outputs, advance=True)
            else:
                self._flight = (out, flight)
        elif out.has_work:  # block copies alone
            self._apply(out, StepResult(), outputs, advance=True)
        self._inflight = None
        if out.has_work or before is not None:
            self._step_done(started, out)
        else:
            self.step_seconds += time.perf_counter() - started
        return outputs

    def _apply(self, out: SchedulerOutput, result: StepResult, outputs: list[CoreOutput],
               advance: bool) -> None:
        """A step's result applied: its prompt logprobs kept (before the advance, which
        may fork the request they belong to), the batch advanced unless it was already
        (async scheduling), its tokens appended, its progress into outputs."""
        if result.prompt_logprobs:
            self.output_processor.keep_prompt_logprobs(out, result.prompt_logprobs)
        if advance:
            self.scheduler.advance(out)
        progressed = self.scheduler.apply_tokens(out, result.tokens)
        self.output_processor.add_progress(outputs, progressed, result)

    def _step_done(self, started: float, out: SchedulerOutput) -> None:
        """After a step that ran: its time (and its shape's, for the step-cost fit), the
        reporter's rate, the KV events out."""
        self.reporter.record_step(time.time())
        if self._kv_events_out is not None:
            self._kv_events_out.publish()
        ended = time.perf_counter()
        self.step_seconds += ended - started
        self.last_step_shape = StepShape.of(out)
        self.step_costs.step_ended(self.last_step_shape, started, ended,
                                   busy=self.has_work_to_run())

    def settle(self) -> None:
        """Read back and apply the step in flight (async scheduling), so that what
        follows sees every request as it is; its outputs go out with the next step's.
        Every operator command and move settles first. Nothing to do otherwise."""
        if self._flight is None:
            return
        flight, self._flight = self._flight, None
        self._changes += 1
        self._inflight = flight[0]
        self._apply(flight[0], self.runner.collect(flight[1]), self._settled, advance=True)
        self._inflight = None

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
        self._changes += 1
        out, self._inflight = self._inflight, None
        self._flight = None  # (async scheduling: the steps issued are ended below)
        self.kv.forget_uncomputed()
        outs = out if isinstance(out, tuple) else (out,) if out is not None else ()
        victims = [s.request for o in outs for s in o.scheduled]
        ended = []
        for request in victims:
            request.num_pending = 0
            if request.status.is_finished:
                continue
            self.scheduler.finish(request, RequestStatus.ABORTED, "abort")
            self.output_processor.forget(request.request_id)
            ended.append(request.request_id)
        return ended

    # --- operator commands -------------------------------------------------------------
    def abort(self, request_id: str) -> RequestOutput:
        """End a request now; the next step reports it (finish_reason "abort"). Returns
        its output so far."""
        self.settle()
        self._changes += 1
        ended = self.scheduler.abort(request_id)
        self._pending.extend(ended)
        return self.output_processor.request_output(ended[-1])

    def finish_request(self, request_id: str, reason: str = "stop") -> bool:
        """End a request as finished (its caller found a stop string in its text); the
        next step reports it. False if it had ended already. A forked request's id ends
        all its live samples."""
        self.settle()
        ended = self.scheduler.live_requests(request_id)
        if not ended:
            return False
        self._changes += 1
        for request in ended:
            self.scheduler.finish(request, RequestStatus.FINISHED, reason)
        self._pending.extend(ended)
        return True

    # --- operator commands on requests and the batch -------------------------------------
    def preempt(self, request_id: str, by: str = "operator") -> dict:
        """Preempt a running request (by: who asked, for its KV story)."""
        self.settle()
        self._changes += 1
        request = self.scheduler.preempt(request_id, by)
        return {"request_id": request_id, "status": request.status.value,
                "num_preemptions": request.num_preemptions}

    def swap_out(self, request_id: str, by: str = "operator") -> dict:
        self.settle()
        self._changes += 1
        mapping = self.scheduler.swap_out(request_id, by)
        self.runner.swap_out(mapping)
        return {"request_id": request_id, "status": "swapped", "num_blocks": len(mapping),
                "cpu_block_table": self.kv.cpu_block_ids(request_id)}

    def swap_in(self, request_id: str, by: str = "operator") -> dict:
        self.settle()
        self._changes += 1
        mapping = self.scheduler.swap_in(request_id, by)
        self.runner.swap_out(self.kv.flush_offloads())  # reused cached blocks' data first
        self.runner.swap_in(mapping)
        table = self.kv.block_ids(request_id)
        return {"request_id": request_id, "status": "running",
                "num_blocks": self.kv.num_blocks_held(request_id),
                "num_blocks_copied": len(mapping), "block_table": table}

    def pause(self) -> dict:
        """Stop running steps; every request keeps its place and its KV blocks, and new
        ones wait (vLLM's /pause). Operator commands still apply."""
        self.settle()
        self.paused = True
        self._changes += 1
        return {"state": "paused", "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting)}

    def resume(self) -> dict:
        self.paused = False
        self._changes += 1
        return {"state": self.state}

    def drain(self) -> dict:
        self.draining = True
        self._changes += 1
        return {"state": self.state, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting)}

    def undrain(self) -> dict:
        self.draining = False
        self._changes += 1
        return {"state": self.state}

    def set_limits(self, max_num_seqs: int | None = None,
                   max_num_batched_tokens: int | None = None) -> dict:
        """Change the batch limits between two steps (an operator's live tuning;
        Scheduler.set_limits)."""
        self.settle()
        result = self.scheduler.set_limits(max_num_seqs, max_num_batched_tokens)
        self._changes += 1
        return result

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
        return bool(self._pending) or self.input_processor.has_compiled or \
            self.migrator.has_reports or self._flight is not None or bool(self._settled) \
            or (not self.paused and self.scheduler.has_queued())

    # --- operator commands on the prefix cache (pins: engine/kv/pins.py) -----------------
    def evict_cached_blocks(self, n: int | None = None, by: str = "operator") -> int:
        """Drop up to n refcount-0 cached blocks (all if None), LRU first (by: who
        asked, named where the blocks' hashes are explained)."""
        self.settle()
        self._changes += 1
        if n is not None and (not isinstance(n, int) or n < 0):
            raise InvalidRequestError("n must be a non-negative integer or None")
        evicted = self.kv.evict(n, by)
        if self._kv_events_out is not None:
            self._kv_events_out.publish()
        return evicted

    def reset_prefix_cache(self, by: str = "operator") -> dict:
        self.settle()
        self._changes += 1
        result = self.kv.reset_prefix_cache(by)
        if self._kv_events_out is not None:
            self._kv_events_out.publish()
        return result

    def pin_prefix(self, prompt: str | list[int], cache_salt: str | None = None,
                   soft: bool = False, priority: int = 0, ttl_s: float = 3600.0) -> dict:
        """Pin the cached blocks of this prefix so they are never evicted; soft: kept
        over every block not soft-pinned instead, for ttl_s, by priority (Pins.pin)."""
        self.settle()
        self._changes += 1
        blocks = self.pins.prefix(self.input_processor.prompt_ids(prompt), cache_salt)
        return self.pins.pin(blocks, self.input_processor.live_needs(), soft, priority, ttl_s)

    def unpin_prefix(self, prompt: str | list[int], cache_salt: str | None = None,
                     soft: bool = False) -> dict:
        self.settle()
        self._changes += 1
        blocks = self.pins.prefix(self.input_processor.prompt_ids(prompt), cache_salt)
        return self.pins.unpin(blocks, soft)

    unpin = unpin_prefix

    def set_retention(self, pin_budget: float | None = None,
                      eviction_policy: str | None = None,
                      tenant_cache_quota: float | None = None) -> dict:
        """Change what the prefix cache keeps, live (Pins.set_retention)."""
        self.settle()
        result = self.pins.set_retention(pin_budget, eviction_policy, tenant_cache_quota)
        self._changes += 1
        return result

    def set_tenant(self, tenant: str, cache_quota: float | None = None,
                   weight: float | None = None, clear: tuple[str, ...] = ()) -> dict:
        """An operator's limits for one tenant, live: its own quota of the GPU pool's
        cached blocks (engine/kv/tenant_cache.py) and its weight under fairness "vtc"
        (engine/sched/fairness.py); `clear` names those going back to everyone's.
        Returns the tenant's limits as they now are."""
        if not isinstance(tenant, str) or not tenant or len(tenant) > 64:
            raise InvalidRequestError("tenant must be a non-empty string of at most 64 characters")
        unknown = set(clear) - {"cache_quota", "weight"}
        if unknown:
            raise InvalidRequestError(f"clear names unknown limits: {', '.join(sorted(unknown))}")
        tenants, vtc = self.kv.gpu.tenants, self.scheduler.vtc
        if cache_quota is not None:
            check_share(cache_quota, "cache_quota")
        if weight is not None:
            check_weight(weight)
            if vtc is None:
                raise InvalidRequestError("a tenant's weight needs fairness \"vtc\" "
                                          "(KVOPS_ENGINE_FAIRNESS=vtc)")
        self.settle()
        if cache_quota is not None or "cache_quota" in clear:
            tenants.set_override(tenant, cache_quota)
        if vtc is not None and (weight is not None or "weight" in clear):
            vtc.set_weight(tenant, weight)
        self._changes += 1
        return self.tenant_limits(tenant)

    def tenant_limits(self, tenant: str) -> dict:
        """One tenant's quota (its share and in blocks), cached blocks and weight."""
        vtc = self.scheduler.vtc
        return {"tenant": tenant, **self.kv.gpu.tenants.limits_of(tenant),
                **(vtc.of(tenant) if vtc is not None else
                   {"weight": None, "served_tokens": None})}

    # --- observation (engine/observe/reporter.py) -----------------------------------------
    def kv_story(self, request_id: str) -> dict | None:
        """The request's KV story (engine/observe/story.py) while it runs and for a while
        after it ended; None if unknown or kv_history_blocks is 0."""
        return self.stories.current(request_id) if self.stories is not None else None

    def lookup_prefix(self, prompt: str | list[int], cache_salt: str | None = None) -> dict:
        """How many leading tokens of this prompt (text tokenised, or token ids) each
        level of the prefix cache holds now under cache_salt, as an admission would find
        them (Reporter.lookup_prefix). Changes nothing: LMCache's lookup, Dynamo's /query.
        Raises InvalidRequestError for a prompt add_request would refuse."""
        return self.reporter.lookup_prefix(self.input_processor.prompt_ids(prompt), cache_salt)

    def snapshot(self, compact: bool = False) -> dict:
        """JSON-serialisable KV state; compact=True encodes per-block arrays in base64."""
        return self.reporter.snapshot(self.export_kv([], full_scan=True, pins=True), compact,
                                      self.next_snapshot_seq())

    def block_facts(self, pool: str, block_id: int) -> dict:
        """What a viewer hovering one block asks beyond the snapshot (Reporter.block_facts):
        its idle time, its place in the eviction order, its holders' tokens and text."""
        return self.reporter.block_facts(pool, block_id)

    def export_kv(self, events: list[KVEvent], full_scan: bool, pins: bool) -> KVExport:
        """The KV state as viewers may keep it (engine/kv/export.py), with `events`
        (taken by the caller) riding along."""
        return self.reporter.export(events, full_scan, pins, self.step_count, self.version,
                                    self.metrics())

    def next_snapshot_seq(self) -> int:
        return next(self._snapshot_seq)

    def take_events(self) -> list[KVEvent]:
        return self.events.take()

    def describe_config(self) -> dict:
        return self.reporter.describe_config()

    def metrics(self) -> dict:
        return self.reporter.metrics(self.step_count, self.step_seconds, self.state,
                                     self.step_costs.fit())

    def close(self) -> None:
        """Release what the runner started (a split model's rank processes) and the KV
        event publisher's sockets."""
        if self._kv_events_out is not None:
            self._kv_events_out.close()
            self._kv_events_out = None
        self.input_processor.close()
        self.kv.close()  # (the disk tier's writes under way finish first)
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()


def _reads_back_at_once(out: SchedulerOutput) -> bool:
    """A step read back before the next is scheduled (async scheduling): one whose
    requests ask for prompt logprobs (kept before a fork replaces the request) or are
    about to fork."""
    return any(s.request.fork_pending or s.request.sampling_params.prompt_logprobs is not None
               for s in out.scheduled)
