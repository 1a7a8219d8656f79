"""Tenants are sealed (the audit's attack, tried again on the running stack): a plain
user recovered a 4-digit code in another user's prompt from the block hashes every user
could see, computing the victim's chain under its guessable salt ("user-<id>"). Now the
salt is an HMAC of the server's key, and no hash of anyone's reaches a plain user: not
the REST snapshot, not the event history (REST or websocket), not the live frames, not
the timeline. Staff still see them, and the victim sees its own on its job."""
import asyncio
import json
import random
import time

import pytest
import requests
import websockets

from engine.observe.feed import decode
from kvops.intake.prompts import inspector
from tests.support.wait import wait_until_async

VICTIM_PASSWORD = "mauve-tractor-41-lake"


def _prompt(code: str) -> str:
    return f"Internal note for the deploy team. The vault code is {code}. Keep it safe!"


@pytest.fixture(scope="module")
def victim(stack):
    """Bob, a plain user, ran a job whose prompt holds a random code; it has ended and
    its blocks stay cached."""
    out = stack.manage("shell", "-c", "from django.contrib.auth.models import User; "
                       f"u = User.objects.create_user('bob', password='{VICTIM_PASSWORD}'); "
                       "print(u.pk)")
    bob_pk = int(out.split()[-1])
    stack.tokens["bob"] = stack.manage("drf_create_token", "bob").split()[2]
    code = f"{random.randrange(10_000):04d}"
    job = stack.api("POST", "/api/jobs/", user="bob", json={
        "prompt": _prompt(code), "max_tokens": 4, "engine": "sim"}).json()
    assert stack.wait_job(job["id"], user="bob")["status"] == "finished"
    return {"pk": bob_pk, "code": code, "job": job["id"]}


def _config(stack) -> dict:
    return stack.api("GET", "/api/engines/sim/").json()["engine"]["config"]


def _candidates(config: dict, salt: str | None) -> dict[str, set[str]]:
    """The attack: every code's hashes under a salt, of the blocks from the one holding
    the code on (those before it are every candidate's)."""
    first = _prompt("0000").index("0000") // int(config["block_size"])
    out = {}
    for n in range(10_000):
        code = f"{n:04d}"
        ids = inspector.token_ids(config, _prompt(code), None)
        out[code] = set(inspector.short_hashes(config, ids, salt)[first:])
    assert all(out.values())  # (the prompt is long enough)
    return out


def _event_hashes(events: list[dict]) -> set[str]:
    return {h for e in events for h in e.get("block_hashes") or [] if h}


def test_a_plain_user_sees_no_hash_anywhere(stack, victim):
    snapshot = stack.api("GET", "/api/engines/sim/", user="alice").json()["snapshot"]
    assert snapshot["sealed"] is True
    assert all("hash32" not in snapshot[pool] for pool in ("gpu", "cpu"))
    events = stack.api("GET", "/api/engines/sim/events/?limit=1000", user="alice").json()["events"]
    assert events and not _event_hashes(events)
    now = time.time()
    state = stack.api("GET", f"/api/engines/sim/timeline/state/?at={now}&through=window",
                      user="alice")
    assert state.status_code == 200, state.text
    state = state.json()
    assert "hash32" not in state["keyframe"]["gpu"]
    assert all("hash32" not in d.get("gpu", {}) for d in state["deltas"])
    # staff see them all (so the checks above can fail)
    full = stack.api("GET", "/api/engines/sim/", user="admin").json()["snapshot"]
    assert "hash32" in full["gpu"] and "sealed" not in full
    staff_events = stack.api("GET", "/api/engines/sim/events/?limit=1000").json()["events"]
    assert _event_hashes(staff_events)


def test_the_websocket_sends_a_plain_user_no_hash(stack, victim):
    session = requests.Session()
    session.get(f"{stack.url}/accounts/login/", timeout=10)
    assert session.post(f"{stack.url}/accounts/login/", timeout=10, allow_redirects=False,
                        headers={"Referer": stack.url},
                        data={"username": "alice", "password": "alice-pass-123",
                              "csrfmiddlewaretoken": session.cookies["csrftoken"]}
                        ).status_code == 302
    cookie = "; ".join(f"{k}={v}" for k, v in session.cookies.items())

    async def watch() -> tuple[dict, list[dict], list[dict]]:
        async with websockets.connect(f"ws://127.0.0.1:{stack.port}/ws/engines/sim/",
                                      origin=f"http://127.0.0.1:{stack.port}",
                                      additional_headers={"Cookie": cookie},
                                      max_size=2**24) as ws:
            await ws.send(json.dumps({"type": "subscribe", "level": "full"}))
            await ws.send(json.dumps({"type": "history", "what": "events", "count": 1000}))
            snapshot, deltas, history = None, [], None
            # a job of alice's makes deltas while we listen
            job = await asyncio.to_thread(stack.api, "POST", "/api/jobs/", user="alice",
                                          json={"prompt": _prompt("0000"), "max_tokens": 30})

            async def take_frame() -> tuple[bool, int, bool]:
                """The next frame kept; whether a snapshot came, how many deltas, the history."""
                nonlocal snapshot, history
                frame = await asyncio.wait_for(ws.recv(), 30)
                if isinstance(frame, bytes):
                    doc = decode(frame)
                    if doc["type"] == "snapshot":
                        snapshot = doc
                    else:
                        deltas.append(doc)
                elif json.loads(frame)["type"] == "history":
                    history = json.loads(frame)["items"]
                return snapshot is not None, len(deltas), history is not None

            await wait_until_async(take_frame, "a snapshot, 3 deltas and the history", 30,
                                   until=lambda seen: seen[0] and seen[1] >= 3 and seen[2],
                                   poll_s=0)
            await asyncio.to_thread(stack.wait_job, job.json()["id"])
            return snapshot, deltas, history

    snapshot, deltas, history = asyncio.run(watch())
    assert snapshot["sealed"] and "hash32" not in snapshot["gpu"]
    assert len(deltas) >= 3 and all(d["sealed"] for d in deltas)
    assert not any("hash32" in d.get(pool, {}) for d in deltas for pool in ("gpu", "cpu"))
    assert not _event_hashes([e for d in deltas for e in d.get("events", [])])
    assert history and not _event_hashes(history)
    # the tenant labels tell alice's requests from others', and say nothing of who: her
    # own label, and "others" for everyone else's
    labels = {r["tenant"] for d in [snapshot, *deltas]
              for r in d.get("requests", []) if isinstance(r, dict)}
    labels |= {r["tenant"] for d in deltas for r in d.get("requests", {}).get("upsert", [])}
    own = {label for label in labels if label != "others"}
    assert len(own) <= 1 and all(label is not None and len(label) == 16 for label in own), labels


def test_the_audits_attack_finds_nothing(stack, victim, settings):
    config = _config(stack)
    # Even with every hash staff see, the chain under the old guessable salt matches no code
    seen = _event_hashes(stack.api("GET", "/api/engines/sim/events/?limit=1000").json()["events"])
    assert seen
    guessed = _candidates(config, f"user-{victim['pk']}")
    assert [code for code, hashes in guessed.items() if hashes & seen] == []
    # (the hashes are there: under the real salt, which needs the server's key, the
    # victim's code is the one that matches)
    from kvops.routing import tenancy
    settings.SECRET_KEY = stack.env.get("DJANGO_SECRET_KEY") or \
        (stack.workdir / "secret_key").read_text().strip()  # the stack's
    settings.KVOPS_PREFIX_SHARING = "user"

    class Bob:
        pk, is_staff = victim["pk"], False

    real = _candidates(config, tenancy.cache_salt(Bob()))
    assert [code for code, hashes in real.items() if hashes & seen] == [victim["code"]]


def test_the_victim_sees_its_own_hashes_on_its_job(stack, victim):
    """While a job runs, its owner's `blocks` answer has its blocks' hashes."""
    job = stack.api("POST", "/api/jobs/", user="bob", json={
        "prompt": _prompt(victim["code"]) + " and more text to fill another block",
        "max_tokens": 400, "engine": "sim"}).json()
    request_id = stack.wait_running(job["id"], user="bob")
    session = requests.Session()
    session.get(f"{stack.url}/accounts/login/", timeout=10)
    session.post(f"{stack.url}/accounts/login/", timeout=10, allow_redirects=False,
                 headers={"Referer": stack.url},
                 data={"username": "bob", "password": VICTIM_PASSWORD,
                       "csrfmiddlewaretoken": session.cookies["csrftoken"]})
    cookie = "; ".join(f"{k}={v}" for k, v in session.cookies.items())

    async def blocks() -> dict:
        async with websockets.connect(f"ws://127.0.0.1:{stack.port}/ws/jobs/{job['id']}/",
                                      origin=f"http://127.0.0.1:{stack.port}",
                                      additional_headers={"Cookie": cookie}) as ws:
            await ws.send(json.dumps({"type": "blocks"}))

            async def next_message() -> dict:
                return json.loads(await asyncio.wait_for(ws.recv(), 30))

            message = await wait_until_async(
                next_message, "a 'blocks' message with the request's", 30, poll_s=0,
                until=lambda message: message["type"] == "blocks" and message.get("request"))
            return message["request"]

    try:
        entry = asyncio.run(blocks())
    finally:
        stack.api("POST", f"/api/jobs/{job['id']}/cancel/", user="bob")
    assert entry["request_id"] == request_id
    assert len(entry["block_hashes"]) == len(entry["block_table"]) >= 4
    assert all(h is None or len(h) == 8 for h in entry["block_hashes"])
    assert sum(h is not None for h in entry["block_hashes"]) >= 4  # its full blocks


@pytest.mark.django_db(transaction=True)
def test_a_plain_user_reads_no_address_or_path_of_an_engine(client):
    """GET /api/engines/ gave every user the engine's migration address, its disk tier's
    folder and its model's and tokenizer's paths. A plain user reads the sizes and
    policies and the model's name; staff read the whole config."""
    from django.contrib.auth.models import User

    from kvops.dashboard import visibility
    from kvops.engines.registry import register_engine
    secret = {"migration_address": "tcp://10.1.2.3:5599", "disk_cache_dir": "/srv/kv/disk",
              "model_path": "/srv/models/SmolLM2-135M", "kv_cache_scales": "/srv/scales.json",
              "tokenizer_path": "/srv/models/SmolLM2-135M", "kv_events_endpoint": "tcp://*:5557"}
    config = {"block_size": 16, "num_gpu_blocks": 64, "num_cpu_blocks": 0,
              "model": "/srv/models/SmolLM2-135M", "disk_cache_bytes": 1 << 30,
              "eviction_policy": "lru", **secret}
    register_engine("cfg", "w@h", "h", "i1", config, "s1")
    plain = User.objects.create_user("carol", password="mauve-tractor-41-lake")
    staff = User.objects.create_user("opal", password="mauve-tractor-41-lake", is_staff=True)

    def seen(user) -> list[str]:
        client.force_login(user)
        [listed] = client.get("/api/engines/").json()
        one = client.get("/api/engines/cfg/").json()["engine"]
        page = client.get("/engines/cfg/").content.decode()
        overview = client.get("/").content.decode()
        assert listed["config"] == one["config"]
        return [json.dumps(listed["config"]), page, overview]

    for text in seen(plain):
        for value in ("10.1.2.3", "/srv/", "5557"):
            assert value not in text, (value, text[:2000])
    client.force_login(plain)
    told = client.get("/api/engines/cfg/").json()["engine"]["config"]
    assert told["model"] == "SmolLM2-135M" and told["block_size"] == 16
    assert told["disk_cache_bytes"] == 1 << 30 and "disk_cache_dir" not in told
    assert set(told) <= set(visibility.PLAIN_CONFIG_FIELDS) | {"model"}
    listed, _, _ = seen(staff)
    assert json.loads(listed) == config
    # the snapshot (REST, websocket, timeline) carries the config too
    sealed = visibility.seal_document({"type": "snapshot", "config": config, "gpu": {}}, None)
    assert sealed["config"] == told


@pytest.mark.django_db(transaction=True)
def test_a_plain_user_reads_their_own_tenants_kv_and_others_added_up(client):
    """The engine's KV by tenant (its metrics: the REST API, the engine page, the
    overview): a plain user reads their own tenant's row and everyone else's added up,
    and no other tenant's label; staff read every label, and the engine page their users'
    names."""
    from django.contrib.auth.models import User

    from engine.kv.block_seconds import TenantKV
    from engine.observe.tenants import kv_by_tenant
    from kvops.engines.registry import heartbeat, register_engine
    from kvops.routing import tenancy

    carol = User.objects.create_user("carol", password="mauve-tractor-41-lake")
    dave = User.objects.create_user("dave", password="mauve-tractor-41-lake")
    staff = User.objects.create_user("opal", password="mauve-tractor-41-lake", is_staff=True)
    hers, his = tenancy.tenant(carol), tenancy.tenant(dave)
    meter = {hers: TenantKV(gpu=2, gpu_s=4.0), his: TenantKV(gpu=5, gpu_s=9.0),
             None: TenantKV(gpu=1, gpu_s=1.0)}
    register_engine("kvt", "w@h", "h", "i1", {"block_size": 16, "num_gpu_blocks": 64,
                                            "num_cpu_blocks": 0}, "s1")
    heartbeat("kvt", "i1", {"kv_by_tenant": kv_by_tenant(meter, {his: 3}, top=10)})

    def seen(user) -> tuple[dict, str]:
        client.force_login(user)
        [listed] = client.get("/api/engines/").json()
        assert client.get("/api/engines/kvt/").json()["engine"]["metrics"] == listed["metrics"]
        pages = client.get("/engines/kvt/").content.decode() + client.get("/").content.decode()
        return listed["metrics"]["kv_by_tenant"], pages

    by_tenant, pages = seen(carol)
    assert his not in json.dumps(by_tenant) and his not in pages
    assert [r["tenant"] for r in by_tenant["tenants"]] == [hers]
    assert by_tenant["other"]["gpu_blocks"] == 6 and by_tenant["other"]["cached_blocks"] == 3
    assert by_tenant["other"]["tenants"] is None  # (not even how many)
    by_tenant, pages = seen(staff)
    assert [r["tenant"] for r in by_tenant["tenants"]] == [his, hers, None]
    assert '"tenant_names"' in pages and '"dave"' in pages
