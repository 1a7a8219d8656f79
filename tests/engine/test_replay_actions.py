"""Operator actions and a warm-up in a replay (engine/sim/capacity.py replay_paged with
engine/sim/replay_actions.py): each action is applied at its simulated time through the
engine's own operator method, so the replay sees what a live engine saw; what the
replay's engine refuses is listed; a warm-up fills the cache and counts in no figure."""
import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from engine.observe.step_cost import StepCost
from engine.sim.capacity import WarmUp, replay_paged
from engine.sim.replay_actions import ReplayAction
from engine.sim.replay_stats import replay_stats
from engine.sim.trace import TraceRequest

CFG = dict(simulate=True, simulate_tokenizer="bytes", vocab_size=32000, block_size=16,
           num_gpu_blocks=256, num_cpu_blocks=64, max_model_len=1024, max_pending_events=0)
COST = StepCost(10.0, 0.0)  # 10 ms a step, whatever it holds
rng = random.Random(3)
SYSTEM = [rng.randrange(32000) for _ in range(96)]  # six blocks shared by every job


def prompt(k: int) -> list[int]:
    return SYSTEM + [(1000 + 37 * k + j) % 32000 for j in range(20)]


def jobs(*arrivals: float, output: int = 4) -> list[TraceRequest]:
    return [TraceRequest(at, 116, output) for at in arrivals]


def live_cached_tokens(reset_after: int) -> list[int]:
    """What a live simulated engine caches for three jobs run one after another, its
    prefix cache reset by an operator after job `reset_after`."""
    engine = LLMEngine(EngineConfig(**CFG))
    cached = []
    for k in range(3):
        engine.add_request(f"j{k}", prompt(k), SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    cached.append(out.num_cached_tokens)
        if k == reset_after:
            engine.reset_prefix_cache()
    return cached


def test_a_reset_in_the_window_reproduces_the_miss_that_followed_it():
    live = live_cached_tokens(reset_after=0)
    assert live == [0, 0, 96]  # the job after the reset missed, the next hit it
    trace = jobs(0.0, 1.0, 2.0)
    prompts = [prompt(k) for k in range(3)]
    reset = ReplayAction(0.5, "reset", label="reset")
    replayed = replay_stats(trace, EngineConfig(**CFG), COST, prompts, actions=[reset])
    assert replayed["prefix_hit_rate"] == sum(live) / (3 * 116)
    assert replayed["actions_applied"] == 1 and replayed["actions_refused"] == []
    # without the reset the replay would have hit where the engine missed
    unaware = replay_stats(trace, EngineConfig(**CFG), COST, prompts)
    assert unaware["prefix_hit_rate"] == 2 * 96 / (3 * 116)


def test_a_warm_window_reproduces_its_first_hits_and_counts_no_warm_up():
    trace = jobs(0.0)
    warm = WarmUp(jobs(0.0, 0.5), [prompt(10), prompt(11)], lead_s=1.0)
    cold = replay_stats(trace, EngineConfig(**CFG), COST, [prompt(0)])
    warmed = replay_stats(trace, EngineConfig(**CFG), COST, [prompt(0)], warmup=warm)
    assert cold["prefix_hit_rate"] == 0.0
    assert warmed["prefix_hit_rate"] == 96 / 116  # the system prompt, cached before
    assert warmed["warmup_requests"] == 2
    # the warm-up's steps and prompt tokens are in no figure
    assert warmed["steps"] == cold["steps"] and warmed["requests"] == 1
    assert warmed["prompt_tokens_computed"] == 116 - 96
    assert warmed["sim_seconds"] == cold["sim_seconds"]


def test_a_warm_up_job_the_configuration_cannot_take_is_left_out():
    small = EngineConfig(**{**CFG, "num_gpu_blocks": 10})  # 160 tokens: not 40 + 200
    warm = WarmUp([TraceRequest(0.0, 200, 4), TraceRequest(0.1, 116, 4)],
                  [[7] * 200, prompt(10)], lead_s=1.0)
    stats = replay_stats(jobs(0.0), small, COST, [prompt(0)], warmup=warm)
    assert stats["prefix_hit_rate"] == 96 / 116  # the second warm-up job ran
    with pytest.raises(InvalidRequestError):  # (the window's own: an error)
        replay_stats([TraceRequest(0.0, 200, 4)], small, COST, [[7] * 200])


def test_a_reset_at_the_end_of_the_warm_up_leaves_the_window_cold():
    """An action after the warm-up's last job (before the window) still applies."""
    warm = WarmUp(jobs(0.0), [prompt(10)], [ReplayAction(5.0, "reset")], lead_s=6.0)
    stats = replay_stats(jobs(0.0), EngineConfig(**CFG), COST, [prompt(0)], warmup=warm)
    assert stats["prefix_hit_rate"] == 0.0 and stats["actions_refused"] == []


def test_an_operator_preemption_and_a_pause_are_replayed_at_their_times():
    trace = jobs(0.0, output=50)
    preempt = ReplayAction(0.1, "preempt", request=0, label="preempt job-7-1")
    stats = replay_stats(trace, EngineConfig(**CFG), COST, [prompt(0)], actions=[preempt])
    assert stats["preemptions"] == 1
    plain = replay_stats(trace, EngineConfig(**CFG), COST, [prompt(0)])
    assert plain["preemptions"] == 0
    # paused from 0.05 s to 2 s: the job arriving at 0.5 s waits until the resume
    paused = replay_stats(jobs(0.0, 0.5), EngineConfig(**CFG), COST,
                          [prompt(0), prompt(1)],
                          actions=[ReplayAction(0.05, "pause"), ReplayAction(2.0, "resume")])
    assert paused["queue_wait_p99"] == pytest.approx(1.5)
    assert paused["sim_seconds"] > 2.0


def test_a_request_that_moved_away_leaves_and_one_aborted_before_it_ran_is_not_counted():
    long_job = jobs(0.0, output=200)
    moved = replay_paged(long_job, EngineConfig(**CFG), COST, prompts=[prompt(0)],
                         actions=[ReplayAction(0.2, "move-out", request=0)])
    stayed = replay_paged(long_job, EngineConfig(**CFG), COST, prompts=[prompt(0)])
    assert moved.sim_seconds == pytest.approx(0.2) and stayed.sim_seconds > 1.0
    # aborted while paused, before its first step: in no figure, and the later job counts
    stats = replay_stats(jobs(0.0, 0.2, 0.3), EngineConfig(**CFG), COST,
                         [prompt(0), prompt(1), prompt(2)],
                         actions=[ReplayAction(0.15, "pause"),
                                  ReplayAction(0.25, "abort", request=1),
                                  ReplayAction(0.4, "resume")])
    assert stats["queue_wait_p99"] == pytest.approx(0.1)  # the third job, to the resume
    assert stats["prefix_hit_rate"] == (0 + 96) / (2 * 116)


def test_a_pin_keeps_a_prefix_through_an_eviction_and_a_refused_action_is_listed():
    trace = jobs(0.0, 1.0)
    prompts = [prompt(0), prompt(1)]
    evict = ReplayAction(0.6, "evict", label="evict")
    pin = ReplayAction(0.5, "pin", tokens=tuple(SYSTEM), label="pin")
    kept = replay_stats(trace, EngineConfig(**CFG), COST, prompts, actions=[pin, evict])
    lost = replay_stats(trace, EngineConfig(**CFG), COST, prompts, actions=[evict])
    assert kept["prefix_hit_rate"] == 96 / (2 * 116) and lost["prefix_hit_rate"] == 0.0
    # job 0 ended long before 0.8 s in the replay: its preemption is refused, listed
    late = ReplayAction(0.8, "preempt", request=0, label="preempt job-3-1")
    stats = replay_stats(trace, EngineConfig(**CFG), COST, prompts, actions=[late])
    assert stats["actions_applied"] == 0
    [refusal] = stats["actions_refused"]
    assert (refusal["action"], refusal["at"]) == ("preempt job-3-1", 0.8)
    assert "t0" in refusal["why"]


def test_an_action_is_checked_when_made():
    with pytest.raises(ValueError, match="unknown replay action"):
        ReplayAction(0.0, "drain")
    with pytest.raises(ValueError, match="needs a trace request"):
        ReplayAction(0.0, "preempt")
    with pytest.raises(ValueError, match="acts on no request"):
        ReplayAction(0.0, "reset", request=2)
    with pytest.raises(ValueError, match="needs the prefix's tokens"):
        ReplayAction(0.0, "pin")
