"""Async scheduling (engine/llm_engine.py, _step_ahead): the next step is scheduled and
issued before a step's sampled tokens are read back, which feed it on the device. On a
CPU the overlap is degenerate (each forward pass runs as it is issued) but the order of
work is the GPU's; every token must be the one a step at a time gives."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.errors import NotEnoughBlocksError
from tests.engine.test_model_parity import SITUATIONS, greedy, make_engine, same_memory
from tests.models.tiny import SPECS, hf_greedy, random_prompts


def run(engine, requests: list[tuple[str, list[int], SamplingParams]],
        between=None) -> dict[str, list[int]]:
    """Every request to its end, step by step (between(engine, step) runs between steps,
    as an operator's commands do); the final tokens of each, forks' samples by id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done: dict[str, list[int]] = {}
    in_flight = 0  # steps after which one was issued and not read back
    for step in range(5_000):
        if not engine.has_unfinished_requests():
            break
        if between is not None:
            between(engine, step)
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.output_token_ids
        in_flight += engine._flight is not None
        engine.kv.check_invariants()
    assert not engine.has_unfinished_requests()
    assert (in_flight > 0) == engine.async_scheduling
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks
    return done


def both(folder, requests, between=None, **config) -> tuple[dict, dict, object]:
    """The requests run with async scheduling on and off: (on, off, the engine on)."""
    ahead = make_engine(folder, async_scheduling=True, **config)
    assert ahead.async_scheduling
    got = run(ahead, requests, between)
    one_at_a_time = make_engine(folder, async_scheduling=False, **config)
    assert not one_at_a_time.async_scheduling
    return got, run(one_at_a_time, requests, between), ahead


@pytest.mark.parametrize("situation", sorted(SITUATIONS))
def test_greedy_tokens_are_transformers_in_every_kv_situation(tiny_model, situation):
    folder = tiny_model("gqa16")
    prompts = random_prompts(SPECS["gqa16"].vocab_size, [20, 23, 18, 25, 21], seed=5)
    requests = [(f"r{i}", p, greedy()) for i, p in enumerate(prompts)]
    got, expected, engine = both(folder, requests, **same_memory(folder, SITUATIONS[situation]))
    assert got == expected
    assert [got[f"r{i}"] for i in range(5)] == hf_greedy(folder, prompts, len(got["r0"]))
    m = engine.metrics()
    if situation == "recompute":
        assert m["num_preemptions"] > 0
    if situation == "swap":
        assert m["num_swaps_out"] > 0 and m["num_swaps_in"] > 0


def test_sampling_penalties_stops_forks_and_logprobs_match_a_step_at_a_time(tiny_model):
    """Seeded draws with penalties (which read the output so far), stop tokens that
    end requests on the token read back a step late, a fork into samples, logprobs and
    prompt logprobs: the same with async scheduling on and off."""
    folder = tiny_model("gqa16")
    vocab = SPECS["gqa16"].vocab_size
    prompts = random_prompts(vocab, [9, 14, 5, 11, 7], seed=3)
    probe = run(make_engine(folder, async_scheduling=False),
                [("p", prompts[3], SamplingParams(max_tokens=12, temperature=0.8, seed=2,
                                                  ignore_eos=True))])["p"]
    requests = [
        ("seeded", prompts[0], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9,
                                              seed=11, presence_penalty=0.5,
                                              frequency_penalty=0.3, ignore_eos=True)),
        ("fork", prompts[1], SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=5,
                                            ignore_eos=True)),
        ("greedy", prompts[2], SamplingParams(max_tokens=9, temperature=0.0,
                                              repetition_penalty=1.3, ignore_eos=True)),
        # stops on its 4th token (a stop token drawn a step before it is read back)
        ("stops", prompts[3], SamplingParams(max_tokens=12, temperature=0.8, seed=2,
                                             stop_token_ids=[probe[3]], ignore_eos=True)),
        ("logprobs", prompts[4], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3,
                                                prompt_logprobs=2, ignore_eos=True)),
        # ends when its text reaches its 5th token's word (found in the text between
        # steps, with a step in flight)
        ("stop-string", prompts[3], SamplingParams(max_tokens=12, temperature=0.8, seed=2,
                                                   stop=[f" w{probe[4]}"], ignore_eos=True)),
    ]
    got, expected, _ = both(folder, requests)
    assert got == expected
    assert len(got["stops"]) <= 4 and got["stops"][-1] == probe[3]
    assert len(got["stop-string"]) <= 5 and got["stop-string"] == probe[:len(got["stop-string"])]
    assert {"fork/0", "fork/1", "fork/2"} <= set(got)


def test_operator_commands_between_steps_see_every_request_as_it_is(tiny_model):
    """Preempt, swap out and in, abort and a request ended by its caller, between steps
    of an engine with a step in flight: each command reads the flight back first, and
    the surviving requests' tokens are a step at a time's."""
    folder = tiny_model("gqa16")
    prompts = random_prompts(SPECS["gqa16"].vocab_size, [12, 15, 9, 17], seed=8)
    requests = [(f"r{i}", p, greedy(16)) for i, p in enumerate(prompts)]

    def operator(engine, step):
        if step == 4:
            engine.preempt("r0")
        elif step == 6:
            engine.swap_out("r1")
        elif step == 9:
            try:
                engine.swap_in("r1")
            except NotEnoughBlocksError:
                pass
        elif step == 7:
            engine.abort("r2")
        elif step == 8:
            engine.finish_request("r3")
        if step >= 10 and any(r.request_id == "r1" for r in engine.scheduler.swapped):
            engine.swap_in("r1")

    got, expected, engine = both(folder, requests, operator, preemption_mode="swap")
    assert got == expected
    assert got["r0"] == hf_greedy(folder, prompts[:1], 16)[0]
    assert got["r1"] == hf_greedy(folder, prompts[1:2], 16)[0]
    assert len(got["r2"]) < 16 and len(got["r3"]) < 16


@pytest.mark.parametrize("how", ["stop-and-copy", "staged"])
def test_a_move_between_engines_with_async_scheduling(tiny_model, how):
    """A request moved mid-decode from an engine with a step in flight to another one
    (the migration's offer, stages and commit settle the source first): its tokens are
    transformers'."""
    from tests.engine.test_migration import move, staged_move

    folder = tiny_model("gqa16")
    prompt = random_prompts(SPECS["gqa16"].vocab_size, [22], seed=4)[0]
    source = make_engine(folder, async_scheduling=True)
    dest = make_engine(folder, async_scheduling=True)
    source.add_request("m", prompt, greedy(14))
    for _ in range(5):
        source.step()
    assert source._flight is not None
    if how == "staged":
        staged_move(source, dest, "m", steps_between=3)
    else:
        move(source, dest, "m")
    done = {}
    while dest.has_unfinished_requests() or source.has_unfinished_requests():
        for engine in (source, dest):
            for o in engine.step():
                if o.finished and o.request_id == "m" and engine is dest:
                    done["m"] = o.output_token_ids
    assert done["m"] == hf_greedy(folder, [prompt], 14)[0]
    assert source.kv.gpu.num_free == source.kv.gpu.num_blocks


def test_async_scheduling_is_on_by_default_only_on_cuda(tiny_model):
    engine = make_engine(tiny_model("gqa16"))
    assert engine.config.async_scheduling is None and not engine.async_scheduling


def test_a_fork_keeps_its_prompt_logprobs_with_async_scheduling(tiny_model):
    """A request with n > 1 and prompt logprobs: the step that scores its prompt is read
    back at once, its prompt logprobs kept before it forks, so each sample carries them
    as with a step at a time."""
    folder = tiny_model("gqa16")
    prompt = random_prompts(SPECS["gqa16"].vocab_size, [11], seed=3)[0]
    params = SamplingParams(max_tokens=4, n=2, temperature=0.0, prompt_logprobs=2,
                            ignore_eos=True)
    kept = {}
    for ahead in (True, False):
        engine = make_engine(folder, async_scheduling=ahead)
        engine.add_request("f", prompt, params)
        seen = kept[ahead] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.prompt_logprobs:
                    seen.setdefault(o.request_id, o.prompt_logprobs)
    assert set(kept[True]) == {"f/0", "f/1"}
    assert all(len(entries) == len(prompt) for entries in kept[True].values())
    assert kept[True] == kept[False]
