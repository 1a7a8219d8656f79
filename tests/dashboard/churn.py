"""A simulated engine pushed through everything the dashboard draws: shared prefixes,
preemption, swap out and in, pins, evictions, resets, aborts."""
from __future__ import annotations

import random

from engine import EngineConfig, EngineError, LLMEngine, SamplingParams


def churn_engine(**overrides) -> LLMEngine:
    config = dict(simulate=True, simulate_tokenizer="bytes",
                  vocab_size=1000, block_size=4, num_gpu_blocks=96,
                  num_cpu_blocks=48, max_num_seqs=12, max_num_batched_tokens=64, name="t")
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


TENANTS = ("A", "B", None)


class Churn:
    """One random operator action or new request, then a step, per call."""

    def __init__(self, engine: LLMEngine, seed: int = 0, vocab: int = 1000) -> None:
        """Requests take turns among TENANTS (a cached block's tenant is mirrored too)."""
        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = vocab  # prompts' token ids are below it
        self.shared = [self.rng.randrange(vocab) for _ in range(12)]
        self.count = 0
        self.seen: set[str] = set()  # kinds of action that succeeded at least once

    def __call__(self) -> None:
        e, rng, sched = self.engine, self.rng, self.engine.scheduler
        self.count += 1
        roll = rng.random()
        actions = [
            (0.25, "add", lambda: e.add_request(
                f"r{self.count}", self.shared + [rng.randrange(self.vocab) for _ in
                                                 range(rng.randrange(1, 20))],
                SamplingParams(max_tokens=rng.randrange(1, 40)), job_id=str(self.count),
                tenant=TENANTS[self.count % len(TENANTS)])),
            (0.30, "preempt", lambda: e.preempt(rng.choice(sched.running).request_id)),
            (0.36, "swap_out", lambda: e.swap_out(rng.choice(sched.running).request_id)),
            (0.42, "swap_in", lambda: e.swap_in(sched.swapped[0].request_id)),
            (0.46, "pin", lambda: e.pin_prefix(self.shared)),
            (0.49, "unpin", lambda: e.unpin_prefix(self.shared)),
            (0.51, "evict", lambda: e.evict_cached_blocks(3)),
            (0.52, "reset", lambda: e.reset_prefix_cache()),
            (0.55, "abort", lambda: e.abort(rng.choice(list(sched.requests)))),
        ]
        for threshold, kind, action in actions:
            if roll < threshold:
                try:
                    action()
                    self.seen.add(kind)
                except (EngineError, IndexError):
                    pass  # refused (wrong state, nothing to act on): fine for churn
                break
        e.step()
