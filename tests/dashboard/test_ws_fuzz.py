"""Whatever a client sends over the websockets, the consumer answers it (an error that
says what was wrong, or the message's answer), leaks no exception and stays connected
and usable. Hypothesis makes up the frames: arbitrary JSON, messages that are almost
right, text that is not JSON, binary frames; floods are closed with 4429."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvops.dashboard.consumers import CLOSE_FLOODING, ENGINE_MESSAGES, JOB_MESSAGES, MESSAGE_BURST
from kvops.models import Job
from tests.dashboard.wsclient import connect, receive

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
# What a consumer may send without being asked (answers to earlier messages, live data).
UNASKED = {"snapshot", "delta", "summary", "blocks", "job", "history", "subscribed"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
field_values = (json_values | st.sampled_from(["full", "summary", "events", "metrics"])
                | st.integers(-2, 1002) | st.sampled_from([10**30, -10**30, 1e308, -0.0, 1.5]))


def near_misses(schema: dict):
    """Objects with one of our types (or not quite) and fields that may or may not fit."""
    names = sorted({f for fields in schema.values() for f in fields} | {"x", "Type", ""})
    return st.builds(
        lambda kind, fields: {"type": kind, **fields},
        st.sampled_from(sorted(schema)) | json_values,
        st.dictionaries(st.sampled_from(names), field_values, max_size=3))


def frames(schema: dict):
    """(text, bytes): one websocket frame, either kind."""
    texts = st.one_of(
        json_values.map(json.dumps),
        near_misses(schema).map(json.dumps),
        st.text(max_size=60),
        st.integers(1, 1100).map(lambda n: "[" * n),  # nesting, not closed
        st.integers(1, 400).map(lambda n: '{"type":' * n + '"ping"' + "}" * n),
        st.integers(1025, 5000).map(lambda n: json.dumps({"type": "ping", "pad": "x" * n})),
        st.sampled_from(['{"type": "ping"', "\ud800", '{"type": "\udfff"}', "NaN", "",
                         '{"type": "ping", "type": "resync"}', '{"__proto__": 1}']),
    )
    return texts.map(lambda t: (t, None)) | st.binary(max_size=64).map(lambda b: (None, b))


def valid(text: str | None, schema: dict) -> bool:
    """The same rules as kvops.dashboard.consumers.parse_message, written out again."""
    try:
        content = json.loads(text) if text is not None and len(text) <= 1024 else None
    except (ValueError, RecursionError):
        return False
    if not isinstance(content, dict) or not isinstance(content.get("type"), str):
        return False
    fields = schema.get(content["type"])
    if fields is None or set(content) != {"type", *fields}:
        return False
    for name, allowed in fields.items():
        value = content[name]
        if isinstance(allowed, tuple) and not (isinstance(value, str) and value in allowed):
            return False
        if isinstance(allowed, range) and not (type(value) is int and value in allowed):
            return False
    return True


async def answers_until_pong(comm, pongs: int = 1) -> list[dict]:
    """Send a ping; every frame before its pong (the `pongs`-th one), checked well-formed."""
    await comm.send_json_to({"type": "ping"})
    seen = []
    while True:
        message = await receive(comm, timeout=5)
        assert isinstance(message, dict) and isinstance(message.get("type"), str), message
        if message["type"] == "pong":
            pongs -= 1
            if pongs == 0:
                return seen
        elif message["type"] == "error":
            assert isinstance(message["message"], str) and 0 < len(message["message"]) < 300
        else:
            assert message["type"] in UNASKED, message
        seen.append(message)


async def send_frame(comm, text: str | None, data: bytes | None) -> None:
    # Not comm.send_to: it cannot send an empty frame.
    frame = {"text": text} if text is not None else {"bytes": data}
    await comm.send_input({"type": "websocket.receive", **frame})


async def check_frames(comm, schema: dict, sent: list) -> None:
    level = None  # the consumer's subscription
    for text, data in sent:
        await send_frame(comm, text, data)
        if not valid(text, schema):
            answers = await answers_until_pong(comm)
            assert [m["type"] for m in answers].count("error") == 1, (text, data, answers)
            continue
        message = json.loads(text)
        answers = await answers_until_pong(comm, pongs=2 if message["type"] == "ping" else 1)
        errors = [m["message"] for m in answers if m["type"] == "error"]
        level = message.get("level", level)
        if message["type"] == "resync" and level != "full":
            assert errors == ["resync: subscribe to level `full` first"], (text, answers)
        elif message["type"] == "blocks" and errors:  # a block-table query at most every 0.25 s
            assert errors == ["blocks: too many; at most one every 0.25 s"], (text, answers)
        else:
            assert not errors, (text, answers)


@FUZZ
@given(sent=st.lists(frames(ENGINE_MESSAGES), min_size=1, max_size=12))
async def test_engine_consumer_answers_anything(users, engine_setup, monkeypatch, sent):
    monkeypatch.setattr("kvops.dashboard.consumers.MESSAGES_PER_S", 1e6)  # no flood here
    comm, ok, _ = await connect(f"/ws/engines/{engine_setup[0]}/", users[1])
    assert ok and (await receive(comm))["type"] == "hello"
    await check_frames(comm, ENGINE_MESSAGES, sent)
    await comm.disconnect()


@pytest.fixture
def job(users, engine_setup):
    name, engine, publisher, churn = engine_setup
    return Job.objects.create(owner=users[1], prompt="x", engine=name, request_id="r1",
                              status="running")


@FUZZ
@given(sent=st.lists(frames(JOB_MESSAGES), min_size=1, max_size=12))
async def test_job_consumer_answers_anything(users, job, monkeypatch, sent):
    monkeypatch.setattr("kvops.dashboard.consumers.MESSAGES_PER_S", 1e6)
    comm, ok, _ = await connect(f"/ws/jobs/{job.pk}/", users[1])
    assert ok and (await receive(comm))["type"] == "job"
    await check_frames(comm, JOB_MESSAGES, sent)
    await comm.disconnect()


async def test_huge_frames_are_refused_without_reading_them(users, engine_setup):
    comm, ok, _ = await connect(f"/ws/engines/{engine_setup[0]}/", users[1])
    await receive(comm)
    await comm.send_to(text_data='{"type": "ping", "pad": "' + "x" * 10_000_000 + '"}')
    assert "at most 1024 characters" in (await receive(comm))["message"]
    await comm.send_to(bytes_data=b"\xff" * 1_000_000)
    assert "text frames" in (await receive(comm))["message"]
    assert await answers_until_pong(comm) == []
    await comm.disconnect()


async def test_a_flood_is_answered_then_closed(users, engine_setup, monkeypatch):
    """Without refills (rate 0) the count is exact whatever the machine's pace: a busy CI
    that takes 0.1 s between two pings would otherwise earn a token, and reset the count."""
    monkeypatch.setattr("kvops.dashboard.consumers.MESSAGES_PER_S", 0.0)
    comm, ok, _ = await connect(f"/ws/engines/{engine_setup[0]}/", users[1])
    await receive(comm)
    for _ in range(MESSAGE_BURST + 5):
        await comm.send_json_to({"type": "ping"})
    answers = [(await receive(comm))["type"] for _ in range(MESSAGE_BURST + 5)]
    assert answers.count("pong") == MESSAGE_BURST and answers.count("error") == 5, answers
    for _ in range(200):  # far over the budget, without pause
        await comm.send_json_to({"type": "ping"})
    while True:
        out = await comm.receive_output(5)
        if out["type"] == "websocket.close":
            assert out["code"] == CLOSE_FLOODING
            break
