"""What-if runs (kvops/what_if/what_if.py) in this process: the task's replay of the engine's own
configuration is the simulator's replay of the same trace and configuration, a bigger
pool preempts no more than a smaller one, and what start() refuses. (The task through
a real worker: test_what_if_api.py.)"""
import random
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from engine import LLMEngine, SamplingParams
from engine.observe.step_cost import StepCost
from engine.sim.capacity import replay_paged
from engine.sim.replay_actions import ReplayAction
from engine.kv.tiers.disk_seal import file_bytes
from kvops import tasks
from kvops.what_if import what_if
from kvops.models import Engine, Job, OperatorAction, WhatIfRun
from kvops.what_if.what_if_trace import build_trace

pytestmark = pytest.mark.django_db

CONFIG = {"simulate": True, "block_size": 16, "vocab_size": 32000, "model": "simulated-v1",
          "num_gpu_blocks": 48, "num_cpu_blocks": 32, "max_model_len": 1024,
          "max_num_seqs": 16, "max_num_batched_tokens": 512, "preemption_mode": "recompute",
          "enable_prefix_caching": True, "sliding_window": None}
SYSTEM = "System: you answer questions about KV caches, briefly and exactly. "


@pytest.fixture
def busy_engine():
    """An engine whose last minute of jobs (40, arriving within 2 s, sharing a system
    prompt) overflows its 48-block pool."""
    operator = User.objects.create_user("op", is_staff=True)
    engine = Engine.objects.create(name="busy", worker="engine-busy@test", config=CONFIG)
    rng = random.Random(7)
    start = timezone.now() - timedelta(seconds=30)
    for i in range(40):
        prompt = SYSTEM + f"question {i}: " + "x" * rng.randrange(20, 120)
        job = Job.objects.create(owner=operator, prompt=prompt, params={}, engine="busy",
                                 status=Job.Status.FINISHED,
                                 num_prompt_tokens=len(prompt.encode()),
                                 num_output_tokens=rng.randrange(60, 200))
        Job.objects.filter(pk=job.pk).update(queued_at=start + timedelta(seconds=i * 0.05))
    return operator, engine


def test_the_task_replays_both_configurations_as_the_simulator_does(busy_engine):
    operator, engine = busy_engine
    cost = StepCost(8.0, 0.02)
    run = what_if.start(operator, engine, 10, 100, {"num_gpu_blocks": 480}, cost)
    assert run.status == "queued"
    audit = OperatorAction.objects.get(action="what-if")
    assert (audit.engine, audit.target, audit.user, audit.status_code) == \
        ("busy", str(run.pk), operator, 202)
    assert audit.params["alternative"] == {"num_gpu_blocks": 480}

    # The task body, run here by Celery (the worker's own path: test_what_if_api.py).
    assert tasks.what_if.apply(args=[run.pk]).get() == "finished"
    run.refresh_from_db()
    assert run.status == "finished" and run.progress == 1.0 and run.error == ""
    assert run.trace["jobs"] == 40

    trace = build_trace(engine, 10, 100, until=run.created_at)
    base = what_if.baseline_config(engine.config)
    alternative = what_if.alternative_config(base, {"num_gpu_blocks": 480})
    for stored, config in ((run.baseline, base), (run.alternative, alternative)):
        direct = replay_paged(trace.requests, config, cost, prompts=trace.prompts)
        assert stored["config"]["num_gpu_blocks"] == config.num_gpu_blocks
        assert (stored["preemptions"], stored["swaps_out"], stored["steps"],
                stored["sim_seconds"], stored["slot_utilisation"],
                stored["prefix_lookup_hit_rate"], stored["peak_concurrency"]) == \
            (direct.preemptions, direct.swaps_out, direct.steps, direct.sim_seconds,
             direct.utilisation, direct.prefix_hit_rate, direct.peak_concurrency)
    assert run.baseline["config"]["num_gpu_blocks"] == 48
    # The trace preempts on the engine's pool; ten times the pool preempts no more.
    assert run.baseline["preemptions"] > 0
    assert run.alternative["preemptions"] <= run.baseline["preemptions"]
    assert run.alternative["prefix_hit_rate"] > 0  # the shared system prompt
    for stats in (run.baseline, run.alternative):
        assert stats["queue_wait_p50"] <= stats["queue_wait_p99"]
        assert 0 < stats["kv_usage_peak"] <= 1.0

    # A second delivery of the same run does nothing.
    assert tasks.what_if.apply(args=[run.pk]).get() == "skipped"


def test_the_cpu_tier_is_replayed_when_asked(busy_engine):
    """The alternative turns the CPU pool into a prefix-cache tier: the replay is the
    simulator's with that setting, and requests preempted by recompute find their
    blocks there again."""
    operator, engine = busy_engine
    changes = {"cpu_prefix_cache": True, "num_cpu_blocks": 256}
    run = what_if.start(operator, engine, 10, 100, changes, StepCost())
    assert tasks.what_if.apply(args=[run.pk]).get() == "finished"
    run.refresh_from_db()
    assert (run.baseline["config"]["cpu_prefix_cache"],
            run.alternative["config"]["cpu_prefix_cache"]) == (False, True)
    trace = build_trace(engine, 10, 100, until=run.created_at)
    config = what_if.alternative_config(what_if.baseline_config(engine.config), changes)
    direct = replay_paged(trace.requests, config, StepCost(), prompts=trace.prompts)
    assert run.alternative["cpu_tier_hit_rate"] == direct.extra["cpu_hit_rate"] > 0
    assert run.baseline["cpu_tier_hit_rate"] == 0.0


def test_start_refuses_what_cannot_run(busy_engine):
    operator, engine = busy_engine
    cost = StepCost()
    refusals = [
        ({"preemption_mode": "swap", "num_cpu_blocks": 0}, "num_cpu_blocks > 0"),
        ({"num_gpu_blocks": 8}, "cannot hold the longest job"),
        ({"block_size": 3}, "power of two"),
        ({"num_gpu_blocks": 1 << 22, "block_size": 16}, "the simulator takes at most"),
        ({"model": "other"}, "cannot change model"),
        ({"cpu_prefix_cache": True, "enable_prefix_caching": False}, "needs enable_prefix_caching"),
    ]
    for changes, message in refusals:
        with pytest.raises(what_if.Refused, match=message):
            what_if.start(operator, engine, 10, 100, changes, cost)
    with pytest.raises(what_if.Refused, match="nothing to replay"):
        Job.objects.update(queued_at=timezone.now() - timedelta(hours=2))
        what_if.start(operator, engine, 10, 100, {}, cost)
    assert not WhatIfRun.objects.exists() and not OperatorAction.objects.exists()


def test_at_most_two_runs_wait_per_engine(busy_engine):
    operator, engine = busy_engine
    for _ in range(what_if.MAX_UNFINISHED):
        what_if.start(operator, engine, 10, 100, {}, StepCost())
    with pytest.raises(what_if.Busy, match="queued or running"):
        what_if.start(operator, engine, 10, 100, {}, StepCost())


def test_a_pool_size_left_out_keeps_the_pool_memory():
    base = what_if.baseline_config(CONFIG)
    bigger_blocks = what_if.alternative_config(base, {"block_size": 64})
    assert (bigger_blocks.num_gpu_blocks, bigger_blocks.num_cpu_blocks) == (12, 8)
    assert what_if.alternative_config(base, {}).num_gpu_blocks == 48
    with pytest.raises(what_if.Refused, match="registered no"):
        what_if.baseline_config({"block_size": 16})


def test_an_engine_with_layer_groups_is_replayed_with_them():
    """An engine keeping a table per layer group (a Gemma) registers its groups' windows:
    the replay's stand-in keeps a global and a sliding group too."""
    base = what_if.baseline_config({**CONFIG, "kv_group_windows": [None, 64, 64]})
    assert base.simulate_hybrid and base.simulate_sliding_window == 64
    plain = what_if.baseline_config(CONFIG)
    assert not plain.simulate_hybrid and plain.simulate_sliding_window is None


def test_a_disk_tier_is_replayed_when_asked(busy_engine):
    """The alternative adds a disk tier below a small CPU tier: the replay keeps it in a
    folder of its own, sized in the engine's blocks, and the jobs preempted by
    recompute find some of their blocks there; without the CPU tier it is refused."""
    operator, engine = busy_engine
    Engine.objects.filter(pk=engine.pk).update(
        config={**CONFIG, "kv_bytes_per_block": 720 * 1024})
    engine.refresh_from_db()
    changes = {"cpu_prefix_cache": True, "num_cpu_blocks": 8,
               "disk_cache_bytes": 4096 * 720 * 1024}
    run = what_if.start(operator, engine, 10, 100, changes, StepCost())
    assert tasks.what_if.apply(args=[run.pk]).get() == "finished"
    run.refresh_from_db()
    assert run.alternative["config"]["disk_cache_bytes"] == changes["disk_cache_bytes"]
    assert run.baseline["config"]["disk_cache_bytes"] == 0
    assert run.alternative["disk_tier_hit_rate"] > 0 == run.baseline["disk_tier_hit_rate"]
    config = what_if.with_disk(what_if.alternative_config(
        what_if.baseline_config(engine.config), changes), "/nowhere", 720 * 1024)
    assert config.disk_cache_dir == "/nowhere" and config.disk_cache_bytes == 4096 * file_bytes(128)
    # without the CPU tier, the disk sits straight below the GPU pool
    direct = what_if.start(operator, engine, 10, 100, {"disk_cache_bytes": 4096 * 720 * 1024},
                           StepCost())
    assert tasks.what_if.apply(args=[direct.pk]).get() == "finished"
    direct.refresh_from_db()
    assert direct.alternative["disk_tier_hit_rate"] > 0
    assert not direct.alternative["config"]["cpu_prefix_cache"]


def test_an_eviction_policy_is_replayed_when_asked(busy_engine):
    operator, engine = busy_engine
    run = what_if.start(operator, engine, 10, 100, {"eviction_policy": "slru"}, StepCost())
    assert tasks.what_if.apply(args=[run.pk]).get() == "finished"
    run.refresh_from_db()
    assert (run.baseline["config"]["eviction_policy"],
            run.alternative["config"]["eviction_policy"]) == ("lru", "slru")
    trace = build_trace(engine, 10, 100, until=run.created_at)
    config = what_if.alternative_config(what_if.baseline_config(engine.config),
                                        {"eviction_policy": "slru"})
    direct = replay_paged(trace.requests, config, StepCost(), prompts=trace.prompts)
    assert run.alternative["preemptions"] == direct.preemptions
    assert run.alternative["prefix_lookup_hit_rate"] == direct.prefix_hit_rate


def test_an_fp8_kv_cache_is_replayed_as_more_blocks_in_the_same_memory(busy_engine):
    """A bfloat16 engine's 48 blocks are 96 in fp8: the replay of the same jobs preempts
    less; a simulated engine (no dtype) is refused the lever."""
    operator, engine = busy_engine
    Engine.objects.filter(pk=engine.pk).update(
        config={**CONFIG, "simulate": False, "dtype": "bfloat16", "kv_cache_dtype": "auto",
                "kv_bytes_per_block": 720 * 1024})
    engine.refresh_from_db()
    run = what_if.start(operator, engine, 10, 100, {"kv_cache_dtype": "fp8_e4m3"}, StepCost())
    assert tasks.what_if.apply(args=[run.pk]).get() == "finished"
    run.refresh_from_db()
    assert (run.baseline["config"]["kv_cache_dtype"],
            run.alternative["config"]["kv_cache_dtype"]) == ("bfloat16", "fp8_e4m3")
    assert (run.baseline["config"]["num_gpu_blocks"],
            run.alternative["config"]["num_gpu_blocks"]) == (48, 96)
    assert run.alternative["config"]["num_cpu_blocks"] == 64
    assert run.baseline["preemptions"] > run.alternative["preemptions"]
    # an fp8 engine asked about its model's own dtype: half the blocks
    fp8 = {**engine.config, "kv_cache_dtype": "fp8_e4m3"}
    halved = what_if.alternative_config(what_if.baseline_config(fp8), {"kv_cache_dtype": "auto"}, fp8)
    assert halved.num_gpu_blocks == 24
    Engine.objects.filter(pk=engine.pk).update(config=CONFIG)
    engine.refresh_from_db()
    with pytest.raises(what_if.Refused, match="real model"):
        what_if.start(operator, engine, 10, 100, {"kv_cache_dtype": "fp8_e5m2"}, StepCost())


def test_the_engines_pins_are_pinned_before_the_replay_within_the_pin_budget(busy_engine):
    """The operator log's hard pin of the jobs' shared system prompt, held since before
    the replayed period (an earlier pin unpinned, another before a reset, and a soft one
    are not the engine's any more), is pinned before each replay: under the engine's
    budget it holds the prompt's blocks, under a budget of 0 it is refused."""
    operator, engine = busy_engine
    for action, params in [("pin", {"prompt": "an old prefix that was reset " * 3}),
                           ("reset", {}),
                           ("pin", {"prompt": "pinned then unpinned, long enough " * 2}),
                           ("unpin", {"prompt": "pinned then unpinned, long enough " * 2}),
                           ("pin", {"prompt": "a soft pin of a different prefix here", "soft": True}),
                           ("pin", {"prompt": SYSTEM})]:
        OperatorAction.objects.create(user=operator, engine="busy", action=action,
                                      params=params, ok=True, status_code=200)
    # (an hour ago: before the window and its warm-up)
    OperatorAction.objects.update(created_at=timezone.now() - timedelta(hours=1))
    from kvops.what_if.what_if_log import active_pins
    assert active_pins("busy", timezone.now()) == [{"prompt": SYSTEM}]
    run = what_if.start(operator, engine, 10, 100, {"pin_budget": 0.0}, StepCost())
    assert tasks.what_if.apply(args=[run.pk]).get() == "finished"
    run.refresh_from_db()
    assert run.trace["pins"] == 1
    assert (run.baseline["config"]["pin_budget"], run.alternative["config"]["pin_budget"]) == (0.5, 0.0)
    # the system prompt's full blocks of 16 (its characters are its tokens here)
    assert run.baseline["pinned_blocks"] == len(SYSTEM) // 16 and run.baseline["pins_refused"] == 0
    assert run.alternative["pinned_blocks"] == 0 and run.alternative["pins_refused"] == 1
    # the pins' own prefill is not the trace's
    assert run.baseline["requests"] == run.alternative["requests"] == 40


def test_a_run_without_a_step_cost_uses_the_engines_fit(busy_engine):
    """The step cost left out: the one the engine fitted to its own steps (its metrics'
    step_cost), which the replay then uses as it would an operator's; before the engine
    has a fit, the default, said so. A retry under the same key is the same request
    even if the fit moved since."""
    operator, engine = busy_engine
    fitted = StepCost(4.0, 0.3, decode_seq_ms=0.5, context_token_ms=0.001)
    run = what_if.start(operator, engine, 10, 100, {}, None, idempotency_key="k1")
    assert run.params["step_cost_source"] == "default"
    assert StepCost.from_dict(run.params["step_cost"]) == StepCost()
    engine.metrics = {"step_cost": {**fitted.as_dict(), "rms_ms": 0.5, "mean_ms": 9.0,
                                    "steps": 400}}
    engine.save(update_fields=["metrics"])
    again = what_if.start(operator, engine, 10, 100, {}, None, idempotency_key="k1")
    assert again.pk == run.pk and again.replayed
    run = what_if.start(operator, engine, 10, 100, {}, None)
    assert run.params["step_cost_source"] == "engine"
    assert StepCost.from_dict(run.params["step_cost"]) == fitted
    assert tasks.what_if.apply(args=[run.pk]).get() == "finished"
    run.refresh_from_db()
    assert run.trace["step_cost"]["source"] == "engine"
    trace = build_trace(engine, 10, 100, until=run.created_at)
    direct = replay_paged(trace.requests, what_if.baseline_config(engine.config), fitted,
                          prompts=trace.prompts)
    assert (run.baseline["steps"], run.baseline["sim_seconds"]) == \
        (direct.steps, direct.sim_seconds)
    mine = what_if.start(operator, engine, 10, 100, {}, StepCost(2.0, 0.01))
    assert mine.params["step_cost_source"] == "operator"


def test_the_baseline_is_held_against_what_the_engine_recorded():
    recorded = {"prefix_hit_rate": 0.358, "preemptions": 2, "ttft_p50": 0.0683,
                "ttft_p99": 0.2, "queue_wait_p50": 0.016, "service_delay_s": 0.016}
    close = {"prefix_hit_rate": 0.36, "preemptions": 3, "ttft_p50": 0.07, "ttft_p99": 0.25,
             "queue_wait_p50": 0.02}
    held = what_if.fidelity(recorded, close, simulated=True)
    assert held["misses"] == []
    assert held["figures"]["ttft_p50"] == {"recorded": 0.0683, "replayed": 0.07,
                                           "difference": pytest.approx(0.0017)}
    far = {**close, "prefix_hit_rate": 0.40, "ttft_p50": 0.0237, "preemptions": 9}
    assert what_if.fidelity(recorded, far, simulated=True)["misses"] == \
        ["prefix_hit_rate", "ttft_p50", "preemptions"]
    # a real model's engine is held to 5 points and 25%
    near = {**close, "prefix_hit_rate": 0.40, "ttft_p50": 0.08}
    assert what_if.fidelity(recorded, near, simulated=False)["misses"] == []
    assert what_if.as_seen({"ttft_p50": 0.05, "queue_wait_p50": None}, 0.016) == \
        {"ttft_p50": pytest.approx(0.066), "queue_wait_p50": None, "service_delay_s": 0.016}


def three_jobs_sharing_a_prompt(operator, at, cached=(0, 0, 0)):
    """Three jobs of engine busy sharing the system prompt, one a second from `at`."""
    jobs = []
    for i in range(3):
        prompt = SYSTEM + f"question {i}: " + "y" * (30 + 7 * i)
        job = Job.objects.create(owner=operator, prompt=prompt, params={}, engine="busy",
                                 status=Job.Status.FINISHED, request_id=f"r{i}",
                                 num_prompt_tokens=len(prompt.encode()), num_output_tokens=4,
                                 num_cached_tokens=cached[i])
        Job.objects.filter(pk=job.pk).update(queued_at=at + timedelta(seconds=i))
        jobs.append(job)
    return jobs


def live_cached(prompts, reset_after):
    """The prompt tokens a live simulated engine of CONFIG serves from its cache to each
    prompt run one after another, an operator resetting its cache after `reset_after`."""
    live = LLMEngine(what_if.baseline_config(CONFIG))
    cached = []
    for k, tokens in enumerate(prompts):
        live.add_request(f"j{k}", tokens, SamplingParams(max_tokens=4, ignore_eos=True))
        while live.has_unfinished_requests():
            cached += [o.num_cached_tokens for o in live.step() if o.finished]
        if k == reset_after:
            live.reset_prefix_cache()
    return cached


@pytest.fixture
def quiet_engine():
    operator = User.objects.create_user("op", is_staff=True)
    return operator, Engine.objects.create(name="busy", worker="engine-busy@test", config=CONFIG)


def test_a_replay_with_a_reset_in_its_window_reproduces_the_miss_that_followed_it(quiet_engine):
    operator, engine = quiet_engine
    at = timezone.now() - timedelta(seconds=30)
    jobs = three_jobs_sharing_a_prompt(operator, at)
    reset = OperatorAction.objects.create(user=operator, engine="busy", action="reset",
                                          ok=True, status_code=200)
    OperatorAction.objects.filter(pk=reset.pk).update(created_at=at + timedelta(seconds=0.5))
    trace = build_trace(engine, 10, 100)
    live = live_cached(trace.prompts, reset_after=0)
    assert live[0] == live[1] == 0 < live[2]  # the job after the reset missed
    for job, cached in zip(jobs, live):  # as the engine recorded them
        Job.objects.filter(pk=job.pk).update(num_cached_tokens=cached)

    run = what_if.start(operator, engine, 10, 100, {}, StepCost())
    assert tasks.what_if.apply(args=[run.pk]).get() == "finished"
    run.refresh_from_db()
    assert run.trace["actions"] == 1 and run.trace["not_replayed"] == []
    assert run.baseline["actions_applied"] == 1 and run.baseline["actions_refused"] == []
    figure = run.baseline["fidelity"]["figures"]["prefix_hit_rate"]
    assert figure["replayed"] == figure["recorded"] == sum(live) / run.trace["prompt_tokens"]
    assert "prefix_hit_rate" not in run.baseline["fidelity"]["misses"]
    # a replay blind to the reset would have hit where the engine missed
    blind = replay_paged(trace.requests, what_if.baseline_config(CONFIG), StepCost(),
                         prompts=trace.prompts)
    assert blind.prefix_hit_rate > run.baseline["prefix_lookup_hit_rate"]


def test_a_window_starting_from_a_warm_cache_reproduces_its_first_hits(quiet_engine):
    """Jobs queued before the window cached the system prompt: the first job in the
    window hits it in the replay as it did on the engine; the warm-up is in no figure."""
    operator, engine = quiet_engine
    now = timezone.now()
    before = three_jobs_sharing_a_prompt(operator, now - timedelta(seconds=68))
    Job.objects.filter(pk__in=[j.pk for j in before]).update(request_id="")
    first = Job.objects.create(owner=operator, prompt=SYSTEM + "and in the window?", params={},
                               engine="busy", status=Job.Status.FINISHED,
                               num_prompt_tokens=len(SYSTEM) + 18, num_output_tokens=4,
                               num_cached_tokens=len(SYSTEM) // 16 * 16)
    Job.objects.filter(pk=first.pk).update(queued_at=now - timedelta(seconds=10))

    run = what_if.start(operator, engine, 1, 100, {}, StepCost())
    assert tasks.what_if.apply(args=[run.pk]).get() == "finished"
    run.refresh_from_db()
    assert (run.trace["jobs"], run.trace["warmup_jobs"]) == (1, 3)
    assert run.baseline["requests"] == 1 and run.baseline["warmup_requests"] == 3
    assert run.baseline["prefix_hit_rate"] == run.trace["recorded"]["prefix_hit_rate"] > 0
    assert run.baseline["prompt_tokens_computed"] == first.num_prompt_tokens - first.num_cached_tokens
    # the same window from an empty cache misses it
    trace = build_trace(engine, 1, 100, until=run.created_at)
    cold = replay_paged(trace.requests, what_if.baseline_config(CONFIG), StepCost(),
                        prompts=trace.prompts)
    assert cold.prefix_hit_rate == 0.0


def test_the_alternative_keeps_the_settings_it_changes():
    """The engine's own retention change is applied to the baseline; an alternative that
    sets the eviction policy keeps its own (the pin budget still follows the engine)."""
    change = ReplayAction(1.0, "retention",
                          arguments={"eviction_policy": "lfu", "pin_budget": 0.2})
    assert what_if.actions_for([change], {}) == [change]
    [kept] = what_if.actions_for([change], {"eviction_policy": "slru", "pin_budget": None})
    assert kept.arguments == {"pin_budget": 0.2}
    assert what_if.actions_for([change], {"eviction_policy": "slru", "pin_budget": 0.1}) == []


def _without(result: dict, *keys: str) -> dict:
    return {k: v for k, v in result.items() if k not in ("wall_seconds", *keys)}


@pytest.fixture
def cycling_engine():
    """An engine whose jobs cycle through six documents (about 20 blocks each), one
    question at a time, five rounds: its 48-block pool has evicted a document before
    its next question (the pool's LRU order cycles), a pool of all six keeps them."""
    operator = User.objects.create_user("op", is_staff=True)
    engine = Engine.objects.create(name="cycling", worker="engine-cycling@test", config=CONFIG)
    rng = random.Random(3)
    documents = [f"Document {d}: " + "".join(rng.choice("abcdefgh ") for _ in range(300))
                 for d in range(6)]
    start = timezone.now() - timedelta(seconds=60)
    for i in range(30):
        prompt = documents[i % 6] + f" Question {i}: what does it say?"
        job = Job.objects.create(owner=operator, prompt=prompt, params={}, engine="cycling",
                                 status=Job.Status.FINISHED,
                                 num_prompt_tokens=len(prompt.encode()), num_output_tokens=20)
        Job.objects.filter(pk=job.pk).update(queued_at=start + timedelta(seconds=i * 0.5))
    return operator, engine


def test_a_sweep_replays_each_value_as_a_run_of_that_alternative_would(cycling_engine):
    """A sweep of the GPU pool: one replay a value, in the order asked; the engine's own
    value replays as the baseline does, another as a run asking for it alone; a bigger
    pool keeps more of the documents between their questions: the hit rate never falls
    as the pool grows, and rises from the engine's pool to one that holds them all."""
    operator, engine = cycling_engine
    cost = StepCost(8.0, 0.02)
    values = [48, 96, 192, 480]
    run = what_if.start(operator, engine, 10, 100, {}, cost,
                        sweep={"lever": "num_gpu_blocks", "values": values})
    assert run.params["sweep"] == {"lever": "num_gpu_blocks", "values": values}
    assert tasks.what_if.apply(args=[run.pk]).get() == "finished"
    run.refresh_from_db()
    assert run.status == "finished" and run.progress == 1.0 and run.alternative == {}
    results = run.sweep["results"]
    assert run.sweep["lever"] == "num_gpu_blocks"
    assert [r["value"] for r in results] == [r["config"]["num_gpu_blocks"] for r in results] \
        == values
    assert _without(results[0], "value") == _without(run.baseline, "fidelity")

    single = what_if.start(operator, engine, 10, 100, {"num_gpu_blocks": 192}, cost)
    assert tasks.what_if.apply(args=[single.pk]).get() == "finished"
    single.refresh_from_db()
    assert single.sweep == {}
    assert _without(results[2], "value") == _without(single.alternative)

    hits = [r["prefix_hit_rate"] for r in results]
    assert hits == sorted(hits) and hits[-1] > hits[0] + 0.3, hits


def test_a_sweep_over_eviction_policies_keeps_the_other_changes(busy_engine):
    operator, engine = busy_engine
    policies = ["lru", "slru", "lfu", "priority"]
    run = what_if.start(operator, engine, 10, 100, {"num_gpu_blocks": 64}, StepCost(),
                        sweep={"lever": "eviction_policy", "values": policies})
    assert tasks.what_if.apply(args=[run.pk]).get() == "finished"
    run.refresh_from_db()
    assert [(r["value"], r["config"]["eviction_policy"], r["config"]["num_gpu_blocks"])
            for r in run.sweep["results"]] == [(p, p, 64) for p in policies]
    assert run.baseline["config"]["num_gpu_blocks"] == 48


def test_a_sweep_that_cannot_run_is_refused_naming_its_value(busy_engine):
    operator, engine = busy_engine
    refusals = [
        ({"lever": "num_gpu_blocks", "values": [64, 8]}, "num_gpu_blocks = 8 pool"),
        ({"lever": "block_size", "values": [16, 3]}, "block_size = 3: .*power of two"),
        ({"lever": "num_gpu_blocks", "values": [64]}, "give 2 to 8 values"),
        ({"lever": "num_gpu_blocks", "values": list(range(64, 73))}, "give 2 to 8 values"),
        ({"lever": "model", "values": ["a", "b"]}, "cannot change model"),
    ]
    for sweep, message in refusals:
        with pytest.raises(what_if.Refused, match=message):
            what_if.start(operator, engine, 10, 100, {}, StepCost(), sweep=sweep)
    with pytest.raises(what_if.Refused, match="num_gpu_blocks is swept"):
        what_if.start(operator, engine, 10, 100, {"num_gpu_blocks": 64}, StepCost(),
                      sweep={"lever": "num_gpu_blocks", "values": [96, 128]})
    assert not WhatIfRun.objects.exists() and not OperatorAction.objects.exists()


@pytest.fixture
def two_tenants():
    """carol asks about one document every half second; dave, from the fifth second,
    sends one-off long prompts that flood the 48-block pool between her questions."""
    operator = User.objects.create_user("op", is_staff=True)
    carol, dave = User.objects.create_user("carol"), User.objects.create_user("dave")
    engine = Engine.objects.create(name="shared", worker="engine-shared@test", config=CONFIG)
    rng = random.Random(5)
    document = "Document: " + "".join(rng.choice("abcdefgh ") for _ in range(300))
    start = timezone.now() - timedelta(seconds=60)
    rows = [(carol, document + f" Question {i}?", i * 0.5) for i in range(20)]
    rows += [(dave, "".join(rng.choice("ijklmnop ") for _ in range(400)), 5 + i * 0.2)
             for i in range(20)]
    for owner, prompt, at in rows:
        job = Job.objects.create(owner=owner, prompt=prompt, params={}, engine="shared",
                                 status=Job.Status.FINISHED,
                                 num_prompt_tokens=len(prompt.encode()), num_output_tokens=8)
        Job.objects.filter(pk=job.pk).update(queued_at=start + timedelta(seconds=at))
    return operator, engine


def test_a_tenant_cache_quota_is_replayed_with_the_jobs_owners_as_tenants(two_tenants):
    operator, engine = two_tenants
    cost = StepCost(8.0, 0.02)
    run = what_if.start(operator, engine, 10, 100, {"tenant_cache_quota": 0.5}, cost)
    assert tasks.what_if.apply(args=[run.pk]).get() == "finished"
    run.refresh_from_db()
    assert (run.baseline["config"]["tenant_cache_quota"],
            run.alternative["config"]["tenant_cache_quota"]) == (1.0, 0.5)
    trace = build_trace(engine, 10, 100, until=run.created_at)
    assert len({r.tenant for r in trace.requests}) == 2
    config = what_if.alternative_config(what_if.baseline_config(engine.config),
                                        {"tenant_cache_quota": 0.5})
    direct = replay_paged(trace.requests, config, cost, prompts=trace.prompts)
    assert run.alternative["prefix_lookup_hit_rate"] == direct.prefix_hit_rate
    # dave's flood no longer evicts carol's document between her questions
    assert run.alternative["prefix_hit_rate"] > run.baseline["prefix_hit_rate"] + 0.05, \
        (run.alternative["prefix_hit_rate"], run.baseline["prefix_hit_rate"])
