"""The batch share (EngineConfig.max_batch_share): a tenant holding its share of
max_num_seqs is passed over while others wait, its requests are preempted first (fcfs),
staff (no tenant) are exempt, and with nobody else waiting a tenant uses the whole batch.
Outputs stay the reference's whatever the order."""
from engine import SamplingParams
from tests.engine.sim import expected, greedy, run_all, sim_engine


def running(engine) -> list[str]:
    return [r.request_id for r in engine.scheduler.running]


def test_others_are_admitted_past_a_tenant_holding_its_share():
    engine = sim_engine(max_num_seqs=8, max_batch_share=0.5, num_gpu_blocks=256)
    prompts = {}
    for i in range(12):
        prompts[f"a{i}"] = [10 + i, 11, 12, 13, 14]
        engine.add_request(f"a{i}", prompts[f"a{i}"], greedy(20), tenant="A")
    for rid, tenant in (("b0", "B"), ("b1", "B"), ("staff", None)):
        prompts[rid] = [50 + len(prompts), 2, 3]
        engine.add_request(rid, prompts[rid], greedy(20), tenant=tenant)
    engine.step()
    # a0-a3 (A's share: 4 of 8), then B's and staff's past A's queue, then one more of
    # A's: nobody else waits for the last place
    assert running(engine) == ["a0", "a1", "a2", "a3", "b0", "b1", "staff", "a4"]
    final = run_all(engine)
    assert all(final[rid].output_token_ids == expected(p, 20) for rid, p in prompts.items())


def test_without_a_share_the_queue_is_first_come_first_served():
    engine = sim_engine(max_num_seqs=8, num_gpu_blocks=256)  # max_batch_share 1.0
    for i in range(12):
        engine.add_request(f"a{i}", [10 + i, 11, 12], greedy(5), tenant="A")
    engine.add_request("b0", [7, 8, 9], greedy(5), tenant="B")
    engine.step()
    assert running(engine) == [f"a{i}" for i in range(8)]


def test_a_fork_counts_its_samples():
    engine = sim_engine(max_num_seqs=8, max_batch_share=0.5, num_gpu_blocks=256)
    engine.add_request("a-fork", [1, 2, 3, 4, 5], SamplingParams(max_tokens=5, n=3),
                       tenant="A")
    engine.add_request("a-next", [9, 8, 7], greedy(5), tenant="A")  # 3 + 1 = 4: its share
    engine.add_request("a-over", [6, 6, 6], greedy(5), tenant="A")
    engine.add_request("b0", [5, 5, 5], greedy(5), tenant="B")
    engine.step()
    assert running(engine)[:3] == ["a-fork/0", "a-fork/1", "a-fork/2"]
    assert running(engine)[3:] == ["a-next", "b0", "a-over"]
    run_all(engine)


def test_under_fcfs_a_tenant_over_its_share_is_preempted_first():
    """A holds 3 of 4 places (it was alone when they were given), B the last. When
    blocks run out, A's last request gives way, not B's (the default victim: the last)."""
    def scenario(share: float) -> tuple[list[str], dict]:
        engine = sim_engine(max_num_seqs=4, max_batch_share=share, block_size=16,
                            num_gpu_blocks=5, num_cpu_blocks=0, enable_prefix_caching=False)
        for i in range(3):
            engine.add_request(f"a{i}", [100 + i] * 8, greedy(30), tenant="A")
        engine.step()
        engine.add_request("b0", [200] * 8, greedy(30), tenant="B")
        preempted = []
        while engine.has_unfinished_requests():
            for event in engine.take_events():
                if event.type == "Preempted":
                    preempted.append(event.request_id)
            engine.step()
            engine.kv.check_invariants()
        return preempted, engine

    with_share, _ = scenario(0.5)
    plain, _ = scenario(1.0)
    assert with_share and with_share[0].startswith("a"), with_share
    assert plain and plain[0] == "b0", plain


def test_a_fork_wider_than_the_share_starts_when_its_tenant_holds_nothing():
    engine = sim_engine(max_num_seqs=16, max_batch_share=0.5, num_gpu_blocks=256)  # cap 8
    engine.add_request("b-long", [4, 4, 4], greedy(50), tenant="B")
    engine.step()
    engine.add_request("a-wide", [1, 2, 3], SamplingParams(max_tokens=5, n=9), tenant="A")
    engine.add_request("b-more", [5, 5, 5], greedy(5), tenant="B")  # others keep waiting
    engine.step()
    assert {f"a-wide/{i}" for i in range(9)} <= set(running(engine))
    run_all(engine)


def test_the_share_follows_the_batch_limit_set_live():
    engine = sim_engine(max_num_seqs=16, max_batch_share=0.5, num_gpu_blocks=256)
    assert engine.scheduler.share_cap == 8
    engine.set_limits(max_num_seqs=4)
    assert engine.scheduler.share_cap == 2
    for i in range(4):
        engine.add_request(f"a{i}", [10 + i, 1, 2], greedy(20), tenant="A")
    engine.add_request("b0", [9, 9, 9], greedy(20), tenant="B")
    engine.step()
    assert running(engine) == ["a0", "a1", "b0", "a2"]
