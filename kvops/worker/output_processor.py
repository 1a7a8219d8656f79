"""The worker's output processor: the engine's per-step outputs to the job stream and the
database, for every job at once.

The engine loop hands over each step's outputs (token ids, engine.CoreOutput) as one
list (`push`, a list append); this module's thread does the rest, so per-token work
never runs in a job's task thread or on the engine loop. It detokenises (as vLLM's
frontend does) and checks stop strings: a job whose text reaches one ends here, and
the engine is told to stop its request (`on_stop`). Per flush it writes one job-stream
entry holding every job that moved, and, a few times a second, one bulk database write
of all running jobs' progress (text appended, never rewritten). A job that ended is
written to the database first, then announced on the stream (and its task woken): a
client that sees the end on the stream finds the final row in the database.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import connection
from django.utils import timezone

from engine.text.detokenizer import IncrementalDetokenizer, Tokenizer
from engine.transfer.migration import MIGRATED
from engine.outputs import CoreOutput
from kvops.jobs import job_store
from kvops.monitoring import metrics_store
from kvops.stream.job_stream import StreamProducer, state_update

log = logging.getLogger(__name__)

DB_INTERVAL_S = 0.25  # running jobs' progress reaches the database this often
IDLE_WAIT_S = 1.0
# Flushes are spaced by (jobs / settings.KVOPS_STREAM_UPDATES_PER_S) seconds, at most
# MAX_FLUSH_GAP_S, and a flush carries one update per job with every token it gained since
# the last one. With few jobs that is every step; with hundreds, a few steps' tokens
# travel together and the per-update work (here, in Redis and in every web process) stays
# bounded however fast the engine steps. A job's first token does not wait for the gap
# (as vLLM's stream interval, which always sends the first token at once): a burst's
# first tokens leave with the step that made them.
MAX_FLUSH_GAP_S = 0.05


class JobHandle:
    """What a job's task waits on: set once the attempt's end is in the database."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.outcome: str | None = None  # "finished", "cancelled", "failed" or "fenced"

    def set(self, outcome: str) -> None:
        self.outcome = outcome
        self._done.set()

    def wait(self, timeout_s: float) -> str | None:
        """The outcome, or None if the attempt did not end within timeout_s."""
        return self.outcome if self._done.wait(timeout_s) else None


@dataclass(slots=True)
class _Tracked:
    """One running attempt, as the processor thread follows it (that thread only)."""
    job_id: int
    request_id: str
    attempt: int
    handle: JobHandle
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)  # output so far
    finish_reason: str | None = None  # once ended
    text: list[str] = field(default_factory=list)  # the deltas so far
    chars: int = 0  # characters streamed so far
    unwritten: list[str] = field(default_factory=list)  # deltas not in the database yet
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_token_at: datetime | None = None
    first_token_written: bool = False
    # when the engine loop handed over the last step that gave it tokens (monotonic):
    # the inter-token gaps are measured from it
    last_token_s: float | None = None
    # If asked: per token [token, logprob, top], for the updates and the row
    logprobs: list[list] = field(default_factory=list)
    logprobs_sent: int = 0  # of them in updates already
    prompt_logprobs: list[list] = field(default_factory=list)  # the same per prompt token
    prompt_logprobs_sent: bool = False
    dirty: bool = False  # progress not in the database yet
    kv_story: dict | None = None  # the engine's newest KV story of it
    kv_story_unwritten: bool = False  # that story is not in the database yet
    # n > 1: this is sample `index` of the attempt `parent_id`; `siblings` (one list for
    # them all, in order) end the job together, and sample 0's progress is the row's.
    index: int = 0
    parent_id: str | None = None
    siblings: list[_Tracked] | None = None
    # moved here from another engine, and the row not yet handed over to this one
    # (job_store.hand_over): its progress is written whole, once the row is ours
    adopted: bool = False

    @property
    def attempt_id(self) -> str:
        """The request id the job row knows (the parent's, for a sample)."""
        return self.parent_id or self.request_id


@dataclass(slots=True)
class ProcessorStats:
    flushes: int = 0
    stream_errors: int = 0
    db_writes: int = 0
    cpu_s: float = 0.0  # this thread's CPU time


class OutputProcessor:
    def __init__(self, engine_name: str, producer: StreamProducer, tokenizer: Tokenizer,
                 on_stop: Callable[[str], None], db_interval_s: float = DB_INTERVAL_S,
                 on_adopt: Callable[[object, JobHandle], None] | None = None) -> None:
        """on_adopt(job, handle): a job whose request moved here from another engine is
        followed from now on (the worker watches its deadline)."""
        self.engine_name = engine_name
        self.on_adopt = on_adopt
        self.instance = ""  # this worker's run of the engine (set once its client exists)
        self.producer = producer
        self.tokenizer = tokenizer
        self.on_stop = on_stop  # tell the engine a request hit a stop string
        self.db_interval_s = db_interval_s
        self.stats = ProcessorStats()
        self._lock = threading.Lock()
        # each step's outputs, with when the engine loop handed them over; under _lock
        self._inbox: list[tuple[float, list[CoreOutput]]] = []
        # inter-token gaps not yet in Redis (written with the progress); this thread's
        self._gaps = metrics_store.Tally()
        self._failed: list[tuple[str, str]] = []  # (request id, why), under _lock
        self._new: dict[str, _Tracked] = {}  # tracked by tasks, not yet seen here; under _lock
        self._gone: set[str] = set()  # untracked by tasks; under _lock
        self._forks: dict[str, list[_Tracked]] = {}  # n > 1: samples by parent id; under _lock
        self._awaiting: set[str] = set()  # tracked, no output pushed yet; under _lock
        self._jobs: dict[str, _Tracked] = {}  # processor thread only
        self._wake = threading.Event()
        self._hurry = threading.Event()  # a first output came: flush without the gap
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvops-outputs-{engine_name}",
                                        daemon=True)
        self._thread.start()

    # --- any thread ----------------------------------------------------------------------
    def track(self, job_id: int, request_id: str, attempt: int,
              stop: list[str] | None = None, min_tokens: int = 0, n: int = 1) -> JobHandle:
        """Follow this attempt's outputs (call before submitting the request); `stop`:
        its stop strings, which count once min_tokens tokens are out. With n > 1 the
        engine forks the request into samples "<request_id>/<i>": each is followed, and
        the job ends when all have."""
        handle = JobHandle()

        def tracked(rid: str, **kw) -> _Tracked:
            detok = IncrementalDetokenizer(self.tokenizer, list(stop or []), min_tokens)
            return _Tracked(job_id, rid, attempt, handle, detok, **kw)

        if n == 1:
            new = [tracked(request_id)]
        else:
            new = [tracked(f"{request_id}/{i}", index=i, parent_id=request_id)
                   for i in range(n)]
            for t in new:
                t.siblings = new
        with self._lock:
            for t in new:
                self._new[t.request_id] = t
                self._awaiting.add(t.request_id)
            if n > 1:
                self._forks[request_id] = new
        return handle

    def untrack(self, request_id: str) -> None:
        """Stop following an attempt whose task gave up on it."""
        with self._lock:
            ids = [t.request_id for t in self._forks.pop(request_id, ())] or [request_id]
            for rid in ids:
                self._new.pop(rid, None)
                self._awaiting.discard(rid)
                self._gone.add(rid)
        self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._hurry.set()
        self._thread.join(timeout_s)

    # --- the engine loop ---------------------------------------------------------------
    def push(self, outputs: list[CoreOutput]) -> None:
        if outputs:
            now = time.monotonic()
            with self._lock:
                self._inbox.append((now, outputs))
                first = self._awaiting and self._awaiting.intersection(
                    out.request_id for out in outputs)
                if first:
                    self._awaiting -= first
            if first:
                self._hurry.set()
            self._wake.set()

    def fail(self, request_ids: list[str], message: str) -> None:
        with self._lock:
            self._failed.extend((rid, message) for rid in request_ids)
        self._wake.set()

    # --- the processor thread ------------------------------------------------------------
    def _run(self) -> None:
        next_db = time.monotonic() + self.db_interval_s
        last_flush = 0.0
        while not self._stop.is_set():
            self._wake.wait(min(IDLE_WAIT_S, max(0.0, next_db - time.monotonic())))
            gap = min(MAX_FLUSH_GAP_S, len(self._jobs) / settings.KVOPS_STREAM_UPDATES_PER_S)
            if gap > 0:  # let a few steps' outputs gather (see MAX_FLUSH_GAP_S)
                self._hurry.wait(max(0.0, last_flush + gap - time.monotonic()))
            self._hurry.clear()  # (a first output pushed from here on hurries the next)
            self._wake.clear()
            last_flush = time.monotonic()
            cpu = time.thread_time()
            try:
                now = time.monotonic()
                due = now >= next_db
                if due:
                    next_db = now + self.db_interval_s
                self._flush(write_db=due)
            except Exception:  # the database or Redis away: try again next round
                log.exception("output processing failed")
                connection.close()  # a fresh one next round
                self._stop.wait(0.5)
            self.stats.cpu_s += time.thread_time() - cpu

    def _flush(self, write_db: bool) -> None:
        with self._lock:
            steps, self._inbox = self._inbox, []
            failed, self._failed = self._failed, []
            self._jobs.update(self._new)
            self._new.clear()
            for request_id in self._gone:
                self._jobs.pop(request_id, None)
            self._gone.clear()
        updates: list[dict] = []
        ended: list[_Tracked] = []
        by_request: dict[str, list[CoreOutput]] = {}  # a job's outputs of several steps
        gaps: list[float] = []  # inter-token latencies seen in these steps
        for at, outputs in steps:
            for out in outputs:
                if out.error is not None:  # the engine could not serve it: the job fails
                    failed.append((out.request_id, out.error))
                    continue
                if out.new_token_ids:
                    self._time_tokens(out.request_id, at, gaps)
                by_request.setdefault(out.request_id, []).append(out)
        self._gaps.observe_many("inter_token_latency_seconds", self.engine_name, gaps)
        moved: list[tuple[_Tracked, dict]] = []  # moved away: (attempt, where to and why)
        self._adopt_arrivals(by_request)
        for request_id, outs in by_request.items():
            t = self._jobs.get(request_id)
            if t is not None and t.finish_reason is None:
                self._absorb(t, outs, updates)
                if t.finish_reason == MIGRATED:
                    # (a fork hands over once all its samples have moved: together)
                    if t.siblings is None or all(s.finish_reason == MIGRATED
                                                 for s in t.siblings):
                        moved.append((t.siblings[0] if t.siblings else t,
                                      outs[-1].migration or {}))
                    continue
                if t.finish_reason is not None and (
                        t.siblings is None or all(s.finish_reason is not None
                                                  for s in t.siblings)):
                    ended.append(t.siblings[0] if t.siblings else t)
        self._send(updates)  # progress: to the stream at once, to the database in batches
        for t, where in moved:
            self._hand_over(t, where.get("to") or "", where.get("reason") or "migration")
        if ended:  # their final rows carry all their text: no progress write for them
            self._send(self._end(ended))
        if write_db:
            try:
                self._write_progress()
            except Exception:  # kept dirty: written with the next batch
                log.exception("writing the progress of %d jobs failed", len(self._jobs))
            gaps, self._gaps = self._gaps, metrics_store.Tally()
            metrics_store.record_tally(gaps, self.engine_name)
        for request_id, message in failed:
            members = self._pop_attempt(request_id)
            if members:
                t = members[0]
                job_store.fail_job(t.job_id, message, request_id=t.attempt_id)
                t.handle.set("failed")
        self.stats.flushes += 1

    def _time_tokens(self, request_id: str, at: float, gaps: list[float]) -> None:
        """A step handed over at `at` gave the request tokens: the gap since its last
        such step is one inter-token latency (as vLLM's, one per step, however many
        tokens the step gave), added to `gaps`."""
        t = self._jobs.get(request_id)
        if t is None:
            return
        if t.last_token_s is not None:
            gaps.append(at - t.last_token_s)
        t.last_token_s = at

    def _pop_attempt(self, request_id: str) -> list[_Tracked]:
        """Stop following the attempt this id names (a request, a fork's parent, or one
        of its samples): its tracked entries, all samples of a fork."""
        t = self._jobs.get(request_id)
        parent = t.parent_id if t is not None else request_id
        with self._lock:
            members = self._forks.pop(parent, None) or ([t] if t is not None else [])
            self._awaiting.difference_update(m.request_id for m in members)
        for m in members:
            self._jobs.pop(m.request_id, None)
        return members

    def _adopt_arrivals(self, by_request: dict[str, list[CoreOutput]]) -> None:
        """Follow the jobs of requests that moved here in this flush (their first output
        here says so). A fork's samples arrive in one step's outputs, and are followed
        together."""
        forks: dict[str, list[CoreOutput]] = {}
        for request_id, outs in by_request.items():
            moved = outs[0].migration
            if request_id in self._jobs or not moved or "from" not in moved:
                continue
            if moved.get("fork"):
                forks.setdefault(moved["fork"]["parent"], []).append(outs[0])
            else:
                self._adopt_alone(request_id, [outs[0]])
        for parent, firsts in forks.items():
            self._adopt_alone(parent, sorted(firsts, key=lambda o: o.migration["fork"]["index"]))

    def _adopt_alone(self, rid: str, firsts: list[CoreOutput]) -> None:
        """_adopt, failing alone: an arrival that cannot be followed (its first output
        malformed) stops its request and never another job's flush."""
        try:
            self._adopt(rid, firsts)
        except Exception:  # noqa: BLE001  (that request's alone)
            log.exception("request %s moved here, but could not be followed; stopping it", rid)
            self.on_stop(rid)

    def _adopt(self, rid: str, firsts: list[CoreOutput]) -> None:
        """A request that moved here from another engine (its first output here; a fork:
        each sample's): its job is followed from where the source left it. The text the
        source streamed is the one its tokens make, so it is made again here from them
        (what the source held back, it held back here too), and this engine's text
        continues at its end."""
        from kvops.models import Job
        moved = firsts[0].migration
        fork = moved.get("fork")
        try:
            job = Job.objects.filter(pk=int(moved["job_id"])).first()
        except (TypeError, ValueError):  # (a request of no job: nothing to follow)
            job = None
        # (the job must be the attempt that ran on the engine it came from, or was handed
        # here already: a move of another engine's request is not followed)
        if job is None or job.request_id != rid or job.is_terminal or \
                job.engine not in (moved.get("from"), self.engine_name) or (
                fork and len(firsts) != fork["n"]):
            log.warning("request %s moved here, but no running job of it is waiting; "
                        "stopping it", rid)
            self.on_stop(rid)  # (a fork's id stops all its samples)
            return
        handle = JobHandle()
        tracked = [self._follow_moved(job, first, handle) for first in firsts]
        if fork:
            for t in tracked:
                t.parent_id, t.siblings = rid, tracked
            with self._lock:
                self._forks[rid] = tracked
        tracked[0].adopted = True  # (the row follows sample 0)
        for t in tracked:
            self._jobs[t.request_id] = t
        log.info("job %s: its request %s moved here from engine %s", job.pk, rid,
                 moved.get("from"))
        if self.on_adopt is not None:
            self.on_adopt(job, handle)

    def _follow_moved(self, job, first: CoreOutput, handle: JobHandle) -> _Tracked:
        params = job.params or {}
        moved = first.migration
        t = _Tracked(job.pk, first.request_id, job.attempts, handle, IncrementalDetokenizer(
            self.tokenizer, list(params.get("stop") or []), params.get("min_tokens") or 0))
        t.index = (moved.get("fork") or {}).get("index", 0)  # (a fork's sample)
        prior = list(moved.get("output_token_ids") or [])
        if prior:
            t.detok.add(prior)
            t.token_ids = prior
        streamed = t.detok.take_delta(False)
        t.text, t.chars = ([streamed] if streamed else []), len(streamed)
        t.num_output_tokens = len(prior)
        t.num_prompt_tokens = first.num_prompt_tokens
        t.num_cached_tokens = first.num_cached_tokens
        t.num_preemptions = first.num_preemptions
        # its first token's time is the source's to write
        t.first_token_at, t.first_token_written = job.first_token_at, bool(prior)
        if moved.get("output_logprobs"):
            t.logprobs = self._token_logprobs(prior, moved["output_logprobs"])
            t.logprobs_sent = len(t.logprobs)
        return t

    def _hand_over(self, t: _Tracked, to: str, reason: str) -> None:
        """The attempt's request moved to engine `to` (`reason`: "migration", or "decode"
        from a prefill engine): the row is that engine's now, with the text made here
        (the destination's writes wait for this)."""
        self._pop_attempt(t.request_id)
        try:
            job = job_store.hand_over(_delta(t, "".join(t.unwritten)), to, reason)
        except Exception:  # the destination's final write still carries all its text
            log.exception("job %s: could not hand it over to engine %s", t.job_id, to)
            job = None
        if job is not None:
            self._send([state_update(job.pk, t.attempt, job_store.job_payload(job))])
        t.handle.set("migrated")

    def _end(self, ended: list[_Tracked]) -> list[dict]:
        """Write the final state of attempts that ended (one transaction), wake their
        tasks, and return the state updates to announce."""
        for t in ended:
            self._pop_attempt(t.request_id)
        try:
            jobs = {job.pk: job for job in job_store.finish_jobs([_final_state(t) for t in ended])}
        except Exception:  # their tasks fail the jobs themselves, with the reason
            log.exception("could not write the end of %d jobs", len(ended))
            for t in ended:
                t.handle.set("error")
            return []
        updates = []
        for t in ended:
            job = jobs.get(t.job_id)
            if job is None:
                t.handle.set("fenced")
                continue
            t.handle.set(job.status)
            updates.append(state_update(job.pk, t.attempt, job_store.job_payload(job)))
        return updates

    def _token_logprobs(self, token_ids: list[int], entries: list[list]) -> list[list]:
        """The engine's [logprob, top ids, top logprobs] per token, with token texts:
        [token, logprob, [[token, logprob], ...]] (what the OpenAI answers show)."""
        decode = self.tokenizer.decode
        return [[decode([token]), logprob, [[decode([i]), v] for i, v in zip(ids, values)]]
                for token, (logprob, ids, values) in zip(token_ids, entries)]

    def _absorb(self, t: _Tracked, outs: list[CoreOutput], updates: list[dict]) -> None:
        """One job's outputs since the last flush (in step order): one update. Step by
        step for the text, so that a stop string ends the job at the step that made it
        (tokens the engine produced after it are not the job's)."""
        for out in outs:
            if out.kv_story is not None:
                t.kv_story, t.kv_story_unwritten = out.kv_story, True
            if out.new_token_ids:
                t.token_ids.extend(out.new_token_ids)
                t.detok.add(out.new_token_ids)
                if out.logprobs:
                    t.logprobs += self._token_logprobs(out.new_token_ids, out.logprobs)
                if out.prompt_logprobs:
                    t.prompt_logprobs = self._token_logprobs(
                        [e[0] for e in out.prompt_logprobs], [e[1:] for e in out.prompt_logprobs])
            if t.detok.stopped:  # a stop string: the job ends here
                t.finish_reason = "stop"
                if not out.finished:
                    self.on_stop(t.request_id)  # the engine is told
                break
            if out.finished:
                t.finish_reason = out.finish_reason or ""
                break
        out = outs[-1]
        n = len(t.token_ids)
        if n and t.first_token_at is None:
            t.first_token_at = timezone.now()
        # (a request that moved on holds back what it held back: its text goes on there)
        delta = t.detok.take_delta(t.finish_reason not in (None, MIGRATED))
        if delta or n != t.num_output_tokens:
            update = {"job": t.job_id, "attempt": t.attempt, "offset": t.chars,
                      "text": delta, "n": n}
            if t.siblings is not None:
                update["i"] = t.index
            if out.num_prompt_tokens != t.num_prompt_tokens:  # the attempt's first update
                update["p"], update["c"] = out.num_prompt_tokens, out.num_cached_tokens
            if len(t.logprobs) > t.logprobs_sent:  # (lpo: where they go, as offset)
                update["lp"], update["lpo"] = t.logprobs[t.logprobs_sent:], t.logprobs_sent
                t.logprobs_sent = len(t.logprobs)
            if t.prompt_logprobs and not t.prompt_logprobs_sent:
                update["plp"], t.prompt_logprobs_sent = t.prompt_logprobs, True
            updates.append(update)
        if delta:
            t.text.append(delta)
            t.unwritten.append(delta)
            t.chars += len(delta)
        t.num_output_tokens = n
        t.num_prompt_tokens = out.num_prompt_tokens
        t.num_cached_tokens = out.num_cached_tokens
        t.num_preemptions = out.num_preemptions
        t.dirty = True

    def _write_progress(self) -> None:
        # (a fork's row follows its sample 0)
        dirty = [t for t in self._jobs.values() if t.dirty and not t.index]
        if not dirty:
            return
        adopters = [t for t in dirty if t.adopted]
        deltas = [_delta(t, "".join(t.unwritten)) for t in dirty if not t.adopted]
        fenced, unstored = job_store.record_progress(deltas) if deltas else (set(), set())
        # moved here, the row not handed over yet, or refused by the database: their text
        # waits (a refused row's is written whole at its end, which fails it alone if
        # refused again)
        waiting = {t.request_id for t in dirty if t.attempt_id in unstored}
        if adopters:
            written, lost = job_store.record_adopted(
                [_delta(t, "".join(t.text)) for t in adopters], self.instance)
            fenced |= lost
            for t in adopters:
                if t.attempt_id in written:
                    t.adopted = False
                elif t.attempt_id not in lost:
                    waiting.add(t.request_id)
        self.stats.db_writes += 1
        for request_id in fenced:  # its job runs elsewhere now, or ended: stop this one
            members = self._pop_attempt(request_id if request_id in self._jobs
                                        else f"{request_id}/0")
            if members:
                log.warning("job %s: attempt %s no longer owns it; stopping its request",
                            members[0].job_id, request_id)
                self.on_stop(request_id)  # a fork's parent id stops all its samples
                members[0].handle.set("fenced")
        for t in self._jobs.values():
            if t.dirty and t.request_id not in waiting:
                t.unwritten.clear()
                t.first_token_written = t.first_token_written or t.first_token_at is not None
                t.dirty = t.kv_story_unwritten = False

    def _send(self, updates: list[dict]) -> None:
        try:
            self.producer.send(updates)
        except Exception as e:  # its number is used: readers see the gap and say so
            self.stats.stream_errors += 1
            log.warning("job stream write failed (%d updates): %s", len(updates), e)


def _delta(t: _Tracked, text: str) -> job_store.ProgressDelta:
    """The attempt's progress not in the database yet, its text `text` (what it made
    since the last write, or all of it)."""
    return job_store.ProgressDelta(
        t.job_id, t.attempt_id, text, t.num_output_tokens, t.num_prompt_tokens,
        t.num_cached_tokens, t.num_preemptions,
        t.first_token_at if not t.first_token_written else None,
        t.kv_story if t.kv_story_unwritten else None)


def _final_state(t: _Tracked) -> job_store.FinalState:
    """The row's final state: the attempt's (a fork's: sample 0's, with every sample's
    outcome in `samples`)."""
    samples = [{"text": "".join(s.text), "token_ids": list(s.token_ids),
                "finish_reason": s.finish_reason or "",
                **({"logprobs": s.logprobs} if s.logprobs else {})}
               for s in t.siblings or ()]
    return job_store.FinalState(
        job_id=t.job_id, request_id=t.attempt_id, text="".join(t.text),
        token_ids=list(t.token_ids), num_prompt_tokens=t.num_prompt_tokens,
        num_cached_tokens=t.num_cached_tokens, num_preemptions=t.num_preemptions,
        finish_reason=t.finish_reason or "", first_token_at=t.first_token_at, samples=samples,
        logprobs=t.logprobs, prompt_logprobs=t.prompt_logprobs, kv_story=t.kv_story)
