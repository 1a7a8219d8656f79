"""tests/support/kv_invariants.py, the check the fault tests run on a stack's engines, on
snapshots of simulated engines in this process: it passes an engine that runs requests,
names the blocks a destination holds for a move under way (held by no table) and a
reference count that does not match its holders, and passes again once the copy is
given back."""
from engine.observe.snapshot import decode_array, encode_array
from tests.engine.sim import greedy, sim_engine
from tests.support.kv_invariants import problems, settled


def engines():
    config = dict(block_size=4, num_gpu_blocks=64, num_cpu_blocks=0)
    return sim_engine(**config), sim_engine(**config)


def test_a_running_engine_keeps_them_and_an_idle_one_is_settled():
    src, _ = engines()
    assert settled(src.snapshot(compact=True))
    src.add_request("r", list(range(10, 33)), greedy(40))
    for _ in range(8):
        src.step()
    snapshot = src.snapshot(compact=True)
    assert problems(snapshot) == [] and not settled(snapshot)  # (r runs)


def test_blocks_held_for_a_copy_are_held_by_no_table_until_given_back():
    src, dst = engines()
    src.add_request("r", list(range(10, 33)), greedy(40))
    for _ in range(8):
        src.step()
    held = dst.migrator.reserve(src.migrator.offer("r"))["reserved_blocks"]
    [problem] = problems(dst.snapshot(compact=True))
    assert f"the pool holds {held} blocks, the requests' tables and the pins 0" in problem
    dst.migrator.cancel("r")
    assert settled(dst.snapshot(compact=True))


def test_a_reference_count_that_does_not_match_its_holders_is_named():
    src, _ = engines()
    src.add_request("r", list(range(10, 33)), greedy(40))
    src.step()
    snapshot = src.snapshot(compact=True)
    ref_cnt = decode_array(snapshot["gpu"]["ref_cnt"]).copy()
    block = snapshot["requests"][0]["block_table"][0]
    ref_cnt[block] += 1
    snapshot["gpu"]["ref_cnt"] = encode_array(ref_cnt, compact=True)
    assert any(f"block {block} has ref_cnt 2, 1 holders" in p for p in problems(snapshot))
