"""An engine's stored jobs as a simulator trace (kvops/what_if/what_if_trace.py): which jobs,
their arrival offsets and lengths, and prompts built to share exactly the prefixes the
jobs' prompts shared (per cache salt), with prefix groups that describe them."""
from datetime import timedelta
from itertools import combinations

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from kvops.models import Engine, Job, OperatorAction
from kvops.routing.tenancy import tenant
from kvops.what_if.what_if_trace import MAX_JOBS, build_trace

pytestmark = pytest.mark.django_db

SYSTEM = "You are a helpful assistant. Answer briefly. "  # 45 characters
SIM_CONFIG = {"simulate": True, "block_size": 4, "vocab_size": 32000, "model": "simulated-v1",
              "num_gpu_blocks": 256, "num_cpu_blocks": 64, "max_model_len": 1024,
              "max_num_seqs": 8, "max_num_batched_tokens": 512, "preemption_mode": "recompute"}


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def add_job(owner, engine, prompt, at, output=5, tokens=None, status=Job.Status.FINISHED,
            cached=0, preemptions=0):
    job = Job.objects.create(owner=owner, prompt=prompt, params={}, engine=engine,
                             status=status,
                             num_prompt_tokens=len(prompt.encode()) if tokens is None else tokens,
                             num_output_tokens=output, num_cached_tokens=cached,
                             num_preemptions=preemptions)
    Job.objects.filter(pk=job.pk).update(queued_at=at)
    return job


@pytest.fixture
def people():
    return User.objects.create_user("op", is_staff=True), User.objects.create_user("carol")


def test_the_trace_has_the_jobs_lengths_offsets_and_shared_prefixes(people):
    staff, carol = people
    engine = Engine.objects.create(name="wi", worker="engine-wi@test", config=SIM_CONFIG)
    t0 = timezone.now() - timedelta(minutes=5)

    def at(seconds: float):
        return t0 + timedelta(seconds=seconds)

    first = SYSTEM + "What is paged attention?"
    prompts = [
        (staff, first, 0.0, 7),
        (staff, first + " It splits the cache. And swapping?", 1.5, 9),  # the next turn
        (staff, SYSTEM + "Name a prime.", 3.25, 2),  # same system prompt, another question
        (staff, "Unrelated prompt with no shared start", 4.0, 0),  # running, no output yet
        (carol, first, 5.0, 3),  # same text, another user's salt: shares nothing
    ]
    jobs = [add_job(owner, "wi", text, at(s), output=out,
                    status=Job.Status.RUNNING if out == 0 else Job.Status.FINISHED,
                    cached=4 if i == 1 else 0, preemptions=1 if i == 2 else 0)
            for i, (owner, text, s, out) in enumerate(prompts)]
    # Not replayed: another engine's job, one that never reached the engine, an old one.
    add_job(staff, "other", first, at(2))
    add_job(staff, "wi", first, at(2), tokens=0, status=Job.Status.QUEUED)
    add_job(staff, "wi", first, t0 - timedelta(minutes=30))

    trace = build_trace(engine, minutes=10, max_jobs=100)

    assert trace.job_ids == [j.pk for j in jobs]
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.5, 3.25, 4.0, 5.0]
    assert [r.prompt_len for r in trace.requests] == [len(p[1].encode()) for p in prompts]
    assert [r.output_len for r in trace.requests] == [7, 9, 2, 1, 3]  # running: at least 1
    assert [len(p) for p in trace.prompts] == [r.prompt_len for r in trace.requests]
    # The simulator's tokenizer is UTF-8 bytes: every pair of built prompts shares what
    # the jobs' prompts shared, and nothing across salts.
    real = [list(p[1].encode()) for p in prompts]
    for i, j in combinations(range(5), 2):
        expected = 0 if (prompts[i][0] is carol) != (prompts[j][0] is carol) else common(real[i], real[j])
        assert common(trace.prompts[i], trace.prompts[j]) == expected, (i, j)
    assert all(0 <= t < 32000 for p in trace.prompts for t in p)
    # each request is its owner's tenant (quotas and fairness replay by it; staff: none)
    assert [r.tenant for r in trace.requests] == [None] * 4 + [tenant(carol)]
    assert tenant(carol) is not None
    # Groups: the three system-prompt jobs (sharing >= one block); prefix_len is the most
    # a job shares with any other.
    groups = [r.prefix_group for r in trace.requests]
    assert groups[:3] == [0, 0, 0] and groups[3] is None and groups[4] is None
    assert [r.prefix_len for r in trace.requests] == [len(first), len(first), len(SYSTEM), 0, 0]
    s = trace.summary
    assert (s["jobs"], s["prefix_groups"], s["still_running"], s["truncated"]) == (5, 1, 1, False)
    assert s["prefixes_from"] == "tokens" and s["span_s"] == 5.0
    assert s["prompt_tokens"] == sum(r.prompt_len for r in trace.requests)
    recorded = s["recorded"]
    assert (recorded["prefix_hit_rate"], recorded["preemptions"]) == (4 / s["prompt_tokens"], 1)
    assert recorded["prompt_tokens_computed"] == s["prompt_tokens"] - 4
    assert recorded["ttft_p50"] is None and recorded["service_delay_s"] == 0.0  # no times

    newest = build_trace(engine, minutes=10, max_jobs=2)
    assert newest.job_ids == [jobs[3].pk, jobs[4].pk] and newest.summary["truncated"]
    assert newest.requests[0].arrival_s == 0.0 and newest.requests[1].arrival_s == 1.0


def test_without_the_tokenizer_characters_give_the_shared_prefixes(people):
    """A model folder this process cannot read: shared characters, scaled to tokens by
    each job's own tokens per character (the smaller of the two)."""
    staff, _ = people
    config = dict(SIM_CONFIG, simulate=False, model_path="/nonexistent/model", block_size=8)
    engine = Engine.objects.create(name="far", worker="engine-far@test", config=config)
    now = timezone.now()
    a = SYSTEM + "first question here"
    b = SYSTEM + "second one"
    add_job(staff, "far", a, now - timedelta(seconds=3), tokens=len(a) // 2)
    add_job(staff, "far", b, now - timedelta(seconds=2), tokens=len(b) // 3)
    trace = build_trace(engine, minutes=1, max_jobs=10)
    assert trace.summary["prefixes_from"] == "characters"
    shared = int(len(SYSTEM) * min((len(a) // 2) / len(a), (len(b) // 3) / len(b)))
    assert common(trace.prompts[0], trace.prompts[1]) == shared
    assert [r.prefix_len for r in trace.requests] == [shared, shared]


def test_bounds_and_an_empty_window_are_refused(people):
    engine = Engine.objects.create(name="idle", worker="engine-idle@test", config=SIM_CONFIG)
    with pytest.raises(ValueError, match="nothing to replay"):
        build_trace(engine, minutes=5, max_jobs=10)
    for minutes, max_jobs in ((0, 10), (24 * 60 + 1, 10), (5, 0), (5, MAX_JOBS + 1)):
        with pytest.raises(ValueError, match="minutes must be in"):
            build_trace(engine, minutes=minutes, max_jobs=max_jobs)


def test_what_a_user_saw_is_recorded_beside_the_trace(people):
    """TTFT from arrival to first token and the wait to be claimed, per job; the median
    claim wait is the service's own delay, which the replay adds to its times."""
    staff, _ = people
    engine = Engine.objects.create(name="wt", worker="engine-wt@test", config=SIM_CONFIG)
    t0 = timezone.now() - timedelta(minutes=2)
    for i, (claim_s, first_s) in enumerate([(0.01, 0.05), (0.02, 0.30), (0.04, 0.10)]):
        job = add_job(staff, "wt", f"prompt {i} " * 4, t0 + timedelta(seconds=i))
        Job.objects.filter(pk=job.pk).update(
            started_at=t0 + timedelta(seconds=i + claim_s),
            first_token_at=t0 + timedelta(seconds=i + first_s))
    recorded = build_trace(engine, minutes=10, max_jobs=100).summary["recorded"]
    assert recorded["ttft_p50"] == pytest.approx(0.10)
    assert recorded["ttft_p99"] == pytest.approx(0.30)
    assert recorded["queue_wait_p50"] == pytest.approx(0.02)
    assert recorded["service_delay_s"] == pytest.approx(0.02)


def test_the_service_delay_is_a_jobs_ttft_less_the_engines_own(people):
    """With KV stories, the service's part of TTFT is what the engine's moments (arrival
    there to first token) leave of the user's TTFT: claim, hand-off, the way back."""
    staff, _ = people
    engine = Engine.objects.create(name="ws", worker="engine-ws@test", config=SIM_CONFIG)
    t0 = timezone.now() - timedelta(minutes=2)
    for i, (ttft, engine_s) in enumerate([(0.10, 0.07), (0.30, 0.28), (0.12, 0.07)]):
        job = add_job(staff, "ws", f"prompt {i} " * 4, t0 + timedelta(seconds=i))
        arrived = (t0 + timedelta(seconds=i)).timestamp() + 0.01
        Job.objects.filter(pk=job.pk).update(
            started_at=t0 + timedelta(seconds=i + 0.005),
            first_token_at=t0 + timedelta(seconds=i + ttft),
            kv_story={"moments": {"arrived": arrived, "first_token": arrived + engine_s}})
    recorded = build_trace(engine, minutes=10, max_jobs=100).summary["recorded"]
    assert recorded["service_delay_s"] == pytest.approx(0.03, abs=1e-5)  # of .03, .02, .05
    assert recorded["queue_wait_p50"] == pytest.approx(0.005)


def log(user, engine, action, at, target="", ok=True, **params):
    row = OperatorAction.objects.create(user=user, engine=engine, action=action, target=target,
                                        params=params, ok=ok, status_code=200 if ok else 409)
    OperatorAction.objects.filter(pk=row.pk).update(created_at=at)
    return row


def test_operator_actions_are_in_the_trace_at_their_times_and_the_rest_is_listed(people):
    staff, _ = people
    engine = Engine.objects.create(name="op", worker="engine-op@test", config=SIM_CONFIG)
    t0 = timezone.now() - timedelta(minutes=2)

    def at(seconds: float):
        return t0 + timedelta(seconds=seconds)

    jobs = [add_job(staff, "op", SYSTEM + f"question {i}", at(i)) for i in range(3)]
    Job.objects.filter(pk=jobs[1].pk).update(request_id=f"job-{jobs[1].pk}-2", attempts=2)
    log(staff, "op", "reset", at(0.5))
    log(staff, "op", "evict", at(0.6), num_blocks=3)
    log(staff, "op", "pin", at(0.7), token_ids=list(SYSTEM.encode()))
    log(staff, "op", "preempt", at(1.2), target=f"job-{jobs[1].pk}-2")
    log(staff, "op", "retention", at(1.3), eviction_policy="lfu")
    log(staff, "op", "pause", at(1.4))
    log(staff, "op", "resume", at(1.6))
    # not replayed: an earlier attempt, a request of no replayed job, a pin whose prefix
    # cannot be rebuilt (a job's, with no token ids); nothing for a refused action, a
    # drain or another engine's reset
    log(staff, "op", "abort", at(1.7), target=f"job-{jobs[1].pk}-1")
    log(staff, "op", "swap-out", at(1.8), target="job-99999-1")
    log(staff, "op", "pin", at(1.9), job=12345)
    log(staff, "op", "preempt", at(1.95), target=f"job-{jobs[2].pk}-1", ok=False)
    log(staff, "op", "drain", at(1.96))
    log(staff, "other", "reset", at(1.97))

    trace = build_trace(engine, minutes=10, max_jobs=100)

    kinds = [(a.kind, a.at_s, a.request) for a in trace.actions]
    assert kinds == [("reset", 0.5, None), ("evict", 0.6, None), ("pin", 0.7, None),
                     ("preempt", 1.2, 1), ("retention", 1.3, None), ("pause", 1.4, None),
                     ("resume", 1.6, None)]
    evict, pin, _, retention = trace.actions[1:5]
    assert evict.arguments == {"num_blocks": 3} and retention.arguments == {"eviction_policy": "lfu"}
    # the pin's prefix is the jobs' shared system prompt, in their token space
    assert list(pin.tokens) == trace.prompts[0][:len(SYSTEM)]
    assert common(pin.tokens, trace.prompts[2]) == len(SYSTEM)
    listed = trace.summary["not_replayed"]
    assert [(r["action"], r["at"]) for r in listed] == [
        (f"abort job-{jobs[1].pk}-1", 1.7), ("swap-out job-99999-1", 1.8), ("pin", 1.9)]
    assert "earlier attempt" in listed[0]["why"] and "not one of the replayed" in listed[1]["why"]
    assert "cannot be rebuilt" in listed[2]["why"]
    assert trace.summary["actions"] == 7


def test_jobs_that_moved_arrive_and_leave_when_they_did(people):
    staff, _ = people
    engine = Engine.objects.create(name="here", worker="engine-here@test", config=SIM_CONFIG)
    t0 = timezone.now() - timedelta(minutes=2)

    def at(seconds: float):
        return t0 + timedelta(seconds=seconds)

    stayed = add_job(staff, "here", "a job that stayed here all along", at(0))
    away = add_job(staff, "there", "a job that moved away from here", at(1))
    Job.objects.filter(pk=away.pk).update(request_id=f"job-{away.pk}-1", engines=[
        {"engine": "here", "at": at(1.1).isoformat(), "reason": "start"},
        {"engine": "there", "at": at(3).isoformat(), "reason": "migration"}])
    log(staff, "here", "migrate", at(2.9), target=f"job-{away.pk}-1", to="there")
    came = add_job(staff, "here", "a job that moved in from elsewhere", at(1.5))
    Job.objects.filter(pk=came.pk).update(engines=[
        {"engine": "there", "at": at(1.6).isoformat(), "reason": "start"},
        {"engine": "here", "at": at(4).isoformat(), "reason": "migration"}])

    trace = build_trace(engine, minutes=10, max_jobs=100)

    assert trace.job_ids == [stayed.pk, away.pk, came.pk]
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.0, 4.0]
    [leave] = trace.actions
    assert (leave.kind, leave.at_s, leave.request) == ("move-out", 3.0, 1)
    assert (trace.summary["moved_in"], trace.summary["moved_out"]) == (1, 1)
    assert trace.summary["not_replayed"] == []


def test_the_jobs_before_the_window_warm_it_up(people):
    """Jobs queued in as many minutes before the window's first job are the warm-up,
    built in the same token space; actions before the window are the warm-up's."""
    staff, _ = people
    engine = Engine.objects.create(name="warm", worker="engine-warm@test", config=SIM_CONFIG)
    now = timezone.now()
    early = add_job(staff, "warm", SYSTEM + "asked before the window", now - timedelta(seconds=85))
    add_job(staff, "warm", SYSTEM + "too early to matter", now - timedelta(seconds=200))
    log(staff, "warm", "evict", now - timedelta(seconds=80))
    first = add_job(staff, "warm", SYSTEM + "asked in the window", now - timedelta(seconds=30))

    trace = build_trace(engine, minutes=1, max_jobs=100)

    assert trace.job_ids == [first.pk] and trace.summary["warmup_jobs"] == 1
    warm = trace.warmup
    assert [r.arrival_s for r in warm.requests] == [0.0] and warm.lead_s == 55.0
    assert common(warm.prompts[0], trace.prompts[0]) == len(SYSTEM + "asked ")
    assert [(a.kind, a.at_s) for a in warm.actions] == [("evict", 5.0)]
    assert trace.actions == [] and early.pk not in trace.job_ids
