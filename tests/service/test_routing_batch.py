"""Routing a batch of jobs at once (kvops/routing/routing.py: choose_queues): engines, load and
the prefix index read once for the batch, and each job seeing the ones routed before
it, so that a batch decides exactly as the same jobs routed one by one would."""
import uuid

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from engine import EngineConfig, LLMEngine
from kvops import live, selectors
from kvops.routing import prefix_index
from kvops.models import Engine, Job
from kvops.routing.routing import PENDING_KEY, choose_queues

pytestmark = pytest.mark.django_db

BLOCK = 4
SYSTEM_A = "Alpha: answer in French, briefly. "
SYSTEM_B = "Beta: you review this code. "


@pytest.fixture
def engines(settings):
    """Two live simulated engines, idle, with names of their own (their Redis keys are
    this test's); removed from Redis afterwards."""
    settings.KVOPS_ROUTING = "prefix"
    config = LLMEngine(EngineConfig(simulate=True, simulate_tokenizer="bytes",
                                    vocab_size=32000, block_size=BLOCK,
                                    num_gpu_blocks=64)).describe_config()
    tag = uuid.uuid4().hex[:6]
    names = [f"a-{tag}", f"b-{tag}"]
    for name in names:
        Engine.objects.create(name=name, worker=f"engine-{name}@test", config=config,
                              status=Engine.Status.READY, last_heartbeat=timezone.now(),
                              metrics={"running_tokens": 0, "waiting_tokens": 0})
    selectors.forget_recent_engines()
    yield names
    reset(names)
    selectors.forget_recent_engines()


def reset(names):
    redis = live.redis_client()
    for name in names:
        redis.delete(prefix_index.INDEX_KEY.format(engine=name),
                     prefix_index.CPU_INDEX_KEY.format(engine=name),
                     PENDING_KEY.format(engine=name))


def burst(owner, engine_names):
    """Jobs of two shared prefixes, interleaved, a cold one and one naming an engine."""
    prompts = [SYSTEM_A + "q1", SYSTEM_B + "q2", SYSTEM_A + "q3", "cold, nothing shared",
               SYSTEM_B + "q5", SYSTEM_A + "q6"]
    jobs = [Job(owner=owner, prompt=p, params={}) for p in prompts]
    jobs.insert(3, Job(owner=owner, prompt=SYSTEM_B + "named", params={},
                       requested_engine=engine_names[0]))
    return jobs


def test_a_burst_follows_its_prefixes_as_one_by_one_routing_would(engines):
    owner = User.objects.create_user("carol")
    together = choose_queues(burst(owner, engines))
    redis = live.redis_client()
    pending = [int(redis.get(PENDING_KEY.format(engine=n)) or 0) for n in engines]
    index = [redis.smembers(prefix_index.INDEX_KEY.format(engine=n)) for n in engines]
    reset(engines)
    one_by_one = [choose_queues([job])[0] for job in burst(owner, engines)]

    assert together == one_by_one
    assert [int(redis.get(PENDING_KEY.format(engine=n)) or 0) for n in engines] == pending
    assert [redis.smembers(prefix_index.INDEX_KEY.format(engine=n)) for n in engines] == index

    decided = [d for _, d in together]
    named = decided[3]
    assert (named["policy"], named["engine"], named["reason"]) == (
        "requested", engines[0], "the job named its engine")
    # the router looked all the same: what each engine held of its prefix (B's, cached
    # by the job before it), for its KV story
    assert set(named["cached_blocks"]) == set(engines)
    assert max(named["cached_blocks"].values()) > 0
    a_jobs, b_jobs = [decided[i] for i in (0, 2, 6)], [decided[i] for i in (1, 5)]
    home_a, home_b = a_jobs[0]["engine"], b_jobs[0]["engine"]
    assert home_a != home_b  # B's first job found A's engine loaded by A's first
    assert all(d["engine"] == home_a for d in a_jobs)
    assert all(d["engine"] == home_b for d in b_jobs)
    shared_blocks = len(SYSTEM_A) // BLOCK
    for d in a_jobs[1:]:
        assert d["cached_blocks"][home_a] >= shared_blocks
        assert d["reason"].startswith("holds the longest cached prefix")
    assert a_jobs[0]["reason"] == "no engine holds a prefix of it: least loaded"
    assert decided[1]["load_tokens"][home_a] > 0 == decided[1]["load_tokens"][home_b]
    # What the batch recorded: each job's full blocks as load (a job with none counts
    # 1 token), and its prefix as cached, on the engine it went to (the one it named,
    # for a job that named one).
    chains = [prefix_index_chain(engines, job.prompt, owner) for job in burst(owner, engines)]
    assert sum(pending) == sum(max(1, len(c) * BLOCK) for c in chains)
    held = {name: {h.decode() for h in members} for name, members in zip(engines, index)}
    for chain, d in zip(chains, decided):
        assert set(chain) <= held[d["engine"]]
    assert held[home_a] | held[home_b] == set().union(*map(set, chains))


def prefix_index_chain(engines, prompt, owner):
    from kvops.intake.prompts import inspector
    from kvops.routing.tenancy import cache_salt
    config = Engine.objects.get(name=engines[0]).config
    return inspector.short_hashes(config, inspector.token_ids(config, prompt, None),
                                  cache_salt(owner))


def test_round_robin_gives_a_batch_consecutive_turns(engines, settings):
    settings.KVOPS_ROUTING = "round-robin"
    owner = User.objects.create_user("dave")
    jobs = [Job(owner=owner, prompt=f"job {i}", params={}) for i in range(5)]
    turns = [int(d["reason"].split()[1]) for _, d in choose_queues(jobs)]
    assert turns == list(range(turns[0], turns[0] + 5))
    chosen = [d["engine"] for _, d in choose_queues(jobs[:2])]
    assert chosen[0] != chosen[1]
