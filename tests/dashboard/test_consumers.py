"""Websocket consumers against the real channel layer (the tests' private Redis) and an
in-process engine publisher: who may connect, what clients may say, snapshot then
deltas in sequence, resync after a gap, history, job streams."""
import asyncio
import uuid

import numpy as np
import pytest
from django.contrib.auth.models import AnonymousUser

from engine import SamplingParams
from engine.observe.tenants import tenant32
from kvops import live
from kvops.dashboard import visibility
from kvops.dashboard.consumers import CLOSE_NOT_FOUND, CLOSE_NOT_LOGGED_IN
from kvops.stream.job_stream import StreamProducer
from kvops.models import Engine, Job
from kvops.routing import tenancy
from tests.dashboard.churn import churn_engine
from tests.dashboard.live_client import ARRAYS, LiveState, SequenceGap
from tests.dashboard.wsclient import connect, receive, receive_type, settle
from tests.support.wait import wait_until, wait_until_async

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


def assert_matches_engine(client: LiveState, engine) -> None:
    """The client's state is the engine's; a plain user's (sealed) without the hashes, and
    its requests and cached blocks (none of them the viewer's) without their tenants."""
    truth = LiveState(engine.snapshot(compact=True) | {"seq": client.seq, "epoch": client.epoch})
    for pool in ("gpu", "cpu"):
        for k in ARRAYS:
            if k == "hash32" and client.sealed:
                assert not client.arrays(pool)[k].any() and truth.arrays(pool)[k].any() \
                    or pool == "cpu", (pool, k)
                continue
            expected = truth.arrays(pool)[k]
            if k == "tenant32" and client.sealed:  # (the churn's tenants are not the viewer's)
                assert expected.any() or pool == "cpu"
                expected = np.where(expected == 0, 0, tenant32(visibility.OTHERS))
            assert (client.arrays(pool)[k] == expected).all(), (pool, k)
    if client.sealed:
        truth.requests = {i: {**r, "tenant": visibility.OTHERS} for i, r in truth.requests.items()}
    assert client.request_list() == truth.request_list()


async def test_anonymous_users_are_refused(users, engine_setup):
    name = engine_setup[0]
    for path in (f"/ws/engines/{name}/", "/ws/jobs/1/"):
        comm, ok, code = await connect(path, AnonymousUser())
        assert not ok and code == CLOSE_NOT_LOGGED_IN


async def test_unknown_engines_and_jobs_are_refused(users):
    op, alice, bob = users
    comm, ok, code = await connect("/ws/engines/nope/", op)
    assert not ok and code == CLOSE_NOT_FOUND
    job = await asyncio.to_thread(lambda: Job.objects.create(owner=alice, prompt="x"))
    comm, ok, code = await connect(f"/ws/jobs/{job.pk}/", bob)  # not his
    assert not ok and code == CLOSE_NOT_FOUND
    comm, ok, code = await connect(f"/ws/jobs/{job.pk + 1000}/", op)
    assert not ok and code == CLOSE_NOT_FOUND


@pytest.mark.parametrize("raw, says", [
    ("not json", "JSON object"), ("[1]", "JSON object"), ('{"type": "explode"}', "unknown message"),
    ('{"type": "subscribe"}', "`level` is required"),
    ('{"type": "subscribe", "level": "all"}', "full, summary"),
    ('{"type": "subscribe", "level": "full", "x": 1}', "unknown field"),
    ('{"type": "history", "what": "events", "count": 0}', "[1, 1000]"),
    ('{"type": "history", "what": "events", "count": true}', "[1, 1000]"),
    ('{"type": "resync"}', "subscribe to level `full` first"),
    ('{"type": "ping", "pad": "' + "x" * 2000 + '"}', "at most"),
])
async def test_client_messages_are_checked(users, engine_setup, raw, says):
    comm, ok, _ = await connect(f"/ws/engines/{engine_setup[0]}/", users[0])
    assert ok
    assert (await receive(comm))["type"] == "hello"
    await comm.send_to(text_data=raw)
    error = await receive(comm)
    assert error["type"] == "error" and says in error["message"], error
    await comm.send_to(bytes_data=b"\x00")
    assert "text frames" in (await receive(comm))["message"]
    await comm.send_json_to({"type": "ping"})
    assert (await receive(comm))["type"] == "pong"  # still connected and answering
    await comm.disconnect()


async def test_snapshot_then_deltas_in_sequence_then_resync_after_a_gap(users, engine_setup):
    name, engine, publisher, churn = engine_setup
    comm, ok, _ = await connect(f"/ws/engines/{name}/", users[1])  # any logged-in user
    assert ok
    hello = await receive(comm)
    assert hello["engine"] == name and hello["operator"] is False
    await comm.send_json_to({"type": "subscribe", "level": "full"})
    snapshot = await receive_type(comm, "snapshot")
    assert snapshot["_binary"] and snapshot["engine"] == name
    client = LiveState(snapshot)
    seqs = []
    for _ in range(25):
        churn()
        await settle(publisher, engine)
        delta = await receive(comm)
        if delta["seq"] <= client.seq:
            continue  # sent before the snapshot was taken
        client.apply(delta)
        seqs.append(delta["seq"])
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and len(seqs) >= 20
    assert_matches_engine(client, engine)

    churn()
    await settle(publisher, engine)
    lost = await receive(comm)  # the network "loses" this one
    churn()
    await settle(publisher, engine)
    with pytest.raises(SequenceGap):
        client.apply(await receive(comm))
    await comm.send_json_to({"type": "resync"})
    snapshot = await receive_type(comm, "snapshot")
    assert snapshot["seq"] > lost["seq"]
    client = LiveState(snapshot)
    for _ in range(5):
        churn()
        final = await settle(publisher, engine)
    while client.seq < final:
        delta = await receive(comm)
        if delta["seq"] > client.seq:
            client.apply(delta)
    assert_matches_engine(client, engine)
    await comm.disconnect()


async def test_event_history_and_summary(users, engine_setup):
    name, engine, publisher, churn = engine_setup
    comm, ok, _ = await connect(f"/ws/engines/{name}/", users[0])
    await receive(comm)
    await comm.send_json_to({"type": "history", "what": "events", "count": 50})
    history = await receive_type(comm, "history")
    assert history["what"] == "events" and 0 < len(history["items"]) <= 50
    assert {"type", "step", "ts", "block_ids", "num_blocks"} <= set(history["items"][0])
    await comm.send_json_to({"type": "subscribe", "level": "summary"})
    assert (await receive_type(comm, "subscribed"))["level"] == "summary"
    churn()
    publisher.publisher._due["summary"] = 0  # the next capture sends one
    await settle(publisher, engine)
    summary = await receive_type(comm, "summary")
    assert summary["engine"] == name and "kv_usage" in summary["metrics"]
    await comm.send_json_to({"type": "history", "what": "metrics", "count": 10})
    metrics = await receive_type(comm, "history")
    assert metrics["items"] and "kv_usage" in metrics["items"][-1]
    await comm.disconnect()


async def test_a_stopped_engine_serves_its_stored_snapshot_marked_stale(users, monkeypatch):
    name = f"gone{uuid.uuid4().hex[:6]}"
    await asyncio.to_thread(lambda: Engine.objects.create(name=name, worker="w", status="dead"))
    engine = churn_engine(name=name)
    await asyncio.to_thread(live.store_snapshot, name, engine.snapshot(compact=True))
    monkeypatch.setattr("kvops.dashboard.consumers.SNAPSHOT_WAIT_S", 0.2)
    comm, ok, _ = await connect(f"/ws/engines/{name}/", users[0])
    assert (await receive(comm))["alive"] is False
    await comm.send_json_to({"type": "subscribe", "level": "full"})
    snapshot = await receive_type(comm, "snapshot")
    assert snapshot["stale"] is True and snapshot["engine"] == name
    await comm.disconnect()


async def test_job_stream_and_block_table(users, engine_setup, monkeypatch):
    # A window no busy machine can outlast between the two queries below (the check
    # is that a second query inside it is refused, whatever the timing).
    monkeypatch.setattr("kvops.dashboard.consumers.MIN_QUERY_INTERVAL_S", 3600.0)
    name, engine, publisher, churn = engine_setup
    op, alice, bob = users
    engine.add_request("job-7-1", list(range(30)), SamplingParams(max_tokens=200), job_id="7")
    job = await asyncio.to_thread(lambda: Job.objects.create(
        owner=alice, prompt="x", engine=name, request_id="job-7-1", status="running"))
    comm, ok, _ = await connect(f"/ws/jobs/{job.pk}/", alice)
    assert ok
    first = await receive(comm)
    assert first["type"] == "job" and first["status"] == "running"
    producer = StreamProducer(live.redis_client(), name)
    await asyncio.to_thread(producer.send, [
        {"job": job.pk, "attempt": 0, "offset": 0, "text": "hello", "n": 2}])
    update = await receive(comm)
    assert update["type"] == "job" and update["text"] == "hello"
    assert update["num_output_tokens"] == 2
    engine.step()
    await settle(publisher, engine)
    await comm.send_json_to({"type": "blocks"})
    blocks = await receive_type(comm, "blocks")
    assert blocks["request_id"] == "job-7-1" and blocks["block_size"] == 4
    assert blocks["request"]["block_table"] == engine.kv.block_ids("job-7-1") != []
    await comm.send_json_to({"type": "blocks"})  # too soon after the last
    assert "too many" in (await receive(comm))["message"]
    await comm.disconnect()


async def block_answer(comm, publisher, engine, pool: str, block_id: int) -> dict:
    """Ask about a block and wait for the answer, calling the engine's hook meanwhile (the
    engine answers between two steps, when its loop calls the feed)."""
    async def loop_hook() -> None:
        while True:
            publisher(engine)
            await asyncio.sleep(0.01)

    hook = asyncio.ensure_future(loop_hook())
    try:
        await comm.send_json_to({"type": "block", "pool": pool, "id": block_id})
        return await receive_type(comm, "block")
    finally:
        hook.cancel()


async def test_a_block_question_gives_the_text_of_a_holders_tokens_to_its_owner_and_staff(
        users, engine_setup):
    name, engine, publisher, churn = engine_setup
    op, alice, bob = users
    prompt = list(range(500, 540))
    for rid, owner in (("mine", alice), ("theirs", bob)):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=50), job_id=rid,
                           tenant=tenancy.tenant(owner))
    engine.step()
    await settle(publisher, engine)
    shared = engine.kv.block_ids("mine")[2]
    assert engine.kv.block_ids("theirs")[2] == shared
    texts, tenants = {}, {}
    for user in (alice, op):
        comm, ok, _ = await connect(f"/ws/engines/{name}/", user)
        assert ok
        answer = await block_answer(comm, publisher, engine, "gpu", shared)
        assert answer["id"] == shared and answer["error"] is None
        holders = {h["request_id"]: h for h in answer["facts"]["holders"]}
        assert holders["mine"]["tokens"] == holders["theirs"]["tokens"] == [8, 12]
        texts[user.username] = {rid: h["text"] for rid, h in holders.items()}
        tenants[user.username] = {rid: h["tenant"] for rid, h in holders.items()}
        await comm.disconnect()
    assert texts["alice"]["mine"] and texts["alice"]["theirs"] is None  # not hers
    assert tenants["alice"] == {"mine": tenancy.tenant(alice), "theirs": visibility.OTHERS}
    assert tenants["op"]["theirs"] == tenancy.tenant(bob)
    assert texts["op"]["mine"] == texts["op"]["theirs"] == texts["alice"]["mine"]


# --- Redis trouble: the channel layer's group memberships are lost, or Redis is away -----
def group_key(group: str) -> str:
    return f"asgi:group:{group}"  # channels-redis: its prefix, then the group


async def subscribed_full(name: str, user) -> tuple:
    comm, ok, _ = await connect(f"/ws/engines/{name}/", user)
    assert ok
    await receive_type(comm, "hello")
    await comm.send_json_to({"type": "subscribe", "level": "full"})
    return comm, LiveState(await receive_type(comm, "snapshot"))


async def next_delta_applied(comm, client: LiveState, publisher, engine, churn) -> None:
    """Churn until a delta reaches the client; it resyncs if it missed some."""
    for _ in range(5):
        churn()
        await settle(publisher, engine)
    delta = await receive_type(comm, "delta", timeout=5)
    if delta["seq"] != client.seq + 1:
        await comm.send_json_to({"type": "resync"})
        client.__init__(await receive_type(comm, "snapshot"))
        return
    client.apply(delta)


async def test_a_consumer_joins_its_group_again_after_losing_it(users, engine_setup, monkeypatch):
    """Lost memberships say nothing (a Redis restart or failover, a FLUSHALL, expiry):
    consumers add themselves again every REJOIN_S."""
    monkeypatch.setattr("kvops.dashboard.consumers.REJOIN_S", 0.2)
    name, engine, publisher, churn = engine_setup
    comm, client = await subscribed_full(name, users[1])
    key = group_key(live.engine_group(name))
    await asyncio.to_thread(live.redis_client().delete, key)
    await wait_until_async(lambda: asyncio.to_thread(live.redis_client().exists, key),
                           "the consumer to join its group again", 10, poll_s=0.025)
    await next_delta_applied(comm, client, publisher, engine, churn)
    await comm.disconnect()


async def test_the_websocket_outlives_a_failing_channel_layer(users, engine_setup, monkeypatch):
    """While Redis is away the channel layer's receive raises; the consumer keeps the
    websocket open, and once receiving works again it joins its group again at once."""
    import redis
    from channels.layers import get_channel_layer

    monkeypatch.setattr("kvops.dashboard.consumers.RETRY_MIN_S", 0.05)
    name, engine, publisher, churn = engine_setup
    comm, client = await subscribed_full(name, users[1])
    layer, failures = get_channel_layer(), [0]
    real_receive = layer.receive

    async def flaky_receive(channel: str) -> dict:
        if failures[0] > 0:
            failures[0] -= 1
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return await real_receive(channel)

    monkeypatch.setattr(layer, "receive", flaky_receive)
    failures[0] = 4
    key = group_key(live.engine_group(name))
    (channel,) = await asyncio.to_thread(live.redis_client().zrange, key, 0, -1)
    await asyncio.to_thread(live.redis_client().delete, key)  # Redis "restarted"
    await layer.send(channel.decode(), {"type": "engine.summary"})  # ends the pending receive
    await comm.send_json_to({"type": "ping"})
    assert (await receive_type(comm, "pong"))["type"] == "pong"
    await asyncio.to_thread(wait_until, lambda: failures[0], "the failures used up", 10,
                            until=lambda left: left == 0)
    await next_delta_applied(comm, client, publisher, engine, churn)
    await comm.disconnect()


async def test_a_resync_waits_for_its_group(users, engine_setup, monkeypatch):
    """A resync whose re-join fails (Redis still away) is refused with a message and no
    snapshot: a snapshot that no delta would follow is worse than asking again."""
    import redis
    from channels.layers import get_channel_layer

    name, engine, publisher, churn = engine_setup
    comm, client = await subscribed_full(name, users[1])
    layer = get_channel_layer()
    real_group_add, failures = layer.group_add, [1]

    async def flaky_group_add(group: str, channel: str) -> None:
        if failures[0] > 0:
            failures[0] -= 1
            raise redis.exceptions.ConnectionError("Connection refused.")
        await real_group_add(group, channel)

    monkeypatch.setattr(layer, "group_add", flaky_group_add)
    key = group_key(live.engine_group(name))
    await asyncio.to_thread(live.redis_client().delete, key)  # Redis "restarted"
    await comm.send_json_to({"type": "resync"})
    error = await receive_type(comm, "error")
    assert "unreachable" in error["message"], error
    assert await comm.receive_nothing(timeout=1.0)  # no snapshot was asked for
    assert not await asyncio.to_thread(live.redis_client().exists, key)
    await comm.send_json_to({"type": "resync"})  # Redis is back
    client = LiveState(await receive_type(comm, "snapshot"))
    assert await asyncio.to_thread(live.redis_client().exists, key)
    await next_delta_applied(comm, client, publisher, engine, churn)
    await comm.disconnect()


async def test_redis_errors_are_answered(users, engine_setup, monkeypatch):
    import redis

    def down(*args) -> None:
        raise redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:1.")

    monkeypatch.setattr(live, "post_engine_query", down)
    monkeypatch.setattr(live, "recent_events", down)
    comm, ok, _ = await connect(f"/ws/engines/{engine_setup[0]}/", users[0])
    await receive_type(comm, "hello")
    await comm.send_json_to({"type": "history", "what": "events", "count": 5})
    error = await receive(comm)
    assert error["type"] == "error" and "Redis: Error 111" in error["message"], error
    await comm.send_json_to({"type": "subscribe", "level": "full"})
    await receive_type(comm, "subscribed")
    error = await receive(comm)  # the snapshot could not be asked for
    assert error["type"] == "error" and "unavailable" in error["message"], error
    await comm.send_json_to({"type": "ping"})
    assert (await receive(comm))["type"] == "pong"
    await comm.disconnect()


async def test_an_idle_consumer_stays_connected(users, engine_setup):
    """channels-redis blocks 5 s in BZPOPMIN, redis-py's read times out after 5 s too: a
    consumer that hears nothing for that long gets a TimeoutError, and must not end."""
    name, engine, publisher, churn = engine_setup
    job = await asyncio.to_thread(lambda: Job.objects.create(
        owner=users[1], prompt="x", engine=name, request_id="r1", status="running"))
    comm, ok, _ = await connect(f"/ws/jobs/{job.pk}/", users[1])
    assert (await receive(comm))["type"] == "job"
    await asyncio.sleep(6.5)
    await comm.send_json_to({"type": "ping"})
    assert (await receive(comm))["type"] == "pong"
    producer = StreamProducer(live.redis_client(), name)
    await asyncio.to_thread(producer.send, [
        {"job": job.pk, "attempt": 0, "offset": 0, "text": "late", "n": 1}])
    assert (await receive(comm))["text"] == "late"
    await comm.disconnect()


async def test_a_plain_user_sees_their_own_tenant_and_no_other_tenants_label(users, engine_setup):
    name, engine, publisher, churn = engine_setup
    op, alice, bob = users
    for rid, owner in (("hers", alice), ("his", bob)):
        engine.add_request(rid, list(range(700, 740)), SamplingParams(max_tokens=50), job_id=rid,
                           tenant=tenancy.tenant(owner))
    engine.step()
    await settle(publisher, engine)
    metrics = engine.metrics()  # (as a heartbeat writes them: the hello carries them)
    await asyncio.to_thread(lambda: Engine.objects.filter(name=name).update(metrics=metrics))
    frames = {}
    for user in (alice, op):
        comm, ok, _ = await connect(f"/ws/engines/{name}/", user)
        assert ok
        hello = await receive_type(comm, "hello")
        await comm.send_json_to({"type": "subscribe", "level": "full"})
        snapshot = await receive_type(comm, "snapshot")
        churn()
        await settle(publisher, engine)
        delta = await receive_type(comm, "delta", timeout=5)
        frames[user.username] = (hello, snapshot, delta)
        await comm.disconnect()
    his, hers = tenancy.tenant(bob), tenancy.tenant(alice)
    for frame in frames["alice"]:  # the hello, the snapshot, a delta
        assert his not in repr(frame)  # nowhere: rows, metrics, anything
        by_tenant = frame["metrics"]["kv_by_tenant"]
        assert [r["tenant"] for r in by_tenant["tenants"]] == [hers]
        assert by_tenant["other"]["gpu_blocks"] > 0 and by_tenant["other"]["tenants"] is None
    rows = {r["request_id"]: r["tenant"] for r in frames["alice"][1]["requests"]}
    assert rows["hers"] == hers and rows["his"] == visibility.OTHERS
    for frame in frames["op"]:  # staff see every label (so the checks above can fail)
        assert {hers, his} <= {r["tenant"] for r in frame["metrics"]["kv_by_tenant"]["tenants"]}
