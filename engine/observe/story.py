"""The KV story of a request: where its prompt's blocks came from, why the first one that
missed was not cached (proved from the history of its hash), and what its blocks went
through while it ran (preemptions with their causes, copies on write, blocks a sliding
window gave back).

Two parts, both readers of the KV event stream (engine/kv/events.py), fed by the engine
after each step and at each first admission (so that an admission sees every event
before it, even one of the same step):
* KVHistory: per block hash (group 0's: the chain routers and pins know), when it was
  stored and by whom, its hits, when a sliding window gave it back, and when, why and
  for whom it left the cache; bounded (the least recently touched records go first,
  into a Bloom filter that remembers only that the hash was seen). A reset is one
  event, not one per block: the history keeps the last resets, and a record stored
  before one and not removed since was forgotten by it.
* StoryBook: the story of each live request, begun at its first admission and handed
  out (LLMEngine.kv_story, the core's outputs) with every change.

Reasons for a first miss (FIRST_MISS_REASONS) are proved, never guessed: where the
history cannot tell (a hash it dropped, events it lost), the reason is "unknown" and
the detail says why. Two reasons need more than one engine's view and are settled by
the service: `other_engine` (the router saw the prefix on another engine) and the
names behind request ids. Times are Unix seconds (the service writes them as ISO 8601).
"""
from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from engine.block_hash import BlockHash, hash_blocks, short
from engine.kv.events import REASONS, EventQueue, KVEvent

FIRST_MISS_REASONS = {
    "never_cached": "no engine block has held this hash within the history kept",
    "evicted": "its block was taken for another request's new blocks",
    "reset": "the prefix cache was reset",
    "operator_evict": "an operator evicted it",
    "salt": "these tokens are cached, under another tenant's cache salt",
    "other_engine": "another engine holds it (a routing miss)",
    "window": "a sliding window gave the block back",
    "caching_off": "prefix caching is off",
    "partial_block": "only the last block missed: it holds the prompt's last token, "
                     "which is always computed",
    "unknown": "the history cannot tell",
}
# Why a request was preempted (recompute) or swapped out; a swap in is the operator's
# ("operator") or the scheduler's once blocks came back (None). What each count means:
# engine/sched/scheduler.py, above SchedulerCounters.
PREEMPTION_REASONS = ("kv_full", "priority", "fairness", "cache_quota", "operator")
# Bounds (seconds) of the block residency histograms (vLLM's kv_block_* names)
RESIDENCY_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
_RESETS_KEPT = 64  # the newest resets the history remembers
STORY_QUEUE_MAX = 1 << 20  # events between two catch-ups; more are dropped (and said)


@dataclass(slots=True)
class HashRecord:
    """What happened to one hash (group 0's), newest facts only."""
    stored_at: float
    stored_by: str | None  # the request whose block first held it (this time)
    first_stored_at: float  # the first store the history saw
    hits: int = 0
    last_hit: float | None = None
    window_at: float | None = None  # a sliding window gave its block back (while cached)
    removed_at: float | None = None  # the last time it left the GPU pool's cache
    removed_reason: str | None = None  # a key of events.REASONS
    removed_by: str | None = None  # the request it was taken for, or who evicted it
    cpu_removed_at: float | None = None  # the last time it left the CPU tier

    @property
    def live(self) -> bool:
        """Stored since it was last removed."""
        return self.removed_at is None or self.removed_at < self.stored_at


class Histogram:
    """Counts per bucket (not cumulative) and the sum, as the metrics carry them."""

    def __init__(self, bounds: tuple[float, ...] = RESIDENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = 0
        while i < len(self.bounds) and value > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.sum += value

    def as_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class _Bloom:
    """Hashes the history dropped: 'maybe seen' or 'never seen' (no false negatives)."""

    def __init__(self, num_items: int) -> None:
        self.bits = max(1 << 16, 16 * num_items)  # ~2 bytes per record: ~0.1% false positives
        self._array = bytearray(self.bits // 8)

    def _indices(self, key: str) -> tuple[int, int]:
        value = int(key, 16)
        return (value & 0xFFFFFFFF) % self.bits, (value >> 32) % self.bits

    def add(self, key: str) -> None:
        for i in self._indices(key):
            self._array[i >> 3] |= 1 << (i & 7)

    def __contains__(self, key: str) -> bool:
        return all(self._array[i >> 3] & (1 << (i & 7)) for i in self._indices(key))


class KVHistory:
    """Per hash, what happened to it (HashRecord), for the newest `max_blocks` hashes."""

    def __init__(self, max_blocks: int, sample: float = 0.01) -> None:
        self.max_blocks = max_blocks
        # Block residency, for a `sample` share of hashes (chosen by the hash, so a
        # block is followed through its life): stored -> evicted, last touched ->
        # evicted, and the gap between two hits
        self._sample_below = int(sample * (1 << 32))
        self.lifetime = Histogram()
        self.idle_before_evict = Histogram()
        self.reuse_gap = Histogram()
        self._records: collections.OrderedDict[str, HashRecord] = collections.OrderedDict()
        self._dropped = _Bloom(max_blocks)
        self.num_dropped = 0  # records pushed out by the bound
        self.resets: collections.deque[tuple[float, str | None]] = \
            collections.deque(maxlen=_RESETS_KEPT)
        self.lost_events = 0  # events the queue dropped before they were read
        # Per content (the unsalted chain's hash): the hash it was last admitted under
        # (its tenant's salt in it), so that a salted miss can tell "cached under another
        # salt" (StoryBook.admitted fills it)
        self._content: collections.OrderedDict[str, BlockHash] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: str) -> HashRecord | None:
        return self._records.get(key)

    def maybe_dropped(self, key: str) -> bool:
        return key in self._dropped

    def _touch(self, key: str, ts: float, by: str | None) -> HashRecord:
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = HashRecord(ts, by, ts)
            if len(self._records) > self.max_blocks:
                old, _ = self._records.popitem(last=False)
                self._dropped.add(old)
                self.num_dropped += 1
        else:
            self._records.move_to_end(key)
        return record

    def note_content(self, content: list[str], salted: list[BlockHash]) -> None:
        """A request's prompt blocks: their unsalted and (its) salted hashes."""
        index = self._content
        for key, block_hash in zip(content, salted):
            if key in index:
                index.move_to_end(key)
            index[key] = block_hash
        while len(index) > self.max_blocks:
            index.popitem(last=False)

    def salted_elsewhere(self, content: str, mine: BlockHash) -> BlockHash | None:
        """The hash these tokens were last admitted under, if not `mine`."""
        other = self._content.get(content)
        return other if other != mine else None

    def apply(self, event: KVEvent) -> None:
        kind = event.type
        if event.group:
            return  # other groups' hashes are their own: the story follows group 0's
        if kind == "BlockStored":
            if event.pool != "gpu":
                return
            for key in event.block_hashes:
                record = self._touch(key, event.ts, event.request_id)
                if not record.live or record.stored_by is None:
                    record.stored_by = event.request_id
                record.stored_at = event.ts
        elif kind == "PrefixHit":
            if event.pool != "gpu":
                return
            for key in event.block_hashes:
                record = self._records.get(key)
                if record is not None:
                    if self._sampled(key):
                        self.reuse_gap.observe(event.ts - (record.last_hit or record.stored_at))
                    record.hits += 1
                    record.last_hit = event.ts
        elif kind == "BlockEvicted":
            for key in event.block_hashes:
                record = self._records.get(key)
                if record is None:
                    continue
                if event.pool == "cpu":
                    record.cpu_removed_at = event.ts
                elif event.pool == "gpu":  # (the disk tier's departures are its own)
                    record.removed_at, record.removed_reason = event.ts, event.reason
                    record.removed_by = event.by
                    if self._sampled(key):
                        self.lifetime.observe(event.ts - record.stored_at)
                        self.idle_before_evict.observe(
                            event.ts - max(record.stored_at, record.last_hit or 0.0))
        elif kind == "WindowFreed":
            for key in event.block_hashes:
                record = self._records.get(key)
                if record is not None:
                    record.window_at = event.ts
        elif kind == "AllBlocksCleared":
            self.resets.append((event.ts, event.by))

    def _sampled(self, key: str) -> bool:
        return int(key[:8], 16) < self._sample_below

    def reset_after(self, ts: float) -> tuple[float, str | None] | None:
        """The first reset after `ts`, if the history still knows it."""
        for at, by in self.resets:
            if at >= ts:
                return at, by
        return None


@dataclass(slots=True)
class Story:
    """One request's KV story as it grows (StoryBook)."""
    request_id: str
    job_id: str | None
    block_size: int
    prompt_tokens: int
    hashes: list[str]  # short hex of the prompt's full blocks (group 0's)
    gpu_blocks: int  # leading blocks served from the GPU pool's cache
    cpu_blocks: int  # then from the CPU tier
    cached: dict[str, int]  # prompt tokens not computed, by where they came from
    first_miss: dict | None
    admitted_at: float
    preemptions: list[dict] = field(default_factory=list)  # recompute preemptions
    copy_on_write: int = 0
    window_freed: int = 0
    first_token_at: float | None = None
    ended_at: float | None = None
    finish_reason: str | None = None
    disk_blocks: int = 0  # then read back from the disk tier (through the pool above it)
    swaps: list[dict] = field(default_factory=list)  # swaps out and in, oldest first
    moves: list[dict] = field(default_factory=list)  # moves in from other engines
    # the blocks it held at its end (group 0's, table order, {"gpu": [...], "cpu": [...]}):
    # what the job page shows once it ended; None until then
    final_blocks: dict | None = None
    # the blocks its last release gave back (BlockRemoved), since its last preemption or
    # swap: at its end, its final blocks
    released: dict = field(default_factory=dict)
    arrived_at: float | None = None  # when it reached the engine (its arrival_time)
    # KV block-seconds by pool ({"gpu", "cpu"}) told so far: another engine's before it
    # moved here, a forked parent's (its first sample's), its own here once it ended
    block_seconds: dict = field(default_factory=dict)

    def document(self, engine: str, held: dict | None = None) -> dict:
        """held: the block-seconds of a live request here so far (BlockSeconds.spent)."""
        gpu, cpu = self.gpu_blocks, self.cpu_blocks
        return {
            "engine": engine, "request_id": self.request_id, "job_id": self.job_id,
            "block_size": self.block_size, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": dict(self.cached), "hashes": list(self.hashes),
            "sources": {"gpu": gpu, "cpu": cpu, "disk": self.disk_blocks},
            "first_miss": dict(self.first_miss) if self.first_miss else None,
            "preemptions": [dict(p) for p in self.preemptions],
            "swaps": [dict(s) for s in self.swaps], "moves": [dict(m) for m in self.moves],
            "copy_on_write": self.copy_on_write, "window_freed": self.window_freed,
            "final_blocks": {k: list(v) for k, v in self.final_blocks.items()}
            if self.final_blocks is not None else None,
            "moments": {"arrived": self.arrived_at, "admitted": self.admitted_at,
                        "first_token": self.first_token_at,
                        "preemptions": [p["at"] for p in self.preemptions],
                        "ended": self.ended_at},
            "finish_reason": self.finish_reason,
            "block_seconds": add_block_seconds(self.block_seconds, held),
        }


def add_block_seconds(a: dict | None, b: dict | None) -> dict[str, float]:
    """Two block-seconds maps added, pool by pool ({"gpu": 0.0, "cpu": 0.0} for none)."""
    a, b = a or {}, b or {}
    return {pool: a.get(pool, 0.0) + b.get(pool, 0.0) for pool in ("gpu", "cpu")}


def check_document(document: object) -> None:
    """ValueError unless `document` is a story as Story.document writes it, as far as
    StoryBook.arrived reads it (a request moving in brings its story from its source):
    every field of its type, maps and lists of plain values only."""
    def scalar(x: object) -> bool:
        return x is None or isinstance(x, (str, int, float, bool))

    def plain_map(x: object) -> bool:
        return isinstance(x, dict) and all(isinstance(k, str) and scalar(v)
                                           for k, v in x.items())

    def count(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    def moment(x: object) -> bool:
        return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))

    d = document
    ok = isinstance(d, dict) and isinstance(d.get("request_id"), str) and \
        (d.get("job_id") is None or isinstance(d["job_id"], str)) and \
        count(d.get("block_size")) and count(d.get("prompt_tokens")) and \
        isinstance(d.get("hashes"), list) and all(isinstance(h, str) for h in d["hashes"]) and \
        isinstance(d.get("sources"), dict) and count(d["sources"].get("gpu")) and \
        count(d["sources"].get("cpu")) and count(d["sources"].get("disk", 0)) and \
        plain_map(d.get("cached_tokens")) and \
        (d.get("first_miss") is None or plain_map(d["first_miss"])) and \
        isinstance(d.get("moments"), dict) and moment(d["moments"].get("admitted")) and \
        moment(d["moments"].get("first_token")) and \
        all(isinstance(d.get(k, []), list) and all(plain_map(x) and moment(x.get("at"))
                                                   for x in d.get(k, []))
            for k in ("preemptions", "swaps", "moves")) and \
        isinstance(d.get("preemptions"), list) and \
        count(d.get("copy_on_write")) and count(d.get("window_freed")) and \
        (d.get("block_seconds") is None or
         (plain_map(d["block_seconds"]) and
          all(moment(v) and (v or 0) >= 0 for v in d["block_seconds"].values())))
    if not ok:
        raise ValueError("not a KV story document")


class StoryBook:
    """The stories of live requests (and of the last ended ones, until handed out)."""

    def __init__(self, engine_name: str, max_blocks: int, queue: EventQueue,
                 keep_ended: int = 1024, sample: float = 0.01,
                 held: Callable[[str], dict] | None = None) -> None:
        """held: a live request's block-seconds here so far (the KV coordinator's
        BlockSeconds.spent); None: stories tell only what the events carried."""
        self.engine_name = engine_name
        self._held = held
        self.history = KVHistory(max_blocks, sample)
        # prompt tokens computed at first admissions, by the first miss's reason (a full
        # hit's: its last, partly filled block, "partial_block")
        self.missed_tokens: collections.Counter = collections.Counter()
        self._queue = queue
        self._stories: dict[str, Story] = {}
        self.awaiting_first_token: set[str] = set()
        self._ended: collections.OrderedDict[str, Story] = collections.OrderedDict()
        self._keep_ended = keep_ended
        self.changed: set[str] = set()  # request ids whose story changed since taken

    # --- feeding ---------------------------------------------------------------------
    def catch_up(self) -> None:
        """Read every event emitted so far (the stories lag the engine until this runs)."""
        if self._queue.num_dropped:
            self.history.lost_events += self._queue.num_dropped
            self._queue.num_dropped = 0
        for event in self._queue.take():
            self.history.apply(event)
            if event.request_id is not None:
                self._on_request_event(event)

    def _on_request_event(self, event: KVEvent) -> None:
        story = self._stories.get(event.request_id)
        if story is None:
            return
        kind = event.type
        if kind == "BlockRemoved":  # (told at its end, with Finished)
            if not event.group:
                story.released[event.pool] = list(event.block_ids)
            return
        if kind in ("Preempted", "SwappedOut", "SwappedIn"):
            story.released = {}
        if kind == "Preempted" and event.reason is not None:
            story.preemptions.append({
                "at": event.ts, "reason": event.reason, "by": event.by,
                "needed_blocks": event.needed_blocks, "free_blocks": event.free_blocks,
                "recomputed_tokens": event.dropped_tokens or 0})
        elif kind in ("SwappedOut", "SwappedIn"):
            out = kind == "SwappedOut"
            story.swaps.append({
                "at": event.ts, "direction": "out" if out else "in", "reason": event.reason,
                "by": event.by, "needed_blocks": event.needed_blocks if out else None,
                "free_blocks": event.free_blocks if out else None,
                "blocks": len(event.block_ids)})
        elif kind == "CopiedOnWrite":
            story.copy_on_write += 1
        elif kind == "WindowFreed":
            story.window_freed += len(event.block_ids)
        elif kind == "Forked":  # its samples carry the story on; the parent's ends
            n = int((event.detail or "0").split()[0])
            story.block_seconds = add_block_seconds(story.block_seconds, event.block_seconds)
            self.forked(story.request_id, [f"{story.request_id}/{i}" for i in range(n)])
            self._stories.pop(story.request_id, None)
            self.awaiting_first_token.discard(story.request_id)
            self.changed.discard(story.request_id)
            return
        elif kind == "Finished":
            story.ended_at, story.finish_reason = event.ts, event.detail
            story.block_seconds = add_block_seconds(story.block_seconds, event.block_seconds)
            story.final_blocks = {"gpu": story.released.get("gpu", []),
                                  "cpu": story.released.get("cpu", [])}
            story.released = {}
            if story.first_token_at is None and (event.num_tokens or 0) > story.prompt_tokens:
                story.first_token_at = event.ts  # its first token came in its last step
            self._end(story)
        else:
            return
        self.changed.add(story.request_id)

    def _end(self, story: Story) -> None:
        self._stories.pop(story.request_id, None)
        self.awaiting_first_token.discard(story.request_id)
        self._ended[story.request_id] = story
        while len(self._ended) > self._keep_ended:
            self._ended.popitem(last=False)

    def first_token(self, request_id: str, ts: float) -> None:
        if request_id in self.awaiting_first_token:
            self.awaiting_first_token.discard(request_id)
            story = self._stories.get(request_id) or self._ended.get(request_id)
            if story is not None:
                story.first_token_at = ts
                self.changed.add(request_id)

    def forget_ended_changes(self) -> None:
        """Changes of stories that ended went out with their final output, if any."""
        self.changed.intersection_update(self._stories)

    def hand_out(self, outputs: list, requests: dict) -> None:
        """A step's outputs (CoreOutput): each request whose story changed gets it with
        its output (kv_story). requests: the live ones by id (a first token is noted)."""
        self.catch_up()
        if self.awaiting_first_token:
            now = time.time()
            for rid in list(self.awaiting_first_token):
                request = requests.get(rid)
                if request is not None and request.output_token_ids:
                    self.first_token(rid, now)
        changed = self.changed
        if changed:
            for o in outputs:
                if o.request_id in changed:
                    o.kv_story = self.story(o.request_id)
                    changed.discard(o.request_id)
            self.forget_ended_changes()

    def forked(self, parent_id: str, child_ids: list[str]) -> None:
        """A request with n > 1 became its samples: each carries its story on."""
        story = self._stories.get(parent_id)
        if story is None:
            return
        for i, child in enumerate(child_ids):
            # the parent's block-seconds go on in its first sample's story only, so that
            # the samples' add up to what was held
            self._stories[child] = dataclasses.replace(
                story, request_id=child, cached=dict(story.cached),
                preemptions=list(story.preemptions), swaps=list(story.swaps),
                moves=list(story.moves), released={},
                block_seconds=dict(story.block_seconds) if i == 0 else {})
            self.changed.add(child)
            if story.first_token_at is None:
                self.awaiting_first_token.add(child)

    # --- admission -------------------------------------------------------------------
    def draft(self, request, gpu_blocks: int, cpu_blocks: int, num_cached: int,
              where, off: str | None, windowed: bool, disk_blocks: int = 0) -> Story:
        """The story of a request about to be admitted for the first time, told before
        it takes any block: `gpu_blocks` and `cpu_blocks` of its prompt's leading full
        blocks were found cached (num_cached tokens not computed); `where` (a hash ->
        "gpu" | "cpu" | None) says where a hash is cached now; `off`: why no cache was
        read (None: it was); `windowed`: a sliding layer group may have shortened the
        hit. admitted() keeps it once the request has its blocks."""
        self.catch_up()
        at = time.time()
        bs = request.block_size
        prompt_hashes = request.block_hashes[:request.num_prompt_tokens // bs]
        keys = [short(h) for h in prompt_hashes]
        gpu_tokens = min(gpu_blocks * bs, num_cached)
        # (of the tier's blocks, those read back from disk: after the CPU tier's run)
        disk_tokens = min(disk_blocks * bs, num_cached - gpu_tokens)
        story = Story(request.request_id, request.job_id, bs, request.num_prompt_tokens, keys,
                      gpu_blocks, cpu_blocks - disk_blocks,
                      {"gpu": gpu_tokens, "cpu": num_cached - gpu_tokens - disk_tokens,
                       "disk": disk_tokens}, None, at, disk_blocks=disk_blocks,
                      arrived_at=request.arrival_time)
        story.first_miss = self._first_miss(request, prompt_hashes, gpu_blocks + cpu_blocks,
                                            where, at, off, windowed)
        return story

    def admitted(self, request, story: Story) -> None:
        n = len(story.hashes)
        content = story.hashes if request.pinned_root is None else _content_keys(request, n)
        self.history.note_content(content, request.block_hashes[:n])
        reason = story.first_miss["reason"] if story.first_miss else "partial_block"
        self.missed_tokens[reason] += story.prompt_tokens - sum(story.cached.values())
        self._stories[request.request_id] = story
        # (handed out with its first token, or its end if that comes first)
        self.awaiting_first_token.add(request.request_id)

    def _first_miss(self, request, prompt_hashes: list[BlockHash], hit: int, where,
                    at: float, off: str | None, windowed: bool) -> dict | None:
        if off is not None:
            return _miss(0, "caching_off", None, None, off) if prompt_hashes else None
        if hit >= len(prompt_hashes):
            return None
        block_hash = prompt_hashes[hit]
        key = short(block_hash)
        here = where(block_hash)
        if here is not None:
            if hit == len(prompt_hashes) - 1 and \
                    request.num_prompt_tokens == len(prompt_hashes) * request.block_size:
                return _miss(hit, "partial_block", None, None,
                             f"block {hit} is cached ({here.upper()}) but holds the prompt's "
                             "last token, which is always computed")
            if windowed:
                return _miss(hit, "window", None, None,
                             f"block {hit} is cached for the full-attention layers, but the "
                             "sliding-window layers had given their copy back")
            return _miss(hit, "unknown", None, None,
                         f"block {hit} is cached ({here.upper()}) but was not served: "
                         "it was being written by the same step")
        record = self.history.get(key)
        if record is None or record.first_stored_at > at:
            other = self.history.salted_elsewhere(_content_keys(request, hit + 1)[hit],
                                                  block_hash)
            if other is not None and where(other) is not None:
                return _miss(hit, "salt", None, None,
                             f"the tokens of block {hit} are cached under another tenant's "
                             f"cache salt (hash {short(other)}); cache salts keep tenants' "
                             "prefixes apart")
            if self.history.lost_events:
                return _miss(hit, "unknown", None, None,
                             f"no record of block {hit}'s hash, but the history lost "
                             f"{self.history.lost_events} events")
            if self.history.maybe_dropped(key):
                return _miss(hit, "unknown", None, None,
                             f"block {hit}'s hash was seen before the history's depth "
                             f"({self.history.max_blocks} hashes); why it left is no "
                             "longer known")
            return _miss(hit, "never_cached", None, None,
                         f"no block on this engine has held block {hit}'s hash since it "
                         "started")
        reset = self.history.reset_after(record.stored_at)
        removed = record.removed_at if record.removed_at is not None and \
            record.removed_at >= record.stored_at else None
        if reset is not None and (removed is None or reset[0] <= removed):
            return _miss(hit, "reset", reset[0], reset[1],
                         f"block {hit} was forgotten when the prefix cache was reset at "
                         f"{_clock(reset[0])}" + (f" by {reset[1]}" if reset[1] else ""))
        if removed is None:
            return _miss(hit, "unknown", None, None,
                         f"block {hit}'s hash was stored at {_clock(record.stored_at)} and "
                         "no removal is recorded, yet it was not found")
        reason, by = record.removed_reason, record.removed_by
        if reason == "evicted":
            if record.window_at is not None and record.window_at >= record.stored_at:
                return _miss(hit, "window", removed, by,
                             f"block {hit} was given back by a sliding window at "
                             f"{_clock(record.window_at)}, then reused at {_clock(removed)}"
                             + (f" for {by}" if by else "") + " (least recently used)")
            return _miss(hit, "evicted", removed, by,
                         f"block {hit} was evicted at {_clock(removed)}"
                         + (f" to make room for {by}" if by else "")
                         + " (least recently used first)"
                         + (f"; it had served {record.hits} hit"
                            + ("s" if record.hits > 1 else "") if record.hits else ""))
        if reason == "operator_evict":
            return _miss(hit, "operator_evict", removed, by,
                         f"block {hit} was evicted by an operator"
                         + (f" ({by})" if by and by != "operator" else "")
                         + f" at {_clock(removed)}")
        return _miss(hit, "unknown", removed, by,
                     f"block {hit} left the cache at {_clock(removed)}: "
                     + REASONS.get(reason or "", reason or "no reason recorded"))

    # --- reading ---------------------------------------------------------------------
    def story(self, request_id: str) -> dict | None:
        story = self._stories.get(request_id)
        if story is not None:  # (live: its block-seconds here so far too)
            held = self._held(request_id) if self._held is not None else None
            return story.document(self.engine_name, held)
        story = self._ended.get(request_id)
        return None if story is None else story.document(self.engine_name)

    def current(self, request_id: str) -> dict | None:
        """story(), with every event emitted so far read first."""
        self.catch_up()
        return self.story(request_id)

    def discard(self, request_id: str) -> None:
        """A request that arrived here and was given back (its fork's move failed)."""
        self._stories.pop(request_id, None)
        self.changed.discard(request_id)
        self.awaiting_first_token.discard(request_id)

    def arrived(self, document: dict, source: str, blocks_sent: int) -> None:
        """A request moved here from engine `source` (engine/transfer/migration.py): its story goes
        on from the one told there, the hop a preemption with reason `migration`."""
        self.catch_up()
        story = Story(
            document["request_id"], document["job_id"], document["block_size"],
            document["prompt_tokens"], list(document["hashes"]), document["sources"]["gpu"],
            document["sources"]["cpu"], dict(document["cached_tokens"]),
            document["first_miss"], document["moments"]["admitted"],
            [dict(p) for p in document["preemptions"]], document["copy_on_write"],
            document["window_freed"], document["moments"]["first_token"],
            disk_blocks=document["sources"].get("disk", 0),
            swaps=[dict(s) for s in document.get("swaps", [])],
            moves=[dict(m) for m in document.get("moves", [])],
            arrived_at=document["moments"].get("arrived"),
            block_seconds=add_block_seconds(document.get("block_seconds"), None))
        story.moves.append({"at": time.time(), "from": source, "blocks_sent": blocks_sent})
        self._stories[story.request_id] = story
        if story.first_token_at is None:
            self.awaiting_first_token.add(story.request_id)
        self.changed.add(story.request_id)

    def metrics(self) -> dict:
        h = self.history
        return {"missed_tokens_by_reason": dict(self.missed_tokens),
                "kv_history_blocks": len(h), "kv_history_dropped": h.num_dropped,
                "kv_block_lifetime_seconds": h.lifetime.as_dict(),
                "kv_block_idle_before_evict_seconds": h.idle_before_evict.as_dict(),
                "kv_block_reuse_gap_seconds": h.reuse_gap.as_dict()}


def _content_keys(request, n: int) -> list[str]:
    """Short hashes of the first n prompt blocks' tokens under no cache salt (a salted
    request's own chain otherwise: the same tokens of every tenant share these)."""
    if request.pinned_root is None:
        return [short(h) for h in request.block_hashes[:n]]
    bs = request.block_size
    return [short(h) for h in hash_blocks(request.pinned_root,
                                          request.prompt_token_ids[:n * bs], bs)]


def _miss(block: int, reason: str, at: float | None, by: str | None, detail: str) -> dict:
    return {"block": block, "reason": reason, "at": at, "by": by, "detail": detail}


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%H:%M:%S UTC")
