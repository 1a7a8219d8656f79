"""engine/sim/replay_stats.py: a replay with its recorder gives the replay's own figures
unchanged, a queue wait for every request, occupancy over time, and replays given
prompts (capacity.replay_paged(prompts=...))."""
import random

from engine.observe.step_cost import StepCost
from engine.sim.capacity import replay_paged
from engine.config import EngineConfig
from engine.sim.replay_stats import ReplayRecorder, percentile, replay_stats
from engine.sim.trace import TraceRequest, synthetic_trace

CFG = dict(simulate=True, simulate_tokenizer="bytes",
           vocab_size=32000, block_size=16, num_cpu_blocks=64,
           max_model_len=1024, max_pending_events=0)


def test_the_recorder_changes_nothing_and_sees_every_request():
    trace = synthetic_trace(80, seed=5, rate_per_s=100.0, prompt_range=(16, 300),
                            output_range=(8, 150), prefix_len=64)
    config = EngineConfig(**CFG, num_gpu_blocks=96)
    plain = replay_paged(trace, config)
    recorder = ReplayRecorder(len(trace))
    observed = replay_paged(trace, EngineConfig(**CFG, num_gpu_blocks=96), observer=recorder)
    assert plain.preemptions > 0  # a trace that preempts
    for field in ("sim_seconds", "steps", "utilisation", "preemptions", "prefix_hit_rate",
                  "peak_concurrency", "mean_concurrency"):
        assert getattr(observed, field) == getattr(plain, field), field
    assert len(recorder.queue_waits) == len(trace) == len(recorder.ttfts)
    assert recorder.prompt_tokens == sum(r.prompt_len for r in trace)
    assert len(recorder.gpu_usage) == observed.steps
    assert max(recorder.gpu_usage) > 0.9  # the small pool fills up
    assert recorder.step_end[-1] == observed.sim_seconds


def test_queue_waits_are_zero_when_every_request_fits_at_once_and_grow_when_not():
    # Arrivals 1 s apart, each done well before the next: no request ever waits.
    sparse = [TraceRequest(float(i), 40, 5) for i in range(10)]
    stats = replay_stats(sparse, EngineConfig(**CFG, num_gpu_blocks=512))
    assert stats["queue_wait_p99"] == 0.0 and stats["preemptions"] == 0
    # All at once, one sequence at a time: the last waits for all the others.
    burst = [TraceRequest(0.0, 40, 20) for _ in range(10)]
    stats = replay_stats(burst, EngineConfig(**CFG, num_gpu_blocks=512, max_num_seqs=1),
                         StepCost(10.0, 0.0))
    assert stats["queue_wait_p50"] > 0 and stats["queue_wait_p99"] > stats["queue_wait_p50"]
    # 9 requests before the last, each 1 prefill step + 19 decode steps of 10 ms
    assert abs(stats["queue_wait_p99"] - 9 * 20 * 0.010) < 1e-9
    # its first token comes at the end of its prefill step: one step after its wait
    assert abs(stats["ttft_p99"] - (9 * 20 + 1) * 0.010) < 1e-9
    assert stats["ttft_p50"] < stats["ttft_p99"]


def test_the_timeline_keeps_the_peak_and_spans_the_run():
    trace = synthetic_trace(60, seed=2, rate_per_s=50.0, prompt_range=(16, 200),
                            output_range=(8, 100))
    stats = replay_stats(trace, EngineConfig(**CFG, num_gpu_blocks=64))
    tl = stats["timeline"]
    assert len(tl["t"]) == 200 and abs(tl["t"][-1] - stats["sim_seconds"]) < 1e-3
    assert max(tl["gpu"]) == round(stats["kv_usage_peak"], 4)
    assert 0 < stats["kv_usage_mean"] <= stats["kv_usage_peak"] <= 1.0
    assert all(0 <= v <= 1 for v in tl["gpu"])


def test_given_prompts_are_replayed_as_given():
    """Requests whose given prompts are equal hit each other's cached blocks; with the
    default prompts (no prefix group) they share nothing."""
    rng = random.Random(1)
    shared = [rng.randrange(32000) for _ in range(160)]
    trace = [TraceRequest(float(i), 160, 4) for i in range(4)]
    same = replay_stats(trace, EngineConfig(**CFG, num_gpu_blocks=256),
                        prompts=[list(shared) for _ in trace])
    apart = replay_stats(trace, EngineConfig(**CFG, num_gpu_blocks=256))
    # Each later request finds its whole prompt cached but the last token, which is
    # always computed.
    assert same["prefix_hit_rate"] == 3 * 159 / (4 * 160)
    assert apart["prefix_hit_rate"] == 0.0


def test_percentile_is_nearest_rank():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0 and percentile(values, 99) == 5.0
    assert percentile(values, 20) == 1.0 and percentile([], 50) is None


def test_queue_waits_follow_admission_when_a_tenants_policy_reorders_it():
    """Under fairness "vtc" B's short prompts are admitted before A's later long ones:
    each request's wait is taken when it is admitted, not when those before it in
    arrival order are (one sequence at a time, every step 10 ms, 5 steps a request)."""
    trace = [TraceRequest(0.0, 100, 5, tenant="A") for _ in range(3)] + \
        [TraceRequest(0.0, 5, 5, tenant="B") for _ in range(3)]
    recorder = ReplayRecorder(len(trace))
    replay_paged(trace, EngineConfig(**CFG, num_gpu_blocks=512, max_num_seqs=1,
                                     fairness="vtc"), StepCost(10.0, 0.0),
                 observer=recorder)
    # admitted a0, b0, b1, b2, a1, a2: 50 ms apart, in that order
    assert [round(w, 6) for w in recorder.queue_waits] == [0.0, 0.05, 0.1, 0.15, 0.2, 0.25]
    assert recorder.prompt_tokens == 3 * 100 + 3 * 5
