"""Requests moving between engine cores over ZMQ (engine/transfer/link.py): each core's
step loop on a thread of its own, as in a core process, talking to the other over TCP.
The moved request's tokens are the ones it would have made; a staged copy stops it for
its last blocks only; a destination that refuses or falls silent leaves it running at the
source, and a source that falls silent leaves nothing held at the destination. The
invariants hold at both ends."""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time

import msgpack
import pytest
import zmq

from engine import keys, wire
from engine.transfer import link as migration_link, ticket as move_ticket
from engine.serve.core_proc import CoreServer
from engine.transfer.migration import MIGRATED
from engine.transfer.link import MigrationLink
from tests.engine.sim import expected, greedy, sim_engine
from tests.support.wait import wait_until

BS = 4
PROMPT = list(range(10, 90))  # 80 tokens: 20 blocks
_ids = itertools.count(1)


SECRET = keys.random_secret()  # the deployment's, shared by every core of a test


def pack(message: list) -> bytes:
    """A migration message as a peer may write it by hand (the codec's format: an array,
    its kind first)."""
    return msgpack.packb(message, use_bin_type=True)


def deployment_socket(ctx: zmq.Context, kind: int, secret: str = SECRET,
                      address: str = "tcp://") -> zmq.Socket:
    """A socket of a peer of the deployment whose secret is `secret`, as a test plays one:
    a ROUTER serving over tcp as an engine's port does (CurveZMQ, without its ZAP check),
    or a DEALER about to connect to `address` as a source core does (CurveZMQ over tcp;
    ipc:// has no keys, its folder's mode is its lock)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    server_public, server_secret = keys.curve_pair(secret, "server")
    if kind == zmq.ROUTER:
        sock.curve_server = True
        sock.curve_secretkey = server_secret
    elif address.startswith("tcp://"):
        sock.curve_serverkey = server_public
        sock.curve_publickey, sock.curve_secretkey = keys.curve_pair(secret, "client")
    return sock


class Core:
    """An engine core serving on a thread: the test is its worker."""

    def __init__(self, name: str, engine=None, **cfg) -> None:
        options = dict(block_size=BS, num_gpu_blocks=96, num_cpu_blocks=0,
                       simulate_step_ms=2.0, name=name, secret=SECRET)
        options.update(cfg)
        self.engine = engine or sim_engine(**options)
        self.ctx = zmq.Context()
        where = f"inproc://core-{name}-{next(_ids)}"
        self.to_core = self.ctx.socket(zmq.PUSH)
        self.to_core.bind(f"{where}-in")
        self.from_core = self.ctx.socket(zmq.PULL)
        self.from_core.bind(f"{where}-out")
        inbox, outbox = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        inbox.connect(f"{where}-in")
        outbox.connect(f"{where}-out")
        self.name = name
        self.link = MigrationLink(self.engine, self.engine.config.secret or SECRET,
                                  self.engine.config.migration_host)
        self.server = CoreServer(self.engine, inbox, outbox, kv_view=False, link=self.link)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.outputs: list[wire.StepOutput] = []  # in order
        self.replies: dict[int, list] = {}  # call id -> [ok, result or [error, message]]
        ready = wire.FROM_CORE.decode(self.from_core.recv())
        assert isinstance(ready, wire.Ready)
        self.address = ready.config["migration_address"]
        self._sockets = (inbox, outbox)

    def send(self, message: wire.ToCore) -> None:
        self.to_core.send(wire.TO_CORE.encode(message))

    def add(self, rid: str, prompt: list[int], max_tokens: int, job_id: str = "7") -> None:
        call = next(_ids)
        self.send(wire.Adds(call, [wire.add_request(
            rid, prompt, dataclasses.asdict(greedy(max_tokens)), job_id=job_id)]))
        assert pump(self, until=lambda: call in self.replies)[call] == [True, [None]]

    def command(self, name: str, arguments: dict, deadline_s: float = 30.0) -> int:
        """Send an operator command; a "migrate" gets the ticket the service would sign
        (for the request, from this core to arguments["to"]) unless it brings one."""
        if name == "migrate" and "ticket" not in arguments:
            arguments = {**arguments, "ticket": move_ticket.sign(
                SECRET, str(arguments.get("request_id")), None, self.name,
                str(arguments.get("to")), time.time() + deadline_s)}
        call = next(_ids)
        self.send(wire.Command(call, name, arguments, time.time() + deadline_s))
        return call

    def read(self) -> None:
        while True:
            try:
                message = wire.FROM_CORE.decode(self.from_core.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if isinstance(message, wire.Outputs):
                self.outputs += message.outputs
            elif isinstance(message, wire.Reply):
                error = message.error
                self.replies[message.call_id] = [True, message.result] if error is None \
                    else [False, [error.type, error.message]]
            elif isinstance(message, wire.Added):
                self.replies[message.call_id] = [True, [
                    None if r is None else [r.type, r.message] for r in message.refusals]]

    def tokens(self, rid: str) -> list[int]:
        """Every token this core reported for rid, the ones it came with first."""
        out = []
        for o in self.outputs:
            if o.request_id == rid:
                if o.migration and "from" in o.migration:
                    out += o.migration["output_token_ids"]
                out += o.new_token_ids
        return out

    def ended(self, rid: str) -> wire.StepOutput | None:
        return next((o for o in self.outputs if o.request_id == rid and o.finished), None)

    def stop(self) -> None:
        self.send(wire.Shutdown())
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.link.close()
        for sock in (*self._sockets, self.to_core, self.from_core):
            sock.close(linger=0)
        self.ctx.term()
        self.engine.kv.check_invariants()
        assert not self.engine.migrator.incoming
        assert self.engine.kv.gpu.num_free == self.engine.kv.gpu.num_blocks - sum(
            len(self.engine.kv.block_ids(r)) for r in self.engine.scheduler.requests)


def pump(*cores: Core, until, timeout_s: float = 20.0) -> dict:
    """Read every core's messages until `until()` holds; returns the first core's replies."""
    def read_all() -> bool:
        for core in cores:
            core.read()
        return until()

    wait_until(read_all, "the cores' messages to meet pump's condition", timeout_s,
               poll_s=0.001)
    return cores[0].replies


@pytest.fixture
def cores():
    made: list[Core] = []

    def make(name: str, **cfg) -> Core:
        made.append(Core(name, **cfg))
        return made[-1]

    yield make
    for core in made:
        core.stop()


def moves_and_ends_there(src: Core, dst: Core, rid: str, max_tokens: int) -> None:
    """A request of PROMPT started at `src`, moved to `dst` after 3 tokens: it ends there
    with the tokens it would have made."""
    src.add(rid, PROMPT, max_tokens)
    started(src, rid, 3)
    call = src.command("migrate", {"request_id": rid, "address": dst.address, "to": dst.name})
    ok, result = pump(src, dst, until=lambda: call in src.replies)[call]
    assert ok, result
    pump(src, dst, until=lambda: dst.ended(rid) is not None)
    assert dst.tokens(rid) == expected(PROMPT, max_tokens)


def started(core: Core, rid: str, n: int) -> None:
    """Wait until the request has made n tokens at `core`."""
    pump(core, until=lambda: len(core.tokens(rid)) >= n)


@pytest.mark.parametrize("staged", [True, False])
def test_a_moved_request_goes_on_at_the_destination_with_the_tokens_it_would_have(
        cores, staged):
    src, dst = cores("a"), cores("b")
    src.add("r", PROMPT, 60)
    started(src, "r", 12)
    call = src.command("migrate", {"request_id": "r", "address": dst.address, "to": "b",
                                   "staged": staged})
    ok, result = pump(src, dst, until=lambda: call in src.replies)[call]
    assert ok, result
    assert result["moved"] and result["to"] == "b" and result["blocks_cached"] == 0
    pump(src, dst, until=lambda: dst.ended("r") is not None and src.ended("r") is not None)
    end = src.ended("r")
    assert end.finish_reason == MIGRATED and end.migration == {"to": "b", "reason": "migration"}
    arrived = next(o for o in dst.outputs if o.request_id == "r")
    assert arrived.migration["from"] == "a" and arrived.migration["job_id"] == "7"
    # what the source made, then what the destination made: the request's whole output
    assert src.tokens("r") == arrived.migration["output_token_ids"]
    assert dst.tokens("r") == expected(PROMPT, 60)
    assert dst.ended("r").finish_reason == "length"
    full = 92 // BS  # (80 prompt tokens and at least 12 made: 23 full blocks at least)
    if staged:  # the stop copied the last few blocks only
        assert result["stages"] >= 1 and result["blocks_at_stop"] <= 3
        assert result["blocks_sent"] >= full
    else:
        assert result["stages"] == 0 and result["blocks_at_stop"] >= full
    assert result["bytes_sent"] > 0


def test_blocks_the_destination_caches_are_not_sent(cores):
    src, dst = cores("a"), cores("b")
    dst.add("warm", PROMPT, 1)
    pump(dst, until=lambda: dst.ended("warm") is not None)
    src.add("r", PROMPT, 40)
    started(src, "r", 5)
    call = src.command("migrate", {"request_id": "r", "address": dst.address, "to": "b"})
    ok, result = pump(src, dst, until=lambda: call in src.replies)[call]
    assert ok, result
    assert result["blocks_cached"] == 20  # the prompt's 20 full blocks were there
    pump(src, dst, until=lambda: dst.ended("r") is not None)
    assert dst.tokens("r") == expected(PROMPT, 40)


def test_a_destination_that_refuses_leaves_the_request_running_at_the_source(cores):
    src, dst = cores("a"), cores("b", num_gpu_blocks=8)  # no room there
    src.add("r", PROMPT, 40)
    started(src, "r", 5)
    call = src.command("migrate", {"request_id": "r", "address": dst.address, "to": "b"})
    ok, error = pump(src, dst, until=lambda: call in src.replies)[call]
    assert not ok and error[0] == "NotEnoughBlocksError"
    pump(src, dst, until=lambda: src.ended("r") is not None)
    assert src.ended("r").finish_reason == "length" and src.tokens("r") == expected(PROMPT, 40)
    assert not any(o.request_id == "r" for o in dst.outputs)


def test_a_paused_destination_refuses(cores):
    src, dst = cores("a"), cores("b")
    pause = dst.command("pause", {})
    pump(dst, until=lambda: pause in dst.replies)
    src.add("r", PROMPT, 30)
    started(src, "r", 3)
    call = src.command("migrate", {"request_id": "r", "address": dst.address, "to": "b"})
    ok, error = pump(src, dst, until=lambda: call in src.replies)[call]
    assert not ok and error[0] == "InvalidStateError" and "paused" in error[1]
    pump(src, dst, until=lambda: src.ended("r") is not None)
    assert src.tokens("r") == expected(PROMPT, 30)


def test_a_request_that_is_not_running_cannot_move(cores):
    src, dst = cores("a"), cores("b")
    call = src.command("migrate", {"request_id": "nope", "address": dst.address})
    ok, error = pump(src, dst, until=lambda: call in src.replies)[call]
    assert not ok and error[0] == "UnknownRequestError"
    call = src.command("migrate", {"request_id": "nope", "address": "not-an-address"})
    ok, error = pump(src, until=lambda: call in src.replies)[call]
    assert not ok and error[0] == "InvalidRequestError"


def test_a_destination_that_falls_silent_mid_copy_leaves_the_request_at_the_source(
        cores, monkeypatch):
    """A destination that answers the reservation and then nothing (it died): the source
    gives up after the link's timeout and the request runs on there, with its output."""
    monkeypatch.setattr(migration_link, "LINK_TIMEOUT_S", 0.3)
    src = cores("a", simulate_step_ms=5.0)
    ctx = zmq.Context()
    fake = deployment_socket(ctx, zmq.ROUTER)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    try:
        src.add("r", PROMPT, 80)
        started(src, "r", 3)
        call = src.command("migrate", {"request_id": "r", "to": "dead",
                                       "address": f"tcp://127.0.0.1:{port}"})
        assert fake.poll(5000)
        peer, header = fake.recv_multipart()
        kind, rid, seq, offer, _ = msgpack.unpackb(header, raw=False)
        assert (kind, rid) == ("reserve", "r") and offer["request_id"] == "r"
        fake.send_multipart([peer, pack(["ok", "r", seq, {"cached_blocks": 0,
                                                         "reserved_blocks": 20}])])
        ok, error = pump(src, until=lambda: call in src.replies)[call]
        assert not ok and "did not answer" in error[1]
        pump(src, until=lambda: src.ended("r") is not None)
        assert src.ended("r").finish_reason == "length" and src.tokens("r") == expected(PROMPT, 80)
        # the source told the destination to let go of what it held
        messages = []
        while fake.poll(200):
            messages.append(msgpack.unpackb(fake.recv_multipart()[1], raw=False)[0])
        assert "cancel" in messages
    finally:
        fake.close(linger=0)
        ctx.term()


def test_a_source_that_falls_silent_mid_copy_leaves_nothing_held(cores, monkeypatch):
    """A source that reserved blocks and then stopped (it died): the destination gives
    them back after HOLD_TIMEOUT_S."""
    monkeypatch.setattr(migration_link, "HOLD_TIMEOUT_S", 0.3)
    src_engine = sim_engine(block_size=BS, num_gpu_blocks=96, num_cpu_blocks=0, name="a")
    src_engine.add_request("r", PROMPT, greedy(30))
    for _ in range(8):
        src_engine.step()
    offer = src_engine.migrator.offer("r")
    dst = cores("b")
    free = dst.engine.kv.gpu.num_free
    ctx = zmq.Context()
    fake = deployment_socket(ctx, zmq.DEALER, address=dst.address)
    fake.connect(dst.address)
    try:
        fake.send(pack(["reserve", "r", 1, offer, move_ticket.sign(
            SECRET, "r", None, "a", "b", time.time() + 30)]))
        assert fake.poll(5000)
        kind, rid, seq, answer = msgpack.unpackb(fake.recv(), raw=False)
        assert kind == "ok" and answer["reserved_blocks"] >= 20
        assert dst.engine.kv.gpu.num_free < free
        # held: fewer free blocks there, until the source is given up on
        pump(dst, until=lambda: not dst.engine.migrator.incoming)
        pump(dst, until=lambda: dst.engine.kv.gpu.num_free == free)
    finally:
        fake.close(linger=0)
        ctx.term()


def test_a_move_carries_the_models_weight_of_kv_and_only_between_alike_engines(cores):
    """The simulator standing for a model of 1 KiB of K/V per token: a move sends that
    much; an engine that stores its K/V otherwise refuses the request."""
    src = cores("a", simulate_kv_bytes_per_token=1024)
    dst = cores("b", simulate_kv_bytes_per_token=1024)
    odd = cores("c", simulate_kv_bytes_per_token=2048)
    src.add("r", PROMPT, 40)
    started(src, "r", 4)
    call = src.command("migrate", {"request_id": "r", "address": odd.address, "to": "c"})
    ok, error = pump(src, odd, until=lambda: call in src.replies)[call]
    assert not ok and error[0] == "InvalidRequestError" and "uint64+2048" in error[1]
    call = src.command("migrate", {"request_id": "r", "address": dst.address, "to": "b"})
    ok, result = pump(src, dst, until=lambda: call in src.replies)[call]
    assert ok, result
    assert result["bytes_sent"] >= result["blocks_sent"] * BS * 1024
    pump(src, dst, until=lambda: dst.ended("r") is not None)
    assert dst.tokens("r") == expected(PROMPT, 40)


class FakeDestination:
    """A destination the test answers for, message by message."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = deployment_socket(self.ctx, zmq.ROUTER)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.peer = b""

    def next(self, core: Core) -> list:
        """The next message from the source (its core's outputs read meanwhile)."""
        pump(core, until=lambda: self.sock.poll(0))
        frames = self.sock.recv_multipart()
        self.peer = frames[0]
        return msgpack.unpackb(frames[1], raw=False)

    def answer(self, message: list, result) -> None:
        self.sock.send_multipart([self.peer, pack(["ok", message[1], message[2], result])])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.mark.parametrize("when", ["copying", "committing"])
def test_a_request_cancelled_while_it_moves_ends_at_both_ends(cores, when):
    """The client cancels (an abort at the source) while the full blocks are being copied,
    or while the commit is in flight: the move fails, the source's blocks go back, and the
    destination is told to let go (copying) or to end the request it took (committing)."""
    src = cores("a", simulate_step_ms=5.0)
    fake = FakeDestination()
    try:
        src.add("r", PROMPT, 200)
        started(src, "r", 3)
        call = src.command("migrate", {"request_id": "r", "address": fake.address, "to": "b"})
        reserve = fake.next(src)
        assert reserve[0] == "reserve"
        fake.answer(reserve, {"cached_blocks": 0, "reserved_blocks": 20})
        write = fake.next(src)
        assert write[0] == "write"
        if when == "committing":
            fake.answer(write, {})
            commit = fake.next(src)
            while commit[0] == "write":  # (blocks filled since the reservation)
                fake.answer(commit, {})
                commit = fake.next(src)
            assert commit[0] == "commit"
        abort = src.command("abort", {"request_id": "r"})
        pump(src, until=lambda: abort in src.replies)
        if when == "copying":
            fake.answer(write, {})
        else:
            fake.answer(commit, {"num_blocks": 21})
        ok, error = pump(src, until=lambda: call in src.replies)[call]
        assert not ok
        told = fake.next(src)
        assert told[0] == ("cancel" if when == "copying" else "abort") and told[1] == "r"
        assert src.ended("r").finish_reason == "abort"
        pump(src, until=lambda: not src.engine.scheduler.requests)
    finally:
        fake.close()


def test_several_requests_move_at_once_within_one_staging_budget(cores, monkeypatch):
    """A drain's moves run side by side, staging at most STAGE_BLOCKS between two steps
    over all of them: each arrives whole."""
    monkeypatch.setattr(migration_link, "STAGE_BLOCKS", 4)
    src, dst = cores("a", num_gpu_blocks=256), cores("b", num_gpu_blocks=256)
    prompts = {f"r{i}": [i + 1] + PROMPT[:60 + 4 * i] for i in range(4)}
    for rid, prompt in prompts.items():
        src.add(rid, prompt, 80)
    for rid in prompts:
        started(src, rid, 3)
    calls = {rid: src.command("migrate", {"request_id": rid, "address": dst.address,
                                          "to": "b"}) for rid in prompts}
    pump(src, dst, until=lambda: all(c in src.replies for c in calls.values()))
    for call in calls.values():
        ok, result = src.replies[call]
        assert ok, result
        assert result["stages"] >= 3  # (16-19 full blocks, 4 a step over all four)
    pump(src, dst, until=lambda: all(dst.ended(rid) for rid in prompts))
    for rid, prompt in prompts.items():
        assert dst.tokens(rid) == expected(prompt, 80)


def test_a_fork_moves_between_cores_with_all_its_samples(cores, tiny_model):
    """n=3 on a tiny Llama, between two core loops: one stop-and-copy, the samples
    together; each sample's first output at the destination says which it is."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    folder = tiny_model("gqa16")
    cfg = dict(model=str(folder), device="cpu", dtype="float32", attention_backend="torch",
               block_size=4, num_gpu_blocks=128, num_cpu_blocks=0, seed=0)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, n=3, ignore_eos=True)
    prompt = list(range(5, 35))
    alone = LLMEngine(EngineConfig(**cfg)).generate([prompt], params)[0]
    src = Core("a", engine=LLMEngine(EngineConfig(name="a", **cfg)))
    dst = Core("b", engine=LLMEngine(EngineConfig(name="b", **cfg)))
    try:
        call = next(_ids)
        src.send(wire.Adds(call, [wire.add_request("r", prompt, dataclasses.asdict(params),
                                                   job_id="9")]))
        pump(src, until=lambda: call in src.replies)
        pump(src, until=lambda: all(len(src.tokens(f"r/{i}")) >= 4 for i in range(3)))
        call = src.command("migrate", {"request_id": "r", "address": dst.address, "to": "b"})
        ok, result = pump(src, dst, until=lambda: call in src.replies)[call]
        assert ok, result
        assert not result["staged"] and result["blocks_at_stop"] == result["blocks_sent"]
        pump(src, dst, until=lambda: all(dst.ended(f"r/{i}") for i in range(3)))
        for i, sample in enumerate(alone.samples):
            assert dst.tokens(f"r/{i}") == sample.output_token_ids
            arrived = next(o for o in dst.outputs if o.request_id == f"r/{i}")
            assert arrived.migration["fork"] == {"parent": "r", "index": i, "n": 3}
    finally:
        src.stop()
        dst.stop()


def test_a_windowed_request_moves_between_cores_in_one_stop_and_copy(cores):
    """Sliding and global layers (two layer groups): the move is a stop-and-copy of each
    group's live blocks, whatever was asked."""
    src = cores("a", simulate_sliding_window=8, simulate_hybrid=True)
    dst = cores("b", simulate_sliding_window=8, simulate_hybrid=True)
    src.add("r", PROMPT, 60)
    started(src, "r", 12)
    call = src.command("migrate", {"request_id": "r", "address": dst.address, "to": "b"})
    ok, result = pump(src, dst, until=lambda: call in src.replies)[call]
    assert ok, result
    assert not result["staged"] and result["blocks_at_stop"] == result["blocks_sent"] > 0
    pump(src, dst, until=lambda: dst.ended("r") is not None)
    assert dst.tokens("r") == expected(PROMPT, 60)


def test_malformed_messages_on_the_migration_port_are_dropped(cores):
    """From a peer of the deployment (it has the port's keys): bytes that are no message, a
    message of the wrong shape, an unknown kind: each is dropped or refused, and the core
    goes on serving (a move right after works)."""
    src, dst = cores("a"), cores("b")
    ctx = zmq.Context()
    peer = deployment_socket(ctx, zmq.DEALER, address=dst.address)
    peer.connect(dst.address)
    try:
        peer.send(b"\xc1 not msgpack")
        peer.send(pack({"kind": "reserve"}))
        peer.send(pack(["reserve", 7, "x"]))
        peer.send(pack(["nonsense", "r", 1]))  # (about no move of its: unanswered)
        peer.send(pack(["check", "r", 2, {"request_id": "r"}]))  # (one field short)
        peer.send(pack(["check", "r", 3, {"request_id": "r"}, None]))
        answers = []
        while len(answers) < 2:
            assert peer.poll(5000)
            answers.append(msgpack.unpackb(peer.recv(), raw=False))
        assert [a[:3] for a in answers] == [["err", "r", 2], ["err", "r", 3]]
        assert answers[0][3][0] == "MalformedMessage"  # (an InvalidRequestError)
        assert answers[1][3] == ["MigrationRefused", "the move carries no ticket"]
        moves_and_ends_there(src, dst, "r", 30)
    finally:
        peer.close(linger=0)
        ctx.term()
