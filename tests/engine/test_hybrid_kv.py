"""Block tables per layer group (engine/kv/layout.py, engine/kv/coordinator.py): a model that mixes sliding and
global layers (Gemma 2, 3) keeps the sliding layers' K/V in tables of their own, which
give back what the window passed while the global table keeps every block. Tokens stay
transformers' in every situation (tests/engine/test_model_parity.py runs the families);
here: the layout, the bound, window-aware prefix hits, and the views that count blocks."""
from __future__ import annotations

import numpy as np
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.block_hash import hash_blocks, root_hash
from engine.kv.group import SlidingWindowGroup
from engine.kv.layout import group_hash, kv_layout
from engine.observe.vllm_events import BlockRemoved, BlockStored
from engine.observe.view import Capturer, KVMirror
from engine.observe.snapshot import decode_array
from tests.dashboard.churn import Churn
from tests.models.tiny import SPECS, hf_greedy, random_prompts

BS = 4


def engine_for(folder, kv_events=None, **kw) -> LLMEngine:
    cfg = dict(model=str(folder), device="cpu", dtype="float32", attention_backend="torch",
               block_size=BS, num_gpu_blocks=128, num_cpu_blocks=64, seed=0)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), kv_events=kv_events)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_layouts():
    # Gemma 2: sliding and global layers in turn -> a global group and a sliding one
    two = kv_layout((6, 0, 6, 0), 4)
    assert two.windows == (None, 6) and two.slots == 2
    assert two.layer_group == (1, 0, 1, 0) and two.layer_slot == (0, 0, 1, 1)
    # Gemma 3: five sliding layers to a global one; groups of 2 layers, the last sliding
    # group with one layer (its blocks' second slot unused)
    windows = ((9,) * 5 + (0,)) * 2 + (9,)
    three = kv_layout(windows, 13)
    assert three.slots == 2 and three.windows == (None,) + (9,) * 6
    assert [three.layer_group.count(g) for g in range(7)] == [2, 2, 2, 2, 2, 2, 1]
    assert {(g, s) for g, s in zip(three.layer_group, three.layer_slot)} == \
        {(g, s) for g in range(7) for s in range(2)} - {(6, 1)}
    # one table: all global, all sliding (the widest window), two windows, or asked
    assert kv_layout((), 3).windows == (None,)
    assert kv_layout((8, 8, 4), 3).windows == (8,)
    assert kv_layout((8, 0, 4), 3).windows == (None,)
    assert kv_layout((6, 0), 2, hybrid=False).windows == (None,)
    assert kv_layout((6, 0), 2, hybrid=False).layer_slot == (0, 1)


def test_a_long_generation_holds_a_bounded_sliding_table(tiny_model):
    folder = tiny_model("gemma2")  # layer 0 slides (window 6), layer 1 is global
    prompt = random_prompts(SPECS["gemma2"].vocab_size, [18], seed=3)[0]
    engine = engine_for(folder, max_num_batched_tokens=8)
    assert engine.kv.num_groups == 2 and isinstance(engine.kv.groups[1], SlidingWindowGroup)
    assert engine.describe_config()["kv_group_windows"] == [None, 6]
    engine.add_request("long", prompt, greedy(70))
    sliding, most, out = engine.kv.groups[1], 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.finished else out
        engine.kv.check_invariants()
        most = max(most, len(sliding.req_to_blocks.get("long", ())))
    assert out.output_token_ids == hf_greedy(folder, [prompt], 70)[0]
    # the window (6) and a chunk (8) reach at most 5 blocks of 4; the global table 22
    assert most <= -(-(6 + 8) // BS) + 1
    freed = [e for e in engine.take_events() if e.type == "WindowFreed"]
    assert freed and {e.group for e in freed} == {1}
    assert sum(len(e.block_ids) for e in freed) >= 88 // BS - most
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks


def test_one_table_for_every_layer_when_asked(tiny_model):
    folder = tiny_model("gemma2")
    prompt = random_prompts(SPECS["gemma2"].vocab_size, [18], seed=3)[0]
    hybrid = engine_for(folder).generate([prompt], greedy(30))[0]
    one = engine_for(folder, hybrid_kv_cache=False)
    assert one.describe_config()["kv_group_windows"] is None
    assert one.generate([prompt], greedy(30))[0].output_token_ids == hybrid.output_token_ids
    # and with the CPU tier on: one table (the tier keeps no layer groups)
    tier = engine_for(folder, cpu_prefix_cache=True)
    assert tier.describe_config()["kv_group_windows"] is None


def test_a_prefix_hit_needs_only_the_blocks_the_window_reaches(tiny_model):
    folder = tiny_model("gemma2")
    vocab = SPECS["gemma2"].vocab_size
    prefix = random_prompts(vocab, [40], seed=4)[0]  # 10 full blocks
    first, second = random_prompts(vocab, [3, 5], seed=5, prefix=prefix)
    engine = engine_for(folder)
    engine.generate([first], greedy(2))
    hashes = hash_blocks(root_hash(engine.runner.model_id), prefix, BS)
    # Push the sliding group's copies of the prefix's first 7 blocks out of the cache.
    # The second prompt's first token to compute (position 40) sees back to position
    # 35, in block 8: the hit needs only blocks 8 and 9 of the sliding group.
    for h in hashes[:7]:
        block = engine.kv.gpu.get_cached(group_hash(h, 1))
        assert block is not None and block.ref_cnt == 0
        engine.kv.gpu.forget(block)
    engine.add_request("second", second, greedy(6))
    engine.step()
    engine.kv.check_invariants()
    assert engine.scheduler.requests["second"].num_cached_tokens == 40
    assert engine.kv.groups[1].window_freed("second") == (40 - 6 + 1) // BS  # not held
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o
    assert out["second"].output_token_ids == hf_greedy(folder, [second], 6)[0]
    # With the global group's first block gone instead, nothing is found
    engine = engine_for(folder)
    engine.generate([first], greedy(2))
    engine.kv.gpu.forget(engine.kv.gpu.get_cached(hashes[0]))
    assert engine.generate([second], greedy(1))[0].num_cached_tokens == 0


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_snapshots_and_the_live_view_count_every_groups_blocks(tiny_model, name):
    """Churn (prefix sharing, preemption, swap, pins, evictions, resets, aborts) on a
    model with layer groups: the invariants hold over every group's tables, and the
    dashboard's mirror and engine.snapshot() both count the sliding groups' blocks as
    their requests' (references and owners equal the pool's)."""
    folder = tiny_model(name)
    engine = engine_for(folder, num_gpu_blocks=72, num_cpu_blocks=48, max_num_seqs=8,
                        max_num_batched_tokens=32, name="t")
    churn = Churn(engine, seed=3, vocab=SPECS[name].vocab_size)
    capturer, mirror = Capturer(), KVMirror("t", "epoch", engine.describe_config())
    sliding_held = 0
    for i in range(160):
        churn()
        engine.kv.check_invariants()
        sliding_held = max(sliding_held, sum(len(t) for t in engine.kv.groups[1].req_to_blocks.values()))
        if i % 4:
            continue
        mirror.apply(capturer.capture(engine))
        ours, theirs = mirror.snapshot(), engine.snapshot(compact=True)
        for pool, blocks in (("gpu", engine.kv.gpu.blocks), ("cpu", engine.kv.cpu.blocks)):
            ref_cnt = np.array([b.ref_cnt for b in blocks])
            for doc in (ours, theirs):
                assert np.array_equal(decode_array(doc[pool]["ref_cnt"]), ref_cnt), (pool, i)
                owner = decode_array(doc[pool]["owner"])
                held = ref_cnt > np.array([int(b.pinned) for b in blocks])
                assert (owner[held] > 0).all(), (pool, i)
            assert np.array_equal(decode_array(ours[pool]["owner"]),
                                  decode_array(theirs[pool]["owner"]))
        for a, b in zip(ours["requests"], theirs["requests"]):
            assert {k: v for k, v in a.items() if v != b.get(k)} == {}, (i, b)
        assert ours["requests"] == theirs["requests"]  # (group 0's tables, as one table)
    assert sliding_held > 0
    assert {"add", "preempt", "swap_out", "swap_in", "evict"} <= churn.seen


def test_routers_hear_of_the_global_groups_hashes_only(tiny_model):
    """The vLLM-format events (engine/observe/vllm_events.py) name the request's prefix hashes
    (group 0's): the sliding groups' own hashes are neither stored nor removed there."""
    folder = tiny_model("gemma2")
    batches = []

    class Publisher:  # what the ZMQ publisher is handed, each step and command
        def publish(self, events):
            batches.append(events)

    engine = engine_for(folder, num_gpu_blocks=40, num_cpu_blocks=24, max_num_seqs=6,
                        max_num_batched_tokens=32, kv_events=Publisher())
    churn = Churn(engine, seed=5, vocab=SPECS["gemma2"].vocab_size)
    stored, removed, prefix_hashes = set(), 0, set()
    for _ in range(120):
        churn()
        sched = engine.scheduler
        prefix_hashes.update(h for r in [*sched.requests.values(), *sched.recently_finished]
                             for h in r.block_hashes)
        for event in (e for batch in batches for e in batch):
            if isinstance(event, BlockStored):
                assert set(event.block_hashes) <= prefix_hashes
                stored.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= stored, "a hash no BlockStored named"
                removed += len(event.block_hashes)
        batches.clear()
    sliding = [b for b in engine.kv.gpu.cached.values() if b.group == 1]
    assert stored and removed and sliding  # (the sliding group cached blocks meanwhile)


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_pinned_prefix_keeps_what_every_group_needs(tiny_model, salt):
    """Pinning a prefix pins the sliding group's blocks its window needs too: after an
    operator evicts everything else, a prompt that continues the prefix still hits it
    whole, salted (reading the pinned unsalted chain) or not."""
    folder = tiny_model("gemma2")
    vocab = SPECS["gemma2"].vocab_size
    prefix = random_prompts(vocab, [32], seed=6)[0]  # 8 full blocks
    (prompt,) = random_prompts(vocab, [6], seed=7, prefix=prefix)
    engine = engine_for(folder)
    engine.generate([prefix], greedy(1))
    engine.pin_prefix(prefix)
    pinned = [b for b in engine.kv.gpu.blocks if b.pinned]
    # the global group's 8, and the sliding group's blocks 6 and 7 (position 32 sees back
    # to 27, in block 6)
    assert len(pinned) == 8 + 2 and sum(b.group == 1 for b in pinned) == 2
    assert engine.evict_cached_blocks() > 0  # every cached block not pinned
    engine.kv.check_invariants()
    engine.add_request("p", prompt, greedy(4), cache_salt=salt)
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            final = o if o.finished else final
        engine.kv.check_invariants()
    assert final.num_cached_tokens == 32
    assert final.output_token_ids == hf_greedy(folder, [prompt], 4)[0]
    engine.unpin_prefix(prefix)
    assert not any(b.pinned for b in engine.kv.gpu.blocks)


def test_one_formula_for_a_blocks_bytes_follows_the_layer_groups(tiny_model):
    """kv_layout.block_bytes is what the runner's cache holds per block, for a model of
    one table and for one with layer groups (a block holds one group's layers, not every
    layer's), and what the tiers benchmark reads."""
    from benchmarks.tiers import default_block_bytes
    from engine.kv.layout import block_bytes, kv_layout
    for name in ("gemma2", "gqa16"):
        engine = LLMEngine(EngineConfig(model=tiny_model(name), device="cpu", dtype="float32",
                                        num_gpu_blocks=8, num_cpu_blocks=0, block_size=4))
        runner = engine.runner
        per_block = runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size()
        assert runner.block_bytes == per_block
        args = runner.model.args
        layout = kv_layout(args.layer_windows, args.n_layers)
        assert block_bytes(layout, 4, args.n_kv_heads, args.head_dim, 4) == per_block
        # (a block of layer groups holds fewer layers than the model has)
        assert (layout.slots < args.n_layers) == (name == "gemma2")
    sizes = default_block_bytes(16)
    if sizes:  # (the default model, where it has been converted)
        assert sizes["float32"] == 2 * sizes["bfloat16"] == 4 * sizes["fp8"]
