"""One deployment per Redis database: an engine name is claimed per stack on the Redis
database (kvops/engines/engine_claim.py), refused to another live stack, and a worker ignores
operator commands stamped with another stack's id. Against the test session's private
Redis and, for the commands, a real engine on the simulator in this process."""
import threading
import uuid

import pytest
import redis
from django.conf import settings
from django.test import override_settings

from engine import EngineConfig
from kvops import live
from kvops.worker import worker
from kvops.engines.engine_claim import CLAIM_KEY, EngineClaim, EngineNameTaken
from engine.serve.client import InprocClient
from kvops.stream.job_stream import StreamProducer
from kvops.worker.output_processor import OutputProcessor
from kvops.intake.prompts import tokenizer_for
from kvops.engines.stack_id import stack_id
from tests.support.wait import wait_until


@pytest.fixture()
def client():
    r = redis.Redis.from_url(settings.REDIS_URL)
    yield r
    r.close()


@pytest.fixture()
def name():
    """An engine name no other test claims."""
    return f"twin-{uuid.uuid4().hex[:8]}"


def claim(client, name, stack, host="host-1", ttl_s=15.0):
    return EngineClaim(client, name, stack, host, f"engine-{name}@{host}", ttl_s=ttl_s,
                       renew_s=min(2.0, ttl_s / 2))


def holder_stack(client, name) -> bytes | None:
    return client.hget(CLAIM_KEY.format(name=name), "stack")


def test_a_second_stack_is_refused_the_name_with_a_message_naming_both(client, name):
    first = claim(client, name, "stack-a", host="host-a")
    first.take()
    try:
        with pytest.raises(EngineNameTaken) as refused:
            claim(client, name, "stack-b", host="host-b").take()
        message = str(refused.value)
        assert "stack stack-a on host host-a" in message
        assert "stack stack-b on host host-b" in message
        assert name in message
        # the same stack on another host is another live instance too
        with pytest.raises(EngineNameTaken):
            claim(client, name, "stack-a", host="host-b").take()
        assert holder_stack(client, name) == b"stack-a"  # the refused took nothing
    finally:
        first.release()


def test_the_same_stack_restarting_on_its_host_takes_its_name_back(client, name):
    before = claim(client, name, "stack-a")
    before.take()  # a worker killed without releasing: its claim still live
    after = claim(client, name, "stack-a")
    after.take()
    try:
        assert client.hget(CLAIM_KEY.format(name=name), "token") == after.me.token.encode()
        before.release()  # the old run's release leaves the new run's claim alone
        assert holder_stack(client, name) == b"stack-a"
        with pytest.raises(EngineNameTaken):
            claim(client, name, "stack-b").take()
    finally:
        after.release()
    assert not client.exists(CLAIM_KEY.format(name=name))  # a clean stop frees it


def test_a_claim_whose_holder_died_is_taken_over_once_it_expires(client, name):
    key = CLAIM_KEY.format(name=name)
    # what a worker of stack-a left when it was killed: no renewal, no release
    client.hset(key, mapping={"stack": "stack-a", "host": "host-a", "token": "dead",
                              "worker": f"engine-{name}@host-a"})
    client.pexpire(key, 60_000)
    with pytest.raises(EngineNameTaken):
        claim(client, name, "stack-b").take()
    client.pexpire(key, 1)  # its lifetime runs out
    wait_until(lambda: client.exists(key), "Redis to drop the expired claim", 10,
               until=lambda exists: not exists)
    taker = claim(client, name, "stack-b")
    taker.take()
    try:
        assert holder_stack(client, name) == b"stack-b"
        assert client.pttl(key) > 0  # and it expires in turn, should stack-b die
    finally:
        taker.release()


def test_stacks_starting_at_once_let_one_in(client, name):
    stacks = [f"stack-{i}" for i in range(8)]
    start = threading.Barrier(len(stacks))
    taken, refused = [], []

    def start_worker(stack):
        attempt = claim(redis.Redis.from_url(settings.REDIS_URL), name, stack)
        start.wait()
        try:
            attempt.take()
            taken.append(attempt)
        except EngineNameTaken:
            refused.append(stack)

    threads = [threading.Thread(target=start_worker, args=(s,)) for s in stacks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(taken) == 1 and len(refused) == len(stacks) - 1
        assert holder_stack(client, name) == taken[0].me.stack.encode()
    finally:
        for attempt in taken:
            attempt.release()


@pytest.mark.django_db
def test_the_stack_id_is_the_databases_unless_set():
    first = stack_id()
    assert first and stack_id() == first  # every process of the deployment reads this row
    with override_settings(KVOPS_STACK_ID="set-by-env"):
        assert stack_id() == "set-by-env"


@pytest.fixture()
def engine_worker():
    """This process as an engine worker of stack `stack-a` (the core on a thread)."""
    config = EngineConfig(name="stack-a-engine", simulate=True, simulate_tokenizer="bytes",
                          vocab_size=1000, num_gpu_blocks=64, block_size=16,
                          simulate_step_ms=5)
    tokenizer = tokenizer_for(config)
    processor = OutputProcessor(config.name, StreamProducer(live.redis_client(), config.name),
                                tokenizer, lambda request_id: client.finish_request(request_id))
    client = InprocClient(config, processor)
    client.start()
    before = worker.install(worker.WorkerContext(client, processor, "stack-a"))
    try:
        yield client
    finally:
        worker.install(before).close()


def test_a_command_of_another_stack_is_ignored_and_logged(engine_worker, caplog):
    change = {"eviction_policy": "lfu"}
    for stack in ("stack-b", None):  # another deployment's, and one with no stack id
        with caplog.at_level("WARNING", logger="kvops.worker.worker"):
            assert worker.kvops_engine(None, "retention", change, stack=stack) is None
        assert f"from stack {stack!r}" in caplog.text and "'stack-a'" in caplog.text
        caplog.clear()
    assert engine_worker.command("metrics", {})["eviction_policy"] == "lru"  # nothing done
    mine = worker.kvops_engine(None, "retention", change, stack="stack-a")
    assert mine["ok"], mine
    assert engine_worker.command("metrics", {})["eviction_policy"] == "lfu"
