"""What an engine tells whoever watches it, read from the owners of its parts: what it
is (describe_config), how it is doing (metrics: one formula per figure, which the
service's pages, alerts and what-if read), and its KV state as viewers may keep it
(engine/kv/export.py; the snapshot document built from one)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.block_hash import hash_blocks, root_hash
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv.coordinator import KVCacheCoordinator
from engine.kv.events import KVEvent
from engine.kv.export import KVExport
from engine.kv.pins import Pins
from engine.kv.tiers.base import TIER_POOLS
from engine.model.runner import Runner
from engine.observe.rate_meter import RateMeter
from engine.observe.snapshot import EVICTION_ORDER_LEN
from engine.observe.step_cost import StepCostFit
from engine.observe.tenants import kv_by_tenant
from engine.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from engine.observe.story import StoryBook

PREVIEW_CHARS = 200  # of a block's text in block_facts (a block of odd tokens can be long)


class Reporter:
    def __init__(self, config: EngineConfig, runner: Runner, kv: KVCacheCoordinator,
                 scheduler: Scheduler, pins: Pins, stories: StoryBook | None) -> None:
        self.config = config
        self.runner = runner
        self.kv = kv
        self.scheduler = scheduler
        self.pins = pins
        self.stories = stories
        self._prompt_rate = RateMeter()
        self._gen_rate = RateMeter()

    def record_step(self, now: float) -> None:
        """A step ran: the token rates' next sample."""
        counters = self.scheduler.counters
        self._prompt_rate.record(now, counters.num_prompt_tokens)
        self._gen_rate.record(now, counters.num_generation_tokens)

    def describe_config(self) -> dict:
        config, runner, kv = self.config, self.runner, self.kv
        return {"block_size": config.block_size, "num_gpu_blocks": kv.gpu.num_blocks,
                "num_cpu_blocks": kv.cpu.num_blocks, "model": runner.model_id,
                "dtype": runner.dtype, "device": runner.device,
                "max_model_len": runner.max_model_len, "vocab_size": runner.vocab_size,
                "max_num_seqs": config.max_num_seqs,
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "preemption_mode": config.preemption_mode,
                "scheduling_policy": config.scheduling_policy,
                "enable_prefix_caching": config.enable_prefix_caching,
                "cpu_prefix_cache": kv.cpu_tier,
                "eviction_policy": kv.gpu.eviction_policy,
                "pin_budget": self.pins.budget,
                # tenants: the batch share, everyone's cache quota (its live value),
                # who of the waiting goes first
                "max_batch_share": config.max_batch_share,
                "tenant_cache_quota": kv.gpu.tenants.share,
                "fairness": config.fairness,
                # the disk tier below it (disk_cache_dir): where, and how many bytes
                "disk_cache_dir": config.disk_cache_dir or None,
                "disk_cache_bytes": config.disk_cache_bytes if config.disk_cache_dir else 0,
                # one block's K/V, every layer (what a tier or a move copies per block)
                "kv_bytes_per_block": runner.block_bytes,
                # how K/V is stored: the model's dtype ("auto") or fp8, and how its
                # bytes read (an fp8 cache's scales; blocks move only between alike)
                "kv_cache_dtype": config.kv_cache_dtype,
                "kv_cache_scales": config.kv_cache_scales
                if config.kv_cache_dtype != "auto" else None,
                "kv_format": runner.kv_format,
                "simulate": config.simulate,
                "sliding_window": runner.sliding_window,
                # a hybrid model's layer groups: each one's window (None: global)
                "kv_group_windows": list(runner.kv_group_windows)
                if runner.kv_group_windows else None,
                "tensor_parallel_size": getattr(runner, "tensor_parallel_size", 1),
                "role": config.role,
                # per rank: device, weight, KV and swap bytes (a real model)
                "rank_memory": getattr(runner, "rank_memory", None),
                "model_path": getattr(runner, "model_path", None),
                # the HF folder of the tokenizer (a real model's folder; the simulator's
                # when it has one; None: the simulator's byte tokenizer)
                "tokenizer_path": getattr(runner, "tokenizer_path",
                                          getattr(runner, "model_path", None))}

    def lookup_prefix(self, token_ids: list[int], cache_salt: str | None) -> dict:
        """How many leading tokens of token_ids the prefix cache holds now under
        cache_salt (KVCacheCoordinator.leading_cached): per level (`gpu`, `cpu`, `disk`;
        None for a tier this engine has not) the tokens of the leading cached run found
        there, and `cached_tokens`, the whole run. Full blocks only."""
        bs = self.config.block_size
        model_id = self.runner.model_id
        hashes = hash_blocks(root_hash(model_id, cache_salt), token_ids, bs)
        shared = hash_blocks(root_hash(model_id, None), token_ids, bs) if cache_salt else None
        blocks = self.kv.leading_cached(hashes, shared)
        levels = {pool: None for pool in ("gpu", *TIER_POOLS)}
        levels.update({pool: n * bs for pool, n in blocks.items()})
        return {"num_prompt_tokens": len(token_ids), "block_size": bs, "tiers": levels,
                "cached_tokens": sum(blocks.values()) * bs}

    def metrics(self, step_count: int, step_seconds: float, state: str,
                step_cost: StepCostFit | None = None) -> dict:
        """state: the operator's (LLMEngine.state); step_cost: the fit of its steps'
        time to their shapes (engine/observe/step_cost.py), once there are enough."""
        now = time.time()
        kv, sched = self.kv, self.scheduler
        c = sched.counters
        paused = state == "paused"
        return {
            "kv_usage": kv.gpu.usage,
            "cpu_kv_usage": kv.cpu.usage,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_cached_blocks": len(kv.gpu.cached),
            # the tiers of the prefix cache (the CPU tier's, the disk's), each its own
            # hits (blocks the disk read back into the CPU tier are the disk's)
            **kv.tier_metrics(self.runner.block_bytes),
            "num_pinned_blocks": kv.gpu.num_pinned,
            "num_soft_pinned_blocks": kv.gpu.num_soft_pinned,
            "pin_budget": self.pins.budget,
            "eviction_policy": kv.gpu.eviction_policy,
            "num_preemptions": c.num_preemptions,
            "num_swaps_out": c.num_swaps_out,
            "num_swaps_in": c.num_swaps_in,
            "preemptions_by_reason": dict(c.preemptions_by_reason),
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "swapped": len(sched.swapped),
            "num_prompt_tokens": c.num_prompt_tokens,
            "num_generation_tokens": c.num_generation_tokens,
            # 0 while paused: no step runs, whatever the last ones made
            "prompt_tokens_per_s": self._prompt_rate.rate(now, paused),
            "generation_tokens_per_s": self._gen_rate.rate(now, paused),
            "num_steps": step_count,
            "step_seconds": step_seconds,
            # ms a step costs, by its shape, and how well that fits (None: too few steps)
            "step_cost": step_cost.as_dict() if step_cost is not None else None,
            "state": state,  # (an operator's pause or drain)
            # Load, for routing: tokens the engine still has to hold or compute.
            "running_tokens": sum(r.num_tokens for r in sched.running),
            "waiting_tokens": sum(r.num_tokens for r in sched.waiting),
            # per tenant: blocks held by tier, cached, block-seconds (the top ones named)
            "kv_by_tenant": kv_by_tenant(kv.block_seconds.by_tenant(), kv.gpu.cached_by_tenant(),
                                         self.config.metrics_top_tenants,
                                         {t.pool: t.cached_by_tenant() for t in kv.tiers}),
            # the KV history's: tokens missed by reason, block residency histograms
            **(self.stories.metrics() if self.stories is not None else {}),
        }

    def export(self, events: list[KVEvent], full_scan: bool, pins: bool, step: int,
               version: int, metrics: dict) -> KVExport:
        """The KV state as viewers may keep it (engine/kv/export.py), built by its owners
        on the loop's thread: the scheduler's request rows, the KV core's tables per pool
        (with pins and a copy of the hash map when asked), the eviction order, the
        metrics, and `events` (taken by the caller) riding along."""
        kv = self.kv
        rows, index_of = self.scheduler.export_rows(kv.window_freed_counts)
        return KVExport(
            ts=time.time(), step=step, version=version, requests=rows,
            gpu=kv.export_pool("gpu", index_of, full_scan, pins),
            cpu=kv.export_pool("cpu", index_of, full_scan, pins),
            eviction_order=kv.gpu.eviction_order(EVICTION_ORDER_LEN), metrics=metrics,
            events=events, events_on=self.config.max_pending_events > 0)

    def block_facts(self, pool: str, block_id: int) -> dict:
        """What the snapshot does not carry about one block, for a viewer hovering it:
        seconds since its last holder let it go (`idle_s`, None while held), its place
        in the eviction order among the free cached blocks (`eviction`: {place, of}, None
        if it is not one), and per request holding it (group 0's tables, as the snapshot
        shows them) the tokens it covers and their text (`holders`: request_id, job_id,
        tenant, tokens [start, end), text). The service decides who may read the text
        (kvops/dashboard/visibility.py)."""
        if pool not in ("gpu", "cpu"):
            raise InvalidRequestError("`pool` must be gpu or cpu")
        blocks = self.kv.gpu if pool == "gpu" else self.kv.cpu
        if isinstance(block_id, bool) or not isinstance(block_id, int) \
                or not 0 <= block_id < blocks.num_blocks:
            raise InvalidRequestError(f"`block_id` must be an integer in [0, {blocks.num_blocks})")
        place = blocks.eviction_place(block_id)
        return {"pool": pool, "block_id": block_id, "idle_s": blocks.idle_s(block_id),
                "eviction": None if place is None else {"place": place[0], "of": place[1]},
                "holders": self._holders(pool, block_id)}

    def _holders(self, pool: str, block_id: int) -> list[dict]:
        tables = self.kv.req_to_blocks if pool == "gpu" else self.kv.req_to_cpu_blocks
        size = self.config.block_size
        out = []
        for request_id, table in tables.items():
            request = self.scheduler.requests.get(request_id)
            position = next((k for k, b in enumerate(table) if b.block_id == block_id), None)
            if request is None or position is None:
                continue
            start = (position + self.kv.window_freed(request_id)) * size
            end = min(start + size, request.num_tokens)
            out.append({"request_id": request_id, "job_id": request.job_id,
                        "tenant": request.tenant, "tokens": [start, end],
                        "text": self._text(request.all_token_ids[start:end])})
        return out

    def _text(self, token_ids: list[int]) -> str:
        text = self.runner.tokenizer.decode(token_ids) if token_ids else ""
        return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "…"

    def snapshot(self, export: KVExport, compact: bool, seq: int) -> dict:
        """The snapshot document of one full export (engine/observe/view.py's KVMirror
        builds it: one builder for this, the dashboard and the timeline's keyframes);
        compact=True encodes per-block arrays in base64."""
        from engine.observe.view import KVMirror

        mirror = KVMirror(self.config.name, "", self.describe_config())
        mirror.apply(export)
        doc = mirror.snapshot(compact)
        del doc["type"], doc["epoch"]
        doc["seq"] = seq
        return doc
