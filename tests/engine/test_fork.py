"""Parallel sampling (n > 1) by fork and copy-on-write: the prompt is computed once, the
samples share its blocks (ref count n), the partly filled last block is copied on each
sample's first write (never shared while written), and nothing leaks however the
samples end."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.errors import InvalidRequestError

from .sim import expected, run_all, sim_engine


def fork_events(engine):
    return [e for e in engine.take_events() if e.type in ("Forked", "CopiedOnWrite")]


@pytest.mark.parametrize("prompt_len, copies", [(10, 2), (9, 0), (2, 2)])
def test_samples_share_the_prompt_and_copy_the_partial_block(prompt_len, copies):
    """Block size 4. 10 tokens: the parent computes 9 (blocks of 4, 4, 1), so the third
    block is shared while partly filled: 2 of 3 samples copy it, the last writes in
    place. 9 tokens: the parent computes 8 (two full blocks), nothing to copy."""
    engine = sim_engine(num_gpu_blocks=32)
    prompt = list(range(100, 100 + prompt_len))
    engine.add_request("p", prompt, SamplingParams(max_tokens=5, n=3))
    engine.step()  # the parent's prefill: all but the last prompt token
    engine.kv.check_invariants()
    events = fork_events(engine)
    assert [e.type for e in events] == ["Forked"]
    (forked,) = events
    assert forked.request_id == "p" and forked.detail == "3 samples"
    assert forked.ref_cnts == [3] * len(forked.block_ids)  # each block held by 3 samples
    assert sorted(engine.scheduler.requests) == ["p/0", "p/1", "p/2"]
    prompt_tokens = engine.scheduler.counters.num_prompt_tokens
    assert prompt_tokens == prompt_len - 1
    final = run_all(engine)
    cows = [e for e in fork_events(engine) if e.type == "CopiedOnWrite"]
    assert len(cows) == copies
    assert all(e.block_ids[0] == forked.block_ids[-1] for e in cows)
    # The prompt was computed once; each sample computed only the held-back last token.
    assert engine.scheduler.counters.num_prompt_tokens == prompt_len - 1 + 3
    for i in range(3):
        assert final[f"p/{i}"].output_token_ids == expected(prompt, 5)
    engine.reset_prefix_cache()
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks


def test_generate_groups_samples_under_their_prompt():
    engine = sim_engine()
    single, forked = engine.generate([[5, 6, 7], list(range(20, 31))],
                                     [SamplingParams(max_tokens=4),
                                      SamplingParams(max_tokens=6, n=4)])
    assert single.samples is None and single.output_token_ids == expected([5, 6, 7], 4)
    assert forked.request_id.endswith("-1") and len(forked.samples) == 4
    assert [s.request_id for s in forked.samples] == [f"{forked.request_id}/{i}" for i in range(4)]
    assert all(s.output_token_ids == expected(list(range(20, 31)), 6) for s in forked.samples)
    assert forked.output_token_ids == forked.samples[0].output_token_ids


def test_samples_end_on_their_own_and_the_parent_id_aborts_them_all():
    engine = sim_engine(num_gpu_blocks=32)
    engine.add_request("p", list(range(50, 61)), SamplingParams(max_tokens=40, n=3))
    engine.add_request("q", list(range(70, 77)), SamplingParams(max_tokens=40, n=2))
    for _ in range(3):
        engine.step()
    engine.abort("p/1")  # one sample goes; its siblings go on
    engine.preempt("p/2")  # another loses its blocks and recomputes
    engine.swap_out("q/0")
    engine.kv.check_invariants()
    for _ in range(3):
        engine.step()
        engine.kv.check_invariants()
    engine.swap_in("q/0")
    engine.abort("q")  # the parent's id ends every live sample
    assert not any(r.startswith("q/") for r in engine.scheduler.requests)
    final = run_all(engine)
    assert final["p/0"].output_token_ids == expected(list(range(50, 61)), 40)
    assert final["p/2"].output_token_ids == expected(list(range(50, 61)), 40)
    assert final["p/2"].num_preemptions == 1
    engine.reset_prefix_cache()
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks
    assert engine.kv.cpu.num_free == engine.kv.cpu.num_blocks


def test_a_fully_cached_prompt_forks_at_admission():
    engine = sim_engine()
    prompt = list(range(200, 213))  # 13 tokens: 12 = three full blocks
    engine.generate([prompt], SamplingParams(max_tokens=2))  # caches its blocks
    engine.take_events()
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=3, n=2))
    assert [s.output_token_ids for s in out.samples] == [expected(prompt, 3)] * 2
    assert out.num_cached_tokens == 12


def test_n_out_of_range_is_refused():
    for n in (0, 17, 2.5):
        with pytest.raises(InvalidRequestError, match="n must be"):
            SamplingParams(n=n)


def test_samples_count_against_max_num_seqs():
    """A fork is admitted only when all its samples fit in the running batch, and n above
    max_num_seqs is refused (it could never run)."""
    engine = sim_engine(max_num_seqs=4)
    with pytest.raises(InvalidRequestError, match="at most 4 sequences"):
        engine.add_request("big", [1, 2, 3], SamplingParams(n=5))
    engine.add_request("a", list(range(10, 20)), SamplingParams(max_tokens=20, n=3))
    engine.add_request("b", list(range(30, 40)), SamplingParams(max_tokens=20, n=2))
    for _ in range(6):
        engine.step()
        assert len(engine.scheduler.running) <= 4
    final = run_all(engine)
    assert sorted(final) == ["a/0", "a/1", "a/2", "b/0", "b/1"]
