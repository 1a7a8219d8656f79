"""The routing index of cached prefixes (kvops/routing/prefix_index.py) with the CPU tier: a
real simulated engine's KV events feed it in Redis, a prefix pushed off the GPU onto
the tier still counts for routing, and the full rewrite agrees with the events."""
import uuid

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.serve.commands import run_command
from engine.observe.feed import prefix_changes
from kvops import live
from kvops.routing import prefix_index
from kvops.intake.prompts import inspector

BLOCK = 4


class Commands:
    """The engine's operator commands, as the worker's PrefixIndex sends them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def command(self, name: str, arguments: dict):
        return run_command(self.engine, name, arguments)


def finish(engine: LLMEngine, rid: str, prompt: list[int]) -> None:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def test_a_prefix_on_the_cpu_tier_still_counts_and_the_rewrite_agrees():
    engine = LLMEngine(EngineConfig(simulate=True, simulate_tokenizer="bytes",
                                    vocab_size=1000, block_size=BLOCK,
                                    num_gpu_blocks=8, num_cpu_blocks=64,
                                    cpu_prefix_cache=True))
    name = f"tiers-{uuid.uuid4().hex[:8]}"
    index = prefix_index.PrefixIndex(name, Commands(engine))
    config = engine.describe_config()

    def held(prompt: list[int]) -> tuple[int, int]:  # as the router reads it
        hashes = inspector.short_hashes(config, prompt)
        pipe = live.redis_client().pipeline(transaction=False)
        prefix_index.look_up(pipe, name, hashes)
        return prefix_index.leading_blocks(hashes, *pipe.execute())

    first = list(range(1, 13))  # three full blocks
    try:
        finish(engine, "a", first)
        index.apply(prefix_changes(engine.take_events()))
        assert held(first) == (3, 3)  # on the GPU
        # Distinct prompts until the first one's blocks have left the GPU for the tier.
        for i in range(6):
            finish(engine, f"b{i}", [100 + 20 * i + t for t in range(12)])
            index.apply(prefix_changes(engine.take_events()))
        total, on_gpu = held(first)
        assert total == 3 and on_gpu == 0  # still routable, from the CPU tier
        assert held([999] * 12) == (0, 0)

        # The full rewrite (what repairs drift) gives the same sets as the events did.
        redis = live.redis_client()
        from_events = {key: redis.smembers(key) for key, *_ in index.tiers}
        index.maybe_rewrite()
        assert {key: redis.smembers(key) for key, *_ in index.tiers} == from_events
        assert from_events[prefix_index.CPU_INDEX_KEY.format(engine=name)]

        # A reset empties both tiers' sets.
        engine.reset_prefix_cache()
        index.apply(prefix_changes(engine.take_events()))
        assert held(first) == (0, 0)
        assert not any(redis.exists(key) for key, *_ in index.tiers)
    finally:
        live.redis_client().delete(*(key for key, *_ in index.tiers))
