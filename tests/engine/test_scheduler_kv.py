"""The Scheduler and the KV core (KVCacheCoordinator) at their own interfaces, without an engine or a
model: what schedule() hands the model runner, what update_from_output() does with the
sampled tokens, and what the KV manager gives, shares, copies and takes back."""
from __future__ import annotations

import itertools

import pytest

from engine.block_hash import root_hash
from engine.config import EngineConfig
from engine.errors import InvalidRequestError, InvalidStateError, UnknownRequestError
from engine.kv.events import EventLog
from engine.kv.coordinator import KVCacheCoordinator
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler

BS = 4
_index = itertools.count(1)


def request(rid: str, prompt: list[int], priority: int = 0, **params) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(**{"max_tokens": 8, **params}),
                   arrival_time=0.0, index=next(_index), root_hash=root_hash("test"),
                   block_size=BS, priority=priority, eos_token_ids=(2,))


def kv_manager(num_gpu_blocks: int = 16, num_cpu_blocks: int = 8,
               caching: bool = True) -> KVCacheCoordinator:
    return KVCacheCoordinator(BS, num_gpu_blocks, num_cpu_blocks, caching, EventLog(1000))


def scheduler(num_gpu_blocks: int = 16, **config) -> Scheduler:
    cfg = EngineConfig(simulate=True, simulate_tokenizer="bytes",
                       block_size=BS, num_gpu_blocks=num_gpu_blocks,
                       num_cpu_blocks=8, **config)
    kv = KVCacheCoordinator(BS, num_gpu_blocks, 8, cfg.enable_prefix_caching, EventLog(1000))
    return Scheduler(cfg, kv, max_model_len=4096, events=EventLog(1000))


def run_step(s: Scheduler, token: int = 7) -> tuple:
    """One schedule + update, every sampling request drawing `token`."""
    out = s.schedule()
    sampled = {x.request.request_id: token for x in out.scheduled if x.samples}
    return out, s.update_from_output(out, sampled)


# --- the KV core ------------------------------------------------------------------------
def test_allocation_grows_by_whole_blocks_and_refuses_without_changing_anything():
    kv = kv_manager(num_gpu_blocks=4)
    r = request("r", list(range(10, 19)))  # 9 tokens: 3 blocks
    assert len(kv.allocate_slots(r, 9).new_blocks) == 3
    r.num_computed_tokens = 9
    assert kv.allocate_slots(r, 3).new_blocks == []  # the 10th-12th fit the third block
    assert len(kv.allocate_slots(r, 4).new_blocks) == 1  # the 13th needs a fourth
    big = request("big", list(range(40, 50)))
    free = kv.gpu.num_free
    assert kv.allocate_slots(big, 10) is None  # 3 blocks wanted, none left
    assert kv.gpu.num_free == free and kv.block_ids("big") == []
    kv.check_invariants()


def test_prefix_hits_share_full_blocks_and_leave_the_last_token_to_compute():
    kv = kv_manager()
    first = request("a", list(range(10, 20)))  # 10 tokens: 2 full blocks + 2
    assert kv.find_prefix(first).num_computed_tokens == 0
    kv.allocate_slots(first, 10)
    kv.uncomputed.clear()  # the step that fills its blocks has run
    second = request("b", list(range(10, 20)) + [99])
    match = kv.find_prefix(second)
    assert match.num_computed_tokens == 8 and not match.cow
    second.num_computed_tokens = 8
    kv.allocate_slots(second, 3, match)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert all(kv.gpu.blocks[i].ref_cnt == 2 for i in kv.block_ids("a")[:2])
    exact = request("c", list(range(10, 18)))  # exactly the two cached blocks
    match = kv.find_prefix(exact)
    assert match.num_computed_tokens == 7 and match.cow  # its last token is rewritten
    exact.num_computed_tokens = 7
    alloc = kv.allocate_slots(exact, 1, match)
    assert alloc.copies == [(kv.block_ids("a")[1], kv.block_ids("c")[1])]
    kv.check_invariants()


def test_freed_blocks_stay_findable_until_reused_or_evicted():
    kv = kv_manager(num_gpu_blocks=4)
    a = request("a", list(range(10, 18)))
    kv.allocate_slots(a, 8)
    kv.free(a)
    assert kv.gpu.num_free == 4
    assert kv.find_prefix(request("again", list(range(10, 18)) + [1])).num_computed_tokens == 8
    assert kv.evict(None) == 2
    assert kv.find_prefix(request("gone", list(range(10, 18)) + [1])).num_computed_tokens == 0
    kv.check_invariants()


def test_swap_out_and_back_in_reuses_what_is_still_cached():
    kv = kv_manager()
    r = request("r", list(range(10, 20)))
    kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    out = kv.swap_out(r)
    assert len(out.mapping) == 3 and kv.block_ids("r") == [] and len(kv.cpu_block_ids("r")) == 3
    back = kv.swap_in(r)
    assert back.num_hit_blocks == 2  # the two full blocks were still in the prefix cache
    assert len(back.mapping) == 1 and len(kv.block_ids("r")) == 3
    kv.check_invariants()


def test_fork_shares_a_partial_block_until_the_first_write():
    kv = kv_manager()
    parent = request("p", list(range(10, 16)))  # 6 tokens: 1 full block + 2
    kv.allocate_slots(parent, 5)
    parent.num_computed_tokens = 5
    samples = [request(f"p/{i}", parent.prompt_token_ids) for i in range(2)]
    for s in samples:
        kv.fork(parent, s)
        s.num_computed_tokens = 5
    kv.free(parent)
    shared = kv.block_ids("p/0")[-1]
    assert kv.gpu.blocks[shared].ref_cnt == 2
    first = kv.allocate_slots(samples[0], 1)
    assert first.copies == [(shared, kv.block_ids("p/0")[-1])] and kv.block_ids("p/0")[-1] != shared
    second = kv.allocate_slots(samples[1], 1)  # the last holder writes in place
    assert second.copies == [] and kv.block_ids("p/1")[-1] == shared
    kv.check_invariants()


# --- Scheduler ------------------------------------------------------------------------
def test_a_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    s = scheduler(max_num_batched_tokens=6)
    s.add(request("r", list(range(10, 24))))  # 14 tokens
    chunks = []
    while True:
        out, progressed = run_step(s)
        (x,) = out.scheduled
        chunks.append((x.start, x.num_new_tokens, x.samples))
        if progressed:
            break
    assert chunks == [(0, 6, False), (6, 6, False), (12, 2, True)]


def test_max_num_seqs_and_the_priority_policy_decide_who_runs():
    s = scheduler(max_num_seqs=2, scheduling_policy="priority")
    for rid, priority in [("low", 5), ("high", -1), ("mid", 0)]:
        s.add(request(rid, [1, 3, 4], priority=priority))
    out, _ = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["high", "mid"]
    assert s.requests["low"].status == RequestStatus.WAITING


def test_out_of_blocks_the_last_running_request_is_preempted():
    s = scheduler(num_gpu_blocks=4)
    s.add(request("first", list(range(10, 17)), max_tokens=20))  # 7 tokens: 2 blocks
    s.add(request("second", list(range(30, 37)), max_tokens=20))
    run_step(s)
    for _ in range(3):  # both grow into a third block: only one can
        out, _ = run_step(s)
        if out.preempted:
            break
    assert out.preempted == ["second"]
    assert s.requests["second"].status == RequestStatus.WAITING
    assert s.counters.num_preemptions == 1
    s.kv.check_invariants()


def test_update_stops_on_eos_stop_ids_and_length_honouring_min_tokens():
    s = scheduler()
    s.add(request("eos", [5, 6, 7], max_tokens=8))
    s.add(request("stop-id", [5, 6, 8], max_tokens=8, stop_token_ids=[9]))
    s.add(request("held", [5, 6, 9], max_tokens=8, min_tokens=2))
    s.add(request("long", [5, 6, 10], max_tokens=1))
    out = s.schedule()
    sampled = {"eos": 2, "stop-id": 9, "held": 2, "long": 4}
    s.update_from_output(out, sampled)
    ended = {r.request_id: r.finish_reason for r in s.recently_finished}
    assert ended == {"eos": "stop", "stop-id": "stop", "long": "length"}
    assert s.requests["held"].output_token_ids == [2]  # EOS before min_tokens: goes on
    assert s.kv.gpu.num_free + sum(len(t) for t in s.kv.req_to_blocks.values()) \
        == s.kv.gpu.num_blocks


def test_a_block_filled_in_this_step_is_not_copied_before_it_is_written():
    """Blocks cached during this schedule are written by the coming forward pass: a hit
    may read them (same step, later in the batch) but a whole-prompt hit, which would
    copy the last one before the pass, recomputes that block instead."""
    kv = kv_manager()
    kv.allocate_slots(request("a", list(range(10, 20))), 10)
    exact = request("c", list(range(10, 18)))
    match = kv.find_prefix(exact)
    assert match.num_computed_tokens == 4 and not match.cow
    kv.uncomputed.clear()
    assert kv.find_prefix(exact).cow


# --- the scheduler's API for the Migrator and the operator ------------------------------
def adopted(s: Scheduler, rid: str, prompt: list[int]) -> Request:
    """A request copied here as the Migrator brings one: its blocks taken, then adopted
    (a sample "<parent>/<i>" knows its parent)."""
    r = request(rid, prompt)
    if "/" in rid:
        r.parent_id, r.sample_index = rid.split("/")[0], int(rid.split("/")[1])
    assert s.kv.allocate_slots(r, len(prompt)) is not None
    r.num_computed_tokens = len(prompt)
    s.kv.mark_computed()
    s.adopt(r)
    return r


def test_adopted_samples_become_one_fork_that_ends_together():
    s = scheduler()
    adopted(s, "p/0", list(range(10, 19)))
    adopted(s, "p/1", list(range(10, 19)))
    s.adopt_fork("p", ["p/0", "p/1"])
    assert [r.request_id for r in s.live_requests("p")] == ["p/0", "p/1"]
    ended = s.abort("p")
    assert [r.request_id for r in ended] == ["p/0", "p/1"]
    assert not s.requests and "p" not in s.forks
    assert s.kv.gpu.num_free == s.kv.gpu.num_blocks
    s.kv.check_invariants()


def test_a_fork_is_adopted_only_under_a_free_id_and_over_live_samples():
    s = scheduler()
    adopted(s, "p/0", list(range(10, 19)))
    with pytest.raises(InvalidStateError, match="'p/1'"):
        s.adopt_fork("p", ["p/0", "p/1"])  # p/1 never came
    with pytest.raises(InvalidStateError):
        s.adopt_fork("p", [])
    with pytest.raises(InvalidStateError, match="already exists"):
        s.adopt_fork("p/0", ["p/0"])  # the id of a live request
    assert s.forks == {}
    s.adopt_fork("p", ["p/0"])
    with pytest.raises(InvalidStateError, match="already exists"):
        s.adopt_fork("p", ["p/0"])  # a fork of that id is here already
    assert s.forks == {"p": ["p/0"]}


def test_a_disowned_request_gives_its_blocks_back_and_leaves_no_trace():
    s = scheduler()
    adopted(s, "stays", list(range(40, 49)))
    r = adopted(s, "back", list(range(10, 19)))
    held = s.kv.num_blocks_held("back")
    free = s.kv.gpu.num_free
    s.events.take()
    assert s.disown("back") is r
    assert "back" not in s.requests and r not in s.running
    assert [x.request_id for x in s.running] == ["stays"]
    assert s.kv.gpu.num_free == free + held and s.kv.block_ids("back") == []
    assert r not in s.recently_finished
    assert not [e for e in s.events.take() if e.type == "Finished"]
    s.kv.check_invariants()


def test_only_a_running_request_is_disowned():
    s = scheduler()
    s.add(request("queued", [5, 6, 7]))
    with pytest.raises(InvalidStateError, match="waiting"):
        s.disown("queued")
    with pytest.raises(UnknownRequestError):
        s.disown("nobody")
    assert "queued" in s.requests and s.waiting.peek().request_id == "queued"


def test_the_batch_limits_move_within_their_values_at_start():
    s = scheduler(max_num_seqs=8, max_num_batched_tokens=64)
    assert s.set_limits(max_num_seqs=2) == {
        "max_num_seqs": 2, "max_num_batched_tokens": 64,
        "caps": {"max_num_seqs": 8, "max_num_batched_tokens": 64}}
    for i in range(4):
        s.add(request(f"r{i}", [5, 6, 7 + i]))
    assert len(s.schedule().scheduled) == 2  # the lowered limit admits two
    for bad in ({"max_num_seqs": 9}, {"max_num_seqs": 0}, {"max_num_seqs": True},
                {"max_num_batched_tokens": 15}, {"max_num_batched_tokens": 65},
                {"max_num_seqs": 4, "max_num_batched_tokens": 2.5}):
        with pytest.raises(InvalidRequestError):
            s.set_limits(**bad)
    # a refused change changes nothing, not even its valid half
    assert (s.config.max_num_seqs, s.config.max_num_batched_tokens) == (2, 64)
    assert s.set_limits(max_num_seqs=8)["max_num_seqs"] == 8
