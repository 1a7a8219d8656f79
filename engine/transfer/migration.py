"""Moving a running request to another engine of the same model with its KV cache: the
Migrator, one engine's end of it (LLMEngine.migrator).

Between the source's steps and the destination's, in this order (a stop-and-copy):

1. `source.migrator.offer(rid)`: the request's state (everything its next tokens depend
   on: tokens, sampling parameters, its place in its seed's stream, which is its number
   of output tokens, penalties and min_tokens progress, which follow from its tokens,
   logprobs so far) and its blocks' chained hashes.
2. `destination.migrator.check(offer)`: refuses what cannot move there (another model
   or block size, no room) and says how many leading blocks it already caches: those
   are not sent.
3. `source.migrator.take_out(rid, skip)`: the request leaves the batch (its blocks kept)
   and hands over its state now and the K/V of its computed tokens' blocks from `skip`
   on.
4. `destination.migrator.commit(state, blocks, skip)`: the request takes the cached
   blocks and new ones, the K/V is written into the new ones, and it runs from the next
   step as if it had always been there. It raises (and changes nothing) if the blocks
   it said it caches were evicted since, or the pool is now short.
5. `source.migrator.done(rid, moved)`: the request ends there ("migrated"), its blocks
   freed; or, when the commit failed, it runs on there.

A staged copy keeps the pause short whatever the context (as Llumnix does): after the
offer, `destination.migrator.reserve(offer)` holds blocks for the request's full
computed blocks (its leading ones cached there; fresh ones, not findable by hash until
it runs, for the rest); between the source's steps `source.migrator.stage(rid, start,
end)` reads the full blocks computed so far (they no longer change) and
`destination.migrator.write(rid, start, blocks)` puts them in the held blocks; the stop
(`take_out` from the first block not staged, `commit`) then copies only the last blocks
and the state. `cancel` gives the held blocks back.

A structured-output request's constraint is compiled at the destination and its matcher
told the tokens made so far. A fork moves with all its samples; a request of an engine
with sliding windows or layer groups moves by one stop-and-copy of each group's live
blocks (see below). The transport between processes is engine/transfer/link.py. Not
yet: a fork of a windowed model, and a model split over ranks.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.errors import (InvalidRequestError, InvalidStateError, MigrationFailed,
                           NotEnoughBlocksError)
from engine.input_processor import InputProcessor
from engine.kv.coordinator import KVCacheCoordinator
from engine.kv.layout import cdiv
from engine.model.runner import Runner
from engine.output_processor import OutputProcessor
from engine.outputs import CoreOutput, core_output
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from engine.observe.story import StoryBook

MIGRATED = "migrated"  # the finish reason of a request on the engine it left
GRAMMAR_COMPILE_S = 30.0  # how long a destination compiles a moving request's constraint


class Migrator:
    """One engine's end of the moves, both ways (LLMEngine.migrator). It is given the
    engine's parts, never the engine, and changes requests only through the scheduler
    (suspend, resume, adopt, adopt_fork, disown, finish); the moved requests' first or
    last outputs wait in it until the engine's next step reports them (take_reports)."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, kv: KVCacheCoordinator,
                 runner: Runner, stories: StoryBook | None, input_processor: InputProcessor,
                 output_processor: OutputProcessor, engine_state: Callable[[], str],
                 settle: Callable[[], None] = lambda: None) -> None:
        """input_processor: a request's number and its grammar compiler;
        output_processor: whose text it follows (a request's text before it moved was its
        source's to deliver); engine_state: the operator's state (LLMEngine.state): only
        a "ready" engine takes a request; settle: the engine's (LLMEngine.settle), called
        before a move touches a request, so that no step is in flight."""
        self.config = config
        self.settle = settle
        self.scheduler = scheduler
        self.kv = kv
        self.runner = runner
        self.stories = stories
        self.input_processor = input_processor
        self.output_processor = output_processor
        self._engine_state = engine_state
        # requests being copied here from another engine: (request, blocks cached here)
        self.incoming: dict[str, tuple[Request, int]] = {}
        # moved here or away since the last step: their first or last output, not
        # reported yet
        self._reports: list[CoreOutput] = []
        self.changes = 0  # grows with every request it takes out, commits or ends here

    # --- what the engine's step reports ------------------------------------------------
    @property
    def has_reports(self) -> bool:
        return bool(self._reports)

    def take_reports(self) -> list[CoreOutput]:
        """The outputs of the requests moved here or away since the last call."""
        reports, self._reports = self._reports, []
        return reports

    # --- what both ends read ---------------------------------------------------------------
    def check_movable(self) -> None:
        if getattr(self.runner, "tensor_parallel_size", 1) > 1:
            raise InvalidStateError("moving a request of a model split over ranks is not "
                                    "supported yet")

    @property
    def windowed(self) -> bool:
        """Whether the engine's tables are not one plain table: a sliding window gives
        blocks back, or layer groups keep a table each. Such a request moves by one
        stop-and-copy of every group's live blocks into fresh ones (the destination's
        cache is not looked up for them)."""
        return self.kv.num_groups > 1 or self.runner.sliding_window is not None

    def state_of(self, request: Request) -> dict:
        """The request as another engine needs it (JSON-able but for nothing: hashes hex)."""
        return {
            "request_id": request.request_id, "model_id": self.runner.model_id,
            "block_size": self.config.block_size, "kv_format": self.runner.kv_format,
            "engine_seed": self.config.seed,
            "prompt_token_ids": list(request.prompt_token_ids),
            "output_token_ids": list(request.output_token_ids),
            "output_logprobs": list(request.output_logprobs),
            "prompt_logprobs": list(request.prompt_logprobs),
            "params": dataclasses.asdict(request.sampling_params),
            "priority": request.priority, "job_id": request.job_id, "tenant": request.tenant,
            "arrival_time": request.arrival_time, "root_hash": request.root_hash.hex(),
            "pinned_root": request.pinned_root.hex() if request.pinned_root else None,
            "num_computed_tokens": request.num_computed_tokens,
            "num_cached_tokens": request.num_cached_tokens or 0,
            "num_preemptions": request.num_preemptions,
            "block_hashes": [h.hex() for h in request.block_hashes],
            "engine": self.config.name,
            # (None without a history)
            "kv_story": self.stories.current(request.request_id)
            if self.stories is not None else None,
            "parent_id": request.parent_id, "sample_index": request.sample_index,
            "fork_size": len(self.scheduler.forks.get(request.parent_id, ()))
            if request.parent_id is not None else 0,
            # sliding windows or layer groups: per group, [blocks given back, blocks held]
            "groups": [[freed, len(ids)] for freed, ids in self.kv.tables_of(request.request_id)]
            if self.windowed else None,
        }

    # --- source --------------------------------------------------------------------------
    def offer(self, request_id: str) -> dict:
        """A running request's state and block hashes, for a destination's check."""
        self.settle()
        self.check_movable()
        samples = self._live_fork(request_id)  # (a fork: all its samples)
        if samples is not None:
            return self._fork_state(request_id, samples)
        request = self.scheduler.get_live(request_id)
        if request.status is not RequestStatus.RUNNING:
            raise InvalidStateError(f"request {request_id!r} is {request.status.value}: only "
                                    "a running request moves")
        if request.fork_pending or request.parent_id is not None:
            raise InvalidStateError(f"request {request_id!r} is (part of) a fork: its samples "
                                    "move together, by its id, once it has forked")
        return self.state_of(request)

    # A forked request (n > 1) is moved by its id (the parent's): every sample goes in one
    # stop-and-copy, committed together at the destination or not at all, so that a fork
    # never ends up split between two engines. It moves only while all its samples run
    # (one that has ended here keeps the fork here). Its samples share their prompt's
    # blocks: a sample's blocks that are sample 0's (the same hashes) are not sent again,
    # the destination finds them under their hashes once sample 0 is in.

    def _live_fork(self, request_id: str) -> list[Request] | None:
        """The samples of the fork `request_id`, all running; None if it is no fork."""
        ids = self.scheduler.forks.get(request_id)
        if ids is None:
            return None
        if self.windowed:
            raise InvalidStateError(f"request {request_id!r}: a fork of a model with sliding "
                                    "windows or layer groups does not move yet")
        samples = [self.scheduler.requests.get(i) for i in ids]
        if any(s is None or s.status is not RequestStatus.RUNNING for s in samples):
            raise InvalidStateError(f"request {request_id!r}: a sample of it has ended or is "
                                    "not running; a fork moves only while all its samples run")
        return samples

    def _fork_state(self, request_id: str, samples: list[Request]) -> dict:
        """The offer of a fork: its samples' states, and what every state has at its top."""
        states = [self.state_of(s) for s in samples]
        return {**{k: states[0][k] for k in ("model_id", "block_size", "kv_format",
                                              "engine_seed", "engine", "job_id")},
                "request_id": request_id, "fork": True, "samples": states,
                "block_hashes": states[0]["block_hashes"], "params": states[0]["params"],
                "num_computed_tokens": sum(st["num_computed_tokens"] for st in states)}

    def take_out(self, request_id: str, skip: int = 0) -> tuple[dict, Any]:
        """The request leaves the batch (its blocks kept until done()); its state and
        the K/V of its computed tokens' blocks from `skip` on. A fork: every sample, its
        state listing theirs and `data` a list of theirs (a sample from the first block
        not sample 0's)."""
        self.settle()
        self.changes += 1
        self.check_movable()
        samples = self._live_fork(request_id)
        if samples is not None:
            return self._take_out_fork(request_id, samples, skip)
        request = self.scheduler.suspend(request_id)
        try:
            if self.windowed:  # every group's live blocks, in group order
                data = [self.runner.read_blocks(ids) if ids else None
                        for _, ids in self.kv.tables_of(request_id)]
            else:
                n = cdiv(request.num_computed_tokens, self.config.block_size)
                data = self.runner.read_blocks(self.kv.block_ids(request_id)[skip:n])
        except Exception:
            self.scheduler.resume(request_id)
            raise
        return self.state_of(request), data  # (a windowed engine's: each group's layout)

    def _take_out_fork(self, request_id: str, samples: list[Request],
                       skip: int) -> tuple[dict, Any]:
        taken = []
        try:
            for s in samples:
                self.scheduler.suspend(s.request_id)
                taken.append(s.request_id)
            state = self._fork_state(request_id, samples)
            first = state["samples"][0]
            skips = [skip] + [max(skip, _shared(st, first)) for st in state["samples"][1:]]
            data = []
            for s, k in zip(samples, skips):
                n = cdiv(s.num_computed_tokens, self.config.block_size)
                data.append(self.runner.read_blocks(self.kv.block_ids(s.request_id)[k:n]))
        except Exception:
            for rid in taken:
                self.scheduler.resume(rid)
            raise
        state["skips"] = skips
        return state, data

    def done(self, request_id: str, moved: bool, to: str | None = None,
             reason: str = "migration") -> None:
        """The request ended here (it runs on engine `to`; the next step reports its
        end, finish_reason "migrated"; `reason`: "migration", or "decode" for a prefill
        engine's hand-over), or runs on here (the commit failed). A fork: every sample."""
        self.settle()
        self.changes += 1
        ids = self.scheduler.forks.get(request_id)
        if ids is not None and all(i in self.scheduler.suspended for i in ids):
            for rid in list(ids):
                self.done(rid, moved, to, reason)
            return
        if not moved:
            self.scheduler.resume(request_id)
            return
        request = self.scheduler.suspended[request_id]
        self.scheduler.finish(request, RequestStatus.FINISHED, MIGRATED)
        self.output_processor.forget(request_id)  # (its text goes on where it went)
        out = core_output(request, [])
        out.migration = {"to": to, "reason": reason}
        self._reports.append(out)

    def stage(self, request_id: str, start: int, end: int | None = None) -> tuple[Any, int]:
        """While the request runs: the K/V of its full computed blocks from `start` on
        (they no longer change; below `end`, the blocks the destination holds), and the
        index after the last one."""
        self.settle()
        request = self.scheduler.get_live(request_id)
        if request.status is not RequestStatus.RUNNING or request_id in self.scheduler.suspended:
            raise InvalidStateError(f"request {request_id!r} is not running here")
        full = request.num_computed_tokens // self.config.block_size
        end = full if end is None else min(end, full)
        ids = self.kv.block_ids(request_id)[start:end]
        return (self.runner.read_blocks(ids) if ids else None), max(end, start)

    # --- destination ---------------------------------------------------------------------
    def _fits(self, state: dict) -> None:
        if state["model_id"] != self.runner.model_id or \
                state["block_size"] != self.config.block_size or \
                state.get("kv_format") != self.runner.kv_format:
            raise InvalidRequestError(
                f"request {state['request_id']!r} runs {state['model_id']} in blocks of "
                f"{state['block_size']} ({state.get('kv_format')}); this engine runs "
                f"{self.runner.model_id} in blocks of {self.config.block_size} "
                f"({self.runner.kv_format})")
        if state["engine_seed"] != self.config.seed and state["params"]["seed"] is None:
            raise InvalidRequestError("the engines' seeds differ: an unseeded sampled request "
                                      "would not continue its stream of draws")
        engine_state = self._engine_state()
        if engine_state != "ready":
            raise InvalidStateError(f"this engine is {engine_state}: it takes no request now")
        if state["request_id"] in self.scheduler.requests:
            raise InvalidRequestError(f"request {state['request_id']!r} already exists here")
        self.check_movable()

    def check(self, offer: dict) -> dict:
        """Whether the request fits here, and the leading blocks cached here."""
        if offer.get("fork"):
            return self._check_fork(offer)
        self._fits(offer)
        if offer.get("groups") is not None:  # (fresh blocks for every group's live ones)
            return self._room(f"request {offer['request_id']!r}",
                              sum(n for _, n in offer["groups"]) + self.kv.num_groups, 0)
        cached = self.kv.cached_chain([bytes.fromhex(h) for h in offer["block_hashes"]])
        need = cdiv(offer["num_computed_tokens"] + 1, self.config.block_size) - len(cached)
        return self._room(f"request {offer['request_id']!r}", need, len(cached))

    def _room(self, who: str, need: int, cached: int) -> dict:
        """check()'s answer, or NotEnoughBlocksError when `need` blocks are not free here
        (`who`: the request, as the error names it)."""
        free = self.kv.gpu.num_free
        if need > free:
            raise NotEnoughBlocksError(f"{who} needs {need} free blocks here, {free} are")
        return {"cached_blocks": cached, "free_blocks": free}

    def _check_fork(self, offer: dict) -> dict:
        if offer["request_id"] in self.scheduler.requests or \
                offer["request_id"] in self.scheduler.forks:
            raise InvalidRequestError(f"request {offer['request_id']!r} already exists here")
        for state in offer["samples"]:
            self._fits(state)
        first = offer["samples"][0]
        cached = self.kv.cached_chain([bytes.fromhex(h) for h in first["block_hashes"]])
        bs = self.config.block_size
        need = sum(cdiv(st["num_computed_tokens"] + 1, bs) - max(len(cached), _shared(st, first)
                                                                if i else len(cached))
                   for i, st in enumerate(offer["samples"]))
        return self._room(f"request {offer['request_id']!r} (a fork of "
                          f"{len(offer['samples'])} samples)", need, len(cached))

    def reserve(self, offer: dict) -> dict:
        """For a staged copy: hold blocks for the offer's full computed blocks (its
        leading ones cached here, fresh ones for the rest), which write() fills while the
        request keeps running at the source. Returns {"cached_blocks": k}: the source
        stages its blocks from k on."""
        self.settle()
        if offer.get("fork") or offer.get("groups") is not None:
            raise InvalidRequestError(f"request {offer['request_id']!r} moves in one stop-and-"
                                      "copy, not staged (a fork, or an engine with sliding "
                                      "windows or layer groups)")
        self._fits(offer)
        rid = offer["request_id"]
        if rid in self.incoming:
            raise InvalidRequestError(f"request {rid!r} is already being copied here")
        request = self._request(offer)
        num_full = offer["num_computed_tokens"] // self.config.block_size
        cached = self.kv.hold(request, request.block_hashes, num_full)
        if cached is None:
            raise NotEnoughBlocksError(f"request {rid!r} needs {num_full} blocks here, "
                                       f"{self.kv.gpu.num_free} are free")
        self.incoming[rid] = (request, cached)
        return {"cached_blocks": cached, "reserved_blocks": num_full - cached}

    def room(self, request_id: str, start: object) -> int:
        """How many blocks a staged write from `start` may fill: the held ones from there
        (InvalidRequestError for a start outside them, or no copy under way). The port
        asks before it decodes a write's frames."""
        incoming = self.incoming.get(request_id)
        if incoming is None:
            raise InvalidRequestError(f"no copy of request {request_id!r} is under way here")
        held, cached = len(self.kv.block_ids(request_id)), incoming[1]
        if not isinstance(start, int) or isinstance(start, bool) or not cached <= start <= held:
            raise InvalidRequestError(f"request {request_id!r}: blocks {cached}..{held - 1} are "
                                      f"held here, not from {start!r}")
        return held - start

    def write(self, request_id: str, start: int, data: Any) -> None:
        """Staged K/V into the held blocks from index `start` on."""
        self.settle()
        room = self.room(request_id, start)
        n = self.runner.num_blocks_in(data) if data is not None else 0
        if n > room:
            cached = self.incoming[request_id][1]
            raise InvalidRequestError(f"blocks {start}..{start + n - 1} are not held for "
                                      f"request {request_id!r} (blocks {cached}.."
                                      f"{start + room - 1} are)")
        if n:
            self.runner.write_blocks(self.kv.block_ids(request_id)[start:start + n], data)

    def commit_blocks(self, state: dict, skip: object) -> int | list[int]:
        """The blocks a (checked) state's commit must carry from `skip` on: its computed
        tokens' blocks past skip; a fork's, per sample past its skip; a windowed engine's,
        per layer group, every block it holds. The port asks before it decodes a
        commit's frames; commit() checks what it is given against the same counts."""
        bs = self.config.block_size
        if state.get("fork"):
            if "skips" not in state:
                raise InvalidRequestError("a fork's commit must give each sample's skip")
            return [cdiv(st["num_computed_tokens"], bs) - k
                    for st, k in zip(state["samples"], state["skips"])]
        if state.get("groups") is not None:
            return [held for _, held in state["groups"]]
        last = cdiv(state["num_computed_tokens"], bs)
        if not isinstance(skip, int) or isinstance(skip, bool) or not 0 <= skip <= last:
            raise InvalidRequestError(f"a commit's skip must be in [0, {last}], got {skip!r}")
        return last - skip

    def cancel(self, request_id: str) -> None:
        """The copy stopped; the held blocks go back."""
        self.settle()
        request, _ = self.incoming.pop(request_id)
        self.kv.free(request, "migration")
        self.kv.end(request_id)

    def commit(self, state: dict, data: Any, skip: int = 0) -> dict:
        """The request with its blocks (cached here, or new ones given `data`, the K/V of
        its blocks from `skip` on); it runs from the next step (MigrationFailed, and
        nothing changed, if it cannot now). After reserve() and write(), the held blocks
        are its, and `data` is the rest from `skip` on."""
        self.settle()
        self.changes += 1
        if state.get("fork"):
            self._check_data(state, data, skip)  # (every sample's, before any comes)
            return self._commit_fork(state, data)
        if state.get("groups") is not None:
            return self._commit_tables(state, data)
        if state["request_id"] in self.incoming:
            return self._commit_held(state, data, skip)
        return self._commit_fresh(state, data, skip)

    @contextlib.contextmanager
    def _given_back_on_error(self, request: Request) -> Iterator[None]:
        """A commit that fails part-way (its blocks taken, its K/V not all written,
        before it runs here) gives back every block the request took or held here and
        leaves nothing of it: a failed move costs the destination nothing. Every commit
        runs inside this, from its first block taken to its arrival."""
        try:
            yield
        except BaseException:
            self.incoming.pop(request.request_id, None)
            if request.request_id not in self.scheduler.requests:
                self.kv.free(request, "migration")
                self.kv.end(request.request_id)
            raise

    def _commit_fresh(self, state: dict, data: Any, skip: int) -> dict:
        """A stop-and-copy into fresh blocks (and the ones cached here)."""
        self._fits(state)
        request = self._request(state)
        with self._given_back_on_error(request):
            return self._fill_fresh(state, request, data, skip)

    def _fill_fresh(self, state: dict, request: Request, data: Any, skip: int) -> dict:
        kv = self.kv
        match = kv.find_prefix(request)  # (its story was told on the engine it came from)
        hit_blocks = len(match.blocks) + len(match.tier_blocks)
        if hit_blocks < skip:
            raise MigrationFailed(f"request {request.request_id!r}: {skip} leading blocks "
                                  f"were to be cached here, {hit_blocks} are now")
        computed = max(state["num_computed_tokens"], match.num_computed_tokens)
        request.num_computed_tokens = match.num_computed_tokens
        alloc = kv.allocate_slots(request, computed - match.num_computed_tokens, match)
        if alloc is None:
            raise MigrationFailed(f"request {request.request_id!r} needs more free blocks "
                                  f"than this engine has now ({kv.gpu.num_free})")
        kv.record_prefix_query(request, match)
        self.runner.swap_out(kv.flush_offloads())  # reused cached blocks' data first
        if alloc.copies_in:
            self.runner.swap_in(alloc.copies_in)
        if alloc.copies:
            self.runner.copy_blocks(alloc.copies)
        request.num_computed_tokens = computed
        # New blocks take the sent K/V; the shared cached blocks already hold it
        shared = len(match.blocks) - (1 if match.cow else 0)
        first = max(skip, shared)
        return self._runs_here(state, request, data, skip, first, first, shared)

    def _commit_tables(self, state: dict, data: list) -> dict:
        """A request of a windowed engine: fresh tables laid out as the source's, every
        group's live blocks written into them."""
        self._fits(state)
        if not self.windowed:
            raise InvalidRequestError(f"request {state['request_id']!r} comes from an engine "
                                      "with sliding windows or layer groups; this one has none")
        request = self._request(state)
        layout = [tuple(g) for g in state["groups"]]
        tables = self.kv.adopt_tables(request, layout)
        if tables is None:
            raise MigrationFailed(f"request {request.request_id!r} needs more free blocks "
                                  f"than this engine has now ({self.kv.gpu.num_free})")
        with self._given_back_on_error(request):
            self._check_data(state, data, 0)
            for ids, blocks in zip(tables, data, strict=True):
                if ids:
                    self.runner.write_blocks(ids, blocks)
            request.num_computed_tokens = state["num_computed_tokens"]
            sent = sum(len(ids) for ids in tables)  # (every block was sent: all are written)
            return self._arrive(state, request, sent, 0, sent)

    def _commit_fork(self, state: dict, data: list) -> dict:
        """Every sample, in order, or none: a sample that cannot come gives back the ones
        that came before it."""
        rid = state["request_id"]
        if rid in self.scheduler.requests or rid in self.scheduler.forks:
            raise InvalidRequestError(f"request {rid!r} already exists here")
        results = []
        try:
            for sample, blocks, skip in zip(state["samples"], data, state["skips"],
                                            strict=True):
                results.append(self.commit(sample, blocks, skip))
        except Exception:
            for result in results:
                self._give_back(result["request_id"])
            raise
        self.scheduler.adopt_fork(rid, [r["request_id"] for r in results])
        return {"request_id": rid, "samples": len(results),
                "num_blocks": sum(r["num_blocks"] for r in results),
                "blocks_written": sum(r["blocks_written"] for r in results),
                "blocks_cached": results[0]["blocks_cached"] if results else 0}

    def _give_back(self, request_id: str) -> None:
        """Undo a sample's commit (its fork could not come whole): its blocks go back,
        and nothing of it is reported."""
        self.scheduler.disown(request_id, "migration")
        self.output_processor.forget(request_id)
        self._reports = [o for o in self._reports if o.request_id != request_id]
        if self.stories is not None:
            self.stories.discard(request_id)

    def _commit_held(self, state: dict, data: Any, skip: int) -> dict:
        request, _ = self.incoming[state["request_id"]]
        with self._given_back_on_error(request):
            return self._fill_held(state, data, skip)

    def _fill_held(self, state: dict, data: Any, skip: int) -> dict:
        rid = state["request_id"]
        request, cached = self.incoming[rid]
        kv = self.kv
        if skip < cached:
            raise InvalidRequestError(f"request {rid!r}: blocks from {skip} sent, but blocks "
                                      f"below {cached} are shared cached blocks here")
        made = state["output_token_ids"][len(request.output_token_ids):]
        for token in made:
            request.append_output_token(token)  # (made at the source since the offer)
        _replay(request, made)
        request.output_logprobs = list(state["output_logprobs"])
        request.num_preemptions = state["num_preemptions"]
        if not _same_blocks(request, state):
            raise MigrationFailed(f"request {rid!r}: its tokens changed since the offer")
        request.num_computed_tokens = state["num_computed_tokens"]
        if kv.allocate_more(request, 0) is None:  # (room for the tail; full blocks offered)
            raise MigrationFailed(f"request {rid!r} needs more free blocks than this engine "
                                  f"has now ({kv.gpu.num_free})")
        del self.incoming[rid]
        # (the blocks from `cached` on were sent: staged, and from `skip` on at the stop)
        return self._runs_here(state, request, data, skip, skip, cached, cached)

    def _runs_here(self, state: dict, request: Request, data: Any, skip: int,
                   first: int, sent_from: int, cached: int) -> dict:
        """The request's table is complete: `data` (its blocks from `skip` on) goes into
        its blocks from `first` on, and it runs from the next step; its story goes on
        here (the blocks from `sent_from` on came from the source; its first `cached`
        were here)."""
        table = self.kv.block_ids(request.request_id)
        last = cdiv(request.num_computed_tokens, self.config.block_size)
        self._check_data(state, data, skip)
        if first < last:
            self.runner.write_blocks(table[first:last], self.runner.blocks_between(
                data, first - skip, last - skip))
        return self._arrive(state, request, max(0, last - sent_from), cached,
                            len(table), max(0, last - first))

    def _check_data(self, state: dict, data: Any, skip: object) -> None:
        """A commit's data must hold exactly the blocks commit_blocks counts (the count
        the port decodes by): per sample of a fork, per layer group of a windowed
        request; InvalidRequestError naming the counts before anything is written (a
        commit's blocks taken or held by then go back with it)."""
        want = self.commit_blocks(state, skip)
        rid = state["request_id"]
        if isinstance(want, int):
            got = self.runner.num_blocks_in(data) if data is not None else 0
            if got != max(want, 0):
                raise InvalidRequestError(f"the commit of {rid!r} carries {got} blocks, "
                                          f"not the {max(want, 0)} it needs")
            return
        parts = "samples'" if state.get("fork") else "layer groups'"
        if not isinstance(data, list) or len(data) != len(want):
            got = len(data) if isinstance(data, list) else type(data).__name__
            raise InvalidRequestError(f"the commit of {rid!r} carries {got} {parts} blocks, "
                                      f"not {len(want)}")
        for blocks, n in zip(data, want, strict=True):
            got = self.runner.num_blocks_in(blocks) if blocks is not None else 0
            if got != max(n, 0):
                raise InvalidRequestError(f"the commit of {rid!r} carries {got} blocks, "
                                          f"not the {max(n, 0)} it needs")

    def _arrive(self, state: dict, request: Request, blocks_sent: int, cached: int,
                num_blocks: int, written: int | None = None) -> dict:
        """The request, its blocks in place, runs here from the next step; its first
        output here says where it came from, and its story goes on here."""
        self.kv.mark_computed()  # (between steps: only its blocks wait to be computed)
        self.scheduler.adopt(request)
        self.output_processor.arrived(request.request_id, request.sampling_params,
                                      state["output_token_ids"])
        # its first output here says where it came from and what it had made (whoever
        # reads the outputs picks up its text where the source left it)
        out = core_output(request, [])
        out.migration = {"from": state["engine"], "job_id": state["job_id"],
                         "output_token_ids": list(state["output_token_ids"]),
                         "output_logprobs": list(state["output_logprobs"])}
        if state.get("parent_id") is not None:  # a sample of a fork: which, of how many
            out.migration["fork"] = {"parent": state["parent_id"],
                                     "index": state["sample_index"], "n": state["fork_size"]}
        self._reports.append(out)
        if self.stories is not None and state.get("kv_story"):
            self.stories.arrived(state["kv_story"], state["engine"], blocks_sent)
        return {"request_id": request.request_id, "num_blocks": num_blocks,
                "blocks_written": blocks_sent if written is None else written,
                "blocks_cached": cached}

    def _request(self, state: dict) -> Request:
        params = SamplingParams(**state["params"])
        request = Request(
            request_id=state["request_id"], prompt_token_ids=list(state["prompt_token_ids"]),
            sampling_params=params, arrival_time=state["arrival_time"],
            index=self.input_processor.next_index(), root_hash=bytes.fromhex(state["root_hash"]),
            pinned_root=bytes.fromhex(state["pinned_root"]) if state["pinned_root"] else None,
            block_size=self.config.block_size, priority=state["priority"],
            job_id=state["job_id"], tenant=state["tenant"],
            eos_token_ids=self.runner.tokenizer.eos_token_ids,
            parent_id=state.get("parent_id"), sample_index=state.get("sample_index") or 0)
        for token in state["output_token_ids"]:
            request.append_output_token(token)
        if params.structured is not None:
            # Its constraint, compiled here (xgrammar caches it), its matcher brought to
            # where the source's was by the tokens made so far
            structured = self.input_processor.structured_outputs()
            compiled = structured.compile(params.structured).result(GRAMMAR_COMPILE_S)
            request.compiled_grammar = compiled
            request.grammar = structured.matcher(compiled)
            _replay(request, state["output_token_ids"])
        request.output_logprobs = list(state["output_logprobs"])
        request.prompt_logprobs = list(state["prompt_logprobs"])
        request.num_cached_tokens = state["num_cached_tokens"]
        request.num_preemptions = state["num_preemptions"]
        if not _same_blocks(request, state):
            raise InvalidRequestError(f"request {request.request_id!r}: its block hashes "
                                      "differ here (another model identity or cache salt)")
        return request


def _shared(state: dict, first: dict) -> int:
    """Leading full blocks of a sample that are sample 0's (the same hashes)."""
    n = 0
    for a, b in zip(state["block_hashes"], first["block_hashes"]):
        if a != b:
            break
        n += 1
    return n


def _replay(request: Request, tokens: list[int]) -> None:
    """Tell the request's grammar matcher (if any) the tokens made at the source."""
    if request.grammar is None:
        return
    for token in tokens:
        if request.grammar.is_terminated():
            break
        if not request.grammar.accept_token(token):
            raise InvalidRequestError(f"request {request.request_id!r}: token {token} does "
                                      "not follow its structured-output constraint here")


def _same_blocks(request: Request, state: dict) -> bool:
    """Whether the request's block hashes here are the ones the source sent."""
    return [h.hex() for h in request.block_hashes] == state["block_hashes"]
