"""The engine's wire format (engine/wire.py): every message round-trips through its codec;
anything else (no msgpack, a field of the wrong type, one missing or extra, an unknown
kind, over the size limit) is a MalformedMessage before anything acts on it, and the core,
its client and the migration link go on serving after one."""
from __future__ import annotations

import dataclasses
import time
import typing
from concurrent.futures import Future

import msgpack
import pytest
import zmq

from engine import EngineConfig, wire
from engine.errors import InvalidRequestError, MalformedMessage, error_from_wire
from engine.outputs import CoreOutput
from engine.serve.client import InprocClient
from engine.transfer import link as migration_link
from tests.engine.sim import expected, greedy
from tests.engine.test_migration_link import (  # noqa: F401 (the cores fixture)
    PROMPT, cores, deployment_socket, pack, pump, started)

REFUSAL = wire.Refusal("InvalidRequestError", "a prompt too long")
OFFER = {"request_id": "r", "prompt_token_ids": [1, 2], "params": {"logit_bias": {7: 1.5}}}
TICKET = {"request_id": "r", "mac": "00"}

# One of each message, every field set (a field left at its default would not show that it
# travels)
SAMPLES: dict[wire.Codec, list] = {
    wire.TO_CORE: [
        wire.Adds(1, [wire.add_request("r1", [1, 2, 3], {"max_tokens": 4, "stop": ["x"]}, 2,
                                       "17", "salt", "tenant-a", {"address": "ipc:///d",
                                                                  "to": "b", "ticket": TICKET}),
                      wire.add_request("r2", "some text", {})]),
        wire.Command(2, "pin", {"prompt": "p", "soft": True}, 1.7e9),
        wire.Command(3, "metrics", {}, None),
        wire.Stop("r1"),
        wire.KVAsk(4, "request", "r1"),
        wire.Shutdown(),
    ],
    wire.FROM_CORE: [
        wire.Ready({"name": "e", "migration_address": None}, {"running": 0}),
        wire.Outputs([wire.StepOutput("r1", [5], False, None, 3, 0, 0),
                      wire.StepOutput("r2/1", [], True, "error", 9, 4, 1, [[-0.5, [5], [-0.5]]],
                                      [[1, None, [], []]], "it broke", {"request_id": "r2"},
                                      {"to": "b"})]),
        wire.StepFailed(["r1", "r2"], "engine step failed: RuntimeError: x"),
        wire.Reply(5, {"snapshot": b"\x00zlib", "seq": 3}),
        wire.Reply(6, None, REFUSAL),
        wire.Added(7, [None, REFUSAL]),
        wire.Metrics({"kv_usage": 0.5, "kv_view": {"captures": 2}}),
        wire.KVItem({"kind": "delta", "rows": [[1, "a"]]}),
    ],
    migration_link._ANSWERS: [
        wire.Ok("r", 1, {"cached_blocks": 2, "reserved_blocks": 3}),
        wire.Err("r", 2, wire.Refusal("MigrationRefused", "the move carries no ticket")),
    ],
    wire.Codec(wire.PeerRequest, 1 << 20): [
        wire.Reserve("r", 1, OFFER, TICKET),
        wire.Check("r", 2, OFFER, None),
        wire.Write("r", 3, 4, {"kind": "ints", "n": 2}),
        wire.Commit("r", 4, OFFER, 6, {"kind": "parts", "parts": []}, 1.7e9),
        wire.Cancel("r", 5),
        wire.Abort("r", 6),
    ],
}
UNIONS = {wire.TO_CORE: wire.ToCore, wire.FROM_CORE: wire.FromCore,
          migration_link._ANSWERS: wire.PeerAnswer}


def test_every_message_type_has_a_round_trip_sample():
    """A message type added to a protocol without a sample here fails this test."""
    for codec, samples in SAMPLES.items():
        union = UNIONS.get(codec, wire.PeerRequest)
        assert {type(m) for m in samples} == set(typing.get_args(union))
    tags = {m.__struct_config__.tag for samples in SAMPLES.values() for m in samples}
    assert tags == {kind.value for kind in wire.Kind}


@pytest.mark.parametrize("codec, message", [(codec, m) for codec, samples in SAMPLES.items()
                                            for m in samples],
                         ids=lambda x: type(x).__name__)
def test_each_message_round_trips_as_an_array_of_its_kind_first(codec, message):
    data = codec.encode(message)
    assert codec.decode(data) == message
    assert codec.decode(memoryview(data)) == message  # (as a ZMQ frame's buffer comes)
    on_the_wire = msgpack.unpackb(data, raw=False, strict_map_key=False)
    assert on_the_wire[0] == wire.kind_of(message)
    assert len(on_the_wire) == 1 + len(message.__struct_fields__)


def test_a_step_output_carries_every_field_of_the_core_output_but_its_request():
    out = CoreOutput("r", [5, 6], True, "stop", 7, 4, 1, [[-0.1, [], []]], object(),
                     [[1, None, [], []]], None, {"request_id": "r"}, {"to": "b"})
    step = wire.StepOutput.of(out)
    names = {f.name for f in dataclasses.fields(CoreOutput)} - {"request"}
    assert set(wire.StepOutput.__struct_fields__) == names  # (it reads as a CoreOutput)
    assert {n: getattr(step, n) for n in names} == {n: getattr(out, n) for n in names}


@pytest.mark.parametrize("message, says", [
    (b"\xc1 not msgpack", "malformed"),
    (pack({"kind": "cmd"}), "Expected `array`"),
    (pack(["teleport", 1]), "Invalid value 'teleport'"),  # an unknown kind
    (pack(["cmd", 1, "metrics", "not a map", None]), "Expected `object`, got `str`"),
    (pack(["cmd", "1", "metrics", {}, None]), "Expected `int`, got `str`"),
    (pack(["cmd", True, "metrics", {}, None]), "Expected `int`, got `bool`"),
    (pack(["cmd", 1, "metrics", {}]), "at least length 5"),  # a field missing
    (pack(["cmd", 1, "metrics", {}, None, "more"]), "at most length"),  # one too many
    (pack(["stop"]), "at least length 2"),
    (pack(["adds", 1, [["r", [1, 2.5], {}]]]), "Expected `int`, got `float`"),
    (pack(["adds", 1, [["r", [1], {}, "high"]]]), "Expected `int`, got `str`"),
    (pack(["adds", 1, [["r", [1], {}, 0, None, None, None, ["ipc:///x"]]]]),
     "at least length 2, got 1"),
    (pack(["adds", 1, [["r", [1], {1: 2}]]]), "Expected `str`, got `int`"),
])
def test_a_malformed_message_is_a_typed_error(message, says):
    with pytest.raises(MalformedMessage, match=says) as raised:
        wire.TO_CORE.decode(message)
    assert isinstance(raised.value, InvalidRequestError)
    refusal = wire.Refusal.of(raised.value)  # and it crosses a socket as itself
    assert type(error_from_wire(refusal.type, refusal.message)) is MalformedMessage


def test_oversize_is_refused_before_it_is_read_both_ways():
    codec = wire.Codec(wire.ToCore, 64)
    small = codec.encode(wire.Stop("r"))
    big = wire.Command(1, "pin", {"prompt": "x" * 100}, None)
    with pytest.raises(MalformedMessage, match="over the limit of 64"):
        codec.encode(big)
    data = wire.TO_CORE.encode(big)
    with pytest.raises(MalformedMessage, match=f"{len(data)} bytes is over the limit of 64"):
        codec.decode(data)
    assert codec.head(data, 2) is None  # (not read to answer it either)
    assert codec.decode(small) == wire.Stop("r")


def test_a_value_msgpack_cannot_carry_is_refused_when_encoding():
    with pytest.raises(MalformedMessage, match="cannot be encoded"):
        wire.FROM_CORE.encode(wire.Reply(1, {"x": object()}))


def test_head_reads_a_refused_messages_leading_fields_to_answer_it():
    assert wire.TO_CORE.head(pack(["cmd", 9, "metrics", "not a map", None]), 2) == ["cmd", 9]
    assert wire.TO_CORE.head(pack(["cmd"]), 2) is None
    assert wire.TO_CORE.head(pack([["cmd"], 9]), 2) is None  # (a kind that is no string)
    assert wire.TO_CORE.head(pack({"cmd": 9}), 2) is None
    assert wire.TO_CORE.head(b"\xc1", 2) is None


def test_the_core_refuses_malformed_messages_and_keeps_serving(cores, monkeypatch):
    """A call it can name is answered MalformedMessage; one it cannot, or over the limit,
    is dropped (said in the log); nothing of either is applied; a request added right
    after runs to its end."""
    monkeypatch.setattr(wire.TO_CORE, "max_bytes", 4096)
    core = cores("w")
    core.to_core.send(b"\xc1 not msgpack")
    core.to_core.send(pack(["teleport", 1]))  # an unknown kind: no call to answer
    core.to_core.send(pack([{"cmd": 1}, 16]))  # nor a kind that is no string
    core.to_core.send(pack(["cmd", 11, "abort", "r", None]))
    core.to_core.send(pack(["adds", 12, [["bad", [1, 2], {}, "high"]]]))
    core.to_core.send(pack(["kvask", 13]))
    core.to_core.send(pack(["adds", 14, [["huge", list(range(10, 2000)), {}]]]))  # oversize
    core.to_core.send(pack(["stop", 15]))
    call = core.command("metrics", {})  # (answered after the others were read)
    replies = pump(core, until=lambda: call in core.replies)
    for bad in (11, 12, 13):
        ok, error = replies[bad]
        assert not ok and error[0] == "MalformedMessage", error
    assert 12 in replies and "Expected `int`, got `str`" in replies[12][1][1]
    assert not {1, 14, 15, 16} & set(replies)
    assert replies[call][0]
    assert not core.engine.scheduler.requests  # neither "bad" nor "huge" was added
    core.add("after", PROMPT, 8)
    pump(core, until=lambda: core.ended("after") is not None)
    assert core.tokens("after") == expected(PROMPT, 8)


class _Sink:
    def __init__(self) -> None:
        self.outputs: list[wire.StepOutput] = []

    def push(self, outputs: list[wire.StepOutput]) -> None:
        self.outputs += outputs

    def fail(self, request_ids: list[str], message: str) -> None:
        pass


def test_the_client_drops_a_malformed_message_of_its_core_and_fails_the_call_it_names():
    """Through the client's own socket: a reply not of the protocol fails its call with
    MalformedMessage, garbage is dropped, and the client goes on (commands, requests)."""
    sink = _Sink()
    client = InprocClient(EngineConfig(name="wire-client", simulate=True,
                                       simulate_tokenizer="bytes", vocab_size=1000,
                                       num_gpu_blocks=64, simulate_step_ms=1), sink)
    client.start()
    intruder = client._context.socket(zmq.PUSH)
    try:
        intruder.connect(client._out_address)
        pending: Future = Future()
        with client._lock:
            client._calls[10**6] = pending
        intruder.send(b"\xc1 not msgpack")
        intruder.send(pack(["out", [["r", "not token ids"]]]))
        intruder.send(pack(["reply", 10**6, None, ["only a type"]]))
        with pytest.raises(MalformedMessage, match="Expected `array` of at least length 2"):
            pending.result(10)
        assert client.alive
        assert client.command("metrics", {})["num_steps"] >= 0
        client.submit("r", [1, 2, 3], dataclasses.asdict(greedy(4)))
        deadline = time.monotonic() + 20
        while not any(o.finished for o in sink.outputs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [t for o in sink.outputs for t in o.new_token_ids] == expected([1, 2, 3], 4)
    finally:
        intruder.close(linger=0)
        client.stop()


def test_a_client_refuses_to_send_what_its_core_would_refuse(monkeypatch):
    monkeypatch.setattr(wire.TO_CORE, "max_bytes", 256)
    client = InprocClient(EngineConfig(name="wire-big", simulate=True,
                                       simulate_tokenizer="bytes", vocab_size=1000,
                                       num_gpu_blocks=64), _Sink())
    client.start()
    try:
        with pytest.raises(MalformedMessage, match="over the limit of 256"):
            client.submit("r", list(range(10, 400)), {"max_tokens": 2})
        assert client.command("metrics", {})["running"] == 0
    finally:
        client.stop()


def test_a_malformed_answer_gives_the_move_up_at_once(cores):
    """A destination answering a move's reservation with something not of the protocol:
    the move fails (MigrationFailed, no wait for the link's timeout) and the request runs
    on at the source."""
    src = cores("a")
    ctx = zmq.Context()
    fake = deployment_socket(ctx, zmq.ROUTER)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    try:
        src.add("r", PROMPT, 40)
        started(src, "r", 3)
        call = src.command("migrate", {"request_id": "r", "to": "odd",
                                       "address": f"tcp://127.0.0.1:{port}"})
        assert fake.poll(5000)
        peer, header = fake.recv_multipart()
        kind, rid, seq = msgpack.unpackb(header, raw=False, strict_map_key=False)[:3]
        assert (kind, rid) == ("reserve", "r")
        fake.send_multipart([peer, pack(["ok", "r", seq, ["not", "a", "map"]])])
        ok, error = pump(src, until=lambda: call in src.replies, timeout_s=5)[call]
        assert not ok and error[0] == "MigrationFailed" and "malformed" in error[1]
        pump(src, until=lambda: src.ended("r") is not None)
        assert src.ended("r").finish_reason == "length"
        assert src.tokens("r") == expected(PROMPT, 40)
    finally:
        fake.close(linger=0)
        ctx.term()
