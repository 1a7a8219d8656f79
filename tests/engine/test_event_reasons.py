"""Every removal and preemption in the event stream says why and, where one is known, for
whom: a cached block reused for another request's new blocks (`evicted`, by that
request), an operator's evict, a failed step, a window passed, a reset; a request
preempted because the pool was full, for one of higher priority, or by an operator."""
from engine import SamplingParams
from tests.engine.sim import greedy, sim_engine


def events(engine, kind: str) -> list:
    return [e for e in engine.take_events() if e.type == kind]


def test_a_cached_block_reused_names_the_request_it_went_to():
    engine = sim_engine(num_gpu_blocks=8, block_size=4)
    engine.generate([list(range(100, 116))], greedy(1))  # 4 cached blocks, free
    engine.take_events()
    engine.add_request("newcomer", list(range(200, 228)), greedy(1))  # 7 blocks: reuses
    engine.step()
    evicted = events(engine, "BlockEvicted")
    assert evicted and all(e.reason == "evicted" and e.by == "newcomer" for e in evicted)
    assert all(e.detail == "reuse" for e in evicted)


def test_an_operators_evict_and_reset_say_so():
    engine = sim_engine()
    engine.generate([list(range(40))], greedy(1))
    engine.take_events()
    assert engine.evict_cached_blocks(2) == 2
    (evict,) = events(engine, "BlockEvicted")
    assert evict.reason == "operator_evict" and evict.by == "operator" and len(evict.block_ids) == 2
    engine.reset_prefix_cache()
    (reset,) = events(engine, "AllBlocksCleared")
    assert reset.reason == "reset"


def test_a_failed_steps_blocks_leave_the_cache_as_step_failed():
    engine = sim_engine()
    engine.add_request("r", list(range(40)), greedy(4))
    engine.take_events()
    engine.scheduler.schedule()  # registers the blocks the step was to write
    engine.kv.forget_uncomputed()
    (failed,) = events(engine, "BlockEvicted")
    assert failed.reason == "step_failed" and failed.block_ids


def test_preemptions_say_why_and_for_whom():
    # kv_full: the pool ran out while the first request grew; the last one gives way
    engine = sim_engine(num_gpu_blocks=6, block_size=4, num_cpu_blocks=0)
    engine.add_request("a", list(range(10, 18)), greedy(12))
    engine.add_request("b", list(range(30, 38)), greedy(12))
    preempted = []
    while engine.has_unfinished_requests():
        engine.step()
        preempted += events(engine, "Preempted")
    assert preempted and preempted[0].request_id == "b" and preempted[0].reason == "kv_full"
    assert preempted[0].by == "a"
    # priority: the one that outranks takes the room
    engine = sim_engine(num_gpu_blocks=6, block_size=4, num_cpu_blocks=0,
                        scheduling_policy="priority")
    engine.add_request("low", list(range(10, 18)), greedy(12), priority=5)
    engine.step()
    # (11 tokens: its block fills before low's next one does)
    engine.add_request("high", list(range(30, 41)), greedy(12), priority=0)
    preempted = []
    while engine.has_unfinished_requests():
        engine.step()
        preempted += events(engine, "Preempted")
    for_another = [p for p in preempted if p.by is not None]  # (not giving way itself)
    assert for_another and all(p.request_id == "low" and p.by == "high"
                               and p.reason == "priority" for p in for_another)
    assert all(p.reason == "kv_full" for p in preempted if p.by is None)
    # an operator's preemption and swap
    engine = sim_engine(num_cpu_blocks=16)
    engine.add_request("r", list(range(12)), SamplingParams(max_tokens=20))
    engine.step()
    engine.preempt("r")
    (op,) = events(engine, "Preempted")
    assert op.reason == "operator" and op.by == "operator"
    engine.step()
    engine.swap_out("r")
    (swap,) = events(engine, "SwappedOut")
    assert swap.reason == "operator"


def test_a_window_passed_says_window():
    engine = sim_engine(simulate_sliding_window=8, block_size=4)
    engine.generate([list(range(30))], greedy(10))
    freed = [e for e in engine.take_events() if e.type == "WindowFreed"]
    assert freed and all(e.reason == "window" for e in freed)


def test_a_requests_released_blocks_say_why():
    engine = sim_engine(num_cpu_blocks=16)
    engine.generate([list(range(12))], greedy(3))
    (done,) = [e for e in engine.take_events() if e.type == "BlockRemoved"]
    assert done.reason == "length"
    engine.add_request("r", list(range(40, 52)), SamplingParams(max_tokens=20))
    engine.step()
    engine.preempt("r")
    (pre,) = [e for e in engine.take_events() if e.type == "BlockRemoved"]
    assert pre.reason == "operator"
    engine.add_request("s", list(range(60, 72)), SamplingParams(max_tokens=20))
    engine.step()
    engine.take_events()
    engine.abort("s")
    (aborted,) = [e for e in engine.take_events() if e.type == "BlockRemoved"]
    assert aborted.reason == "abort"
