"""The migration port under attack (engine/transfer/link.py): each forged move an audit
made against it, replayed through the wire protocol, and what stops it. A stranger (no
deployment secret) cannot complete the handshake; a peer of the deployment can move only
what the service signed a ticket for, once; what a move carries is checked whole before
it touches the engine. Legitimate moves are tests/engine/test_migration_link.py's."""
from __future__ import annotations

import dataclasses
import os
import stat
import threading
import time
from concurrent.futures import Future

import msgpack
import pytest
import zmq

from engine import keys
from engine.transfer import link as migration_link, ticket as move_ticket
from engine.errors import InvalidRequestError
from engine.transfer.check import Destination, check_state
from tests.engine.sim import VOCAB, expected, greedy, sim_engine
from tests.engine.test_migration_link import (  # noqa: F401 (the cores fixture)
    BS, PROMPT, SECRET, cores, deployment_socket, moves_and_ends_there, pack, pump, started)


def ticket(rid: str, to: str = "b", source: str = "a", job: str | None = None,
           expires_in: float = 30.0, secret: str = SECRET) -> dict:
    return move_ticket.sign(secret, rid, job, source, to, time.time() + expires_in)


OTHER = list(range(100, 180))  # another prompt than the engines' own requests'


def offer_of(rid: str = "r", tokens: int = 3, prompt: list[int] = OTHER, n: int = 1) -> dict:
    """A real offer: a request that made `tokens` on an engine "a" of the tests' kind (a
    fork of n samples: its first sample made them)."""
    engine = sim_engine(block_size=BS, num_gpu_blocks=96, num_cpu_blocks=0, name="a")
    engine.add_request(rid, prompt, dataclasses.replace(greedy(30), n=n, seed=1))
    first = rid if n == 1 else f"{rid}/0"
    while first not in engine.scheduler.requests or \
            len(engine.scheduler.requests[first].output_token_ids) < tokens:
        engine.step()
    return engine.migrator.offer(rid)


SEND_WAIT_MS = 2000


class Peer:
    """A DEALER on a destination's port; `secret` None: a stranger without keys."""

    def __init__(self, address: str, secret: str | None = SECRET) -> None:
        self.ctx = zmq.Context()
        # another deployment's peer, or one without keys: its handshake fails
        self.stranger = secret != SECRET
        self.sock = deployment_socket(self.ctx, zmq.DEALER, secret, address) if secret else \
            self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, message: list, frames: list = ()) -> None:
        """A stranger's DEALER may have no pipe to send on (its refused connection torn
        down, the next not yet made): a message it cannot hand over within SEND_WAIT_MS
        never reaches the port either, which is what the tests ask of strangers."""
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_WAIT_MS)
        try:
            self.sock.send_multipart([pack(message), *frames])
        except zmq.Again:
            if not self.stranger:
                raise

    def answer(self, core, timeout_s: float = 10.0) -> list:
        """The next answer (the core's outputs read meanwhile)."""
        pump(core, until=lambda: self.sock.poll(0), timeout_s=timeout_s)
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def peers():
    made: list[Peer] = []

    def make(address: str, secret: str | None = SECRET) -> Peer:
        made.append(Peer(address, secret))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def test_a_stranger_cannot_connect_and_learns_nothing(cores, peers):
    """Over tcp, no keys or another deployment's: the handshake fails, so a check (the
    prefix cache oracle), a forged commit (the hijack, the poisoned cache) and an abort of
    a running request are never read; the request runs to its end, nothing is cached or
    held, and a peer of the deployment is answered right after."""
    dst = cores("b", migration_host="127.0.0.1")
    dst.add("victim", PROMPT, 40)
    started(dst, "victim", 2)
    offer = offer_of()
    forged = ["commit", "r", 3, offer, 0, {"kind": "ints", "n": 0}, time.time() + 30]
    strangers = []
    for secret in (None, keys.random_secret()):
        stranger = peers(dst.address, secret)
        stranger.send(["check", "r", 1, offer, ticket("r", secret=secret or SECRET)])
        stranger.send(forged, [b""])
        stranger.send(["abort", "victim", 2])
        strangers.append(stranger)
    member = peers(dst.address)
    member.send(["check", "r", 9, offer, None])
    assert member.answer(dst)[:3] == ["err", "r", 9]  # (a member is answered)
    pump(dst, until=lambda: dst.ended("victim") is not None)
    assert dst.ended("victim").finish_reason == "length" and dst.tokens("victim") == expected(PROMPT, 40)
    assert not any(stranger.sock.poll(0) for stranger in strangers)
    assert "r" not in dst.engine.scheduler.requests and not dst.engine.migrator.incoming
    assert not dst.engine.kv.cached_chain([bytes.fromhex(h) for h in offer["block_hashes"]])


def test_strangers_get_no_answer(cores, peers):
    """Whatever a stranger sends over tcp, nothing comes back (no model id, no counts, no
    error): one without keys, and one that knows the port's public key but not the
    deployment's client key (the ZAP handler refuses its handshake)."""
    dst = cores("b", migration_host="127.0.0.1")
    stranger = peers(dst.address, None)
    knows_the_port = peers(dst.address, None)
    knows_the_port.sock.close(linger=0)
    knows_the_port.sock = knows_the_port.ctx.socket(zmq.DEALER)
    knows_the_port.sock.setsockopt(zmq.LINGER, 0)
    knows_the_port.sock.curve_serverkey = keys.curve_pair(SECRET, "server")[0]
    knows_the_port.sock.curve_publickey, knows_the_port.sock.curve_secretkey = \
        zmq.curve_keypair()
    knows_the_port.sock.connect(dst.address)
    for peer in (stranger, knows_the_port):
        peer.send(["check", "r", 1, offer_of(), ticket("r")])
    member = peers(dst.address)
    member.send(["check", "r", 2, {}, None])
    member.answer(dst)  # (served after the strangers' messages were, had they arrived)
    assert not stranger.sock.poll(200) and not knows_the_port.sock.poll(200)


@pytest.mark.parametrize("case", ["none", "forged", "other engine", "other request",
                                  "expired", "other source", "other job"])
def test_a_move_without_the_services_ticket_is_refused(cores, peers, case):
    """A peer of the deployment opens a move only with the ticket the service signed for
    that request, to this engine, from the engine it runs on, of its job, not expired;
    otherwise MigrationRefused, and nothing is held or changed."""
    dst = cores("b")
    offer = offer_of()
    offer["job_id"] = "7"
    signed = {
        "none": None,
        "forged": {**ticket("r"), "mac": "0" * 64},
        "other engine": ticket("r", to="c"),
        "other request": ticket("s"),
        "expired": ticket("r", expires_in=-1),
        "other source": ticket("r", source="x"),
        "other job": ticket("r", job="8"),
    }[case]
    free = dst.engine.kv.gpu.num_free
    peer = peers(dst.address)
    peer.send(["reserve", "r", 1, offer, signed])
    kind, rid, seq, error = peer.answer(dst)
    assert (kind, rid, seq, error[0]) == ("err", "r", 1, "MigrationRefused")
    assert "cached" not in error[1] and "simulated" not in error[1]  # (no model, no counts)
    assert not dst.engine.migrator.incoming and dst.engine.kv.gpu.num_free == free
    # the right ticket opens it
    peer.send(["reserve", "r", 2, offer, ticket("r", job="7")])
    assert peer.answer(dst)[0] == "ok"


def test_a_ticket_opens_one_move_once(cores, peers):
    """A ticket used for one move cannot open another (a replay), even after the first
    was let go."""
    dst = cores("b")
    offer, signed = offer_of(), ticket("r")
    peer = peers(dst.address)
    peer.send(["reserve", "r", 1, offer, signed])
    assert peer.answer(dst)[0] == "ok"
    peer.send(["cancel", "r", 2])
    pump(dst, until=lambda: not dst.engine.migrator.incoming)
    peer.send(["reserve", "r", 3, offer, signed])
    assert peer.answer(dst)[3] == ["MigrationRefused", "the move's ticket was used already"]


def test_only_the_connection_that_opened_a_move_may_touch_it(cores, peers):
    """Another connection of the deployment cannot write into, commit, cancel or abort a
    move it did not open, nor abort a request running there: its messages are dropped
    unanswered."""
    dst = cores("b")
    dst.add("victim", PROMPT, 40)
    offer = offer_of()
    owner, other = peers(dst.address), peers(dst.address)
    owner.send(["reserve", "r", 1, offer, ticket("r")])
    assert owner.answer(dst)[0] == "ok"
    held = list(dst.engine.kv.block_ids("r"))
    other.send(["write", "r", 2, 0, {"kind": "ints", "n": 1}], [bytes(8 * BS)])
    other.send(["commit", "r", 3, offer, 0, {"kind": "ints", "n": 0}, time.time() + 30],
               [b""])
    other.send(["cancel", "r", 4])
    other.send(["abort", "victim", 5])
    owner.send(["check", "q", 6, {}, None])  # (answered after the others were served)
    assert owner.answer(dst)[:3] == ["err", "q", 6]
    assert not other.sock.poll(0)
    assert dst.engine.kv.block_ids("r") == held and "r" in dst.engine.migrator.incoming
    pump(dst, until=lambda: dst.ended("victim") is not None)
    assert dst.ended("victim").finish_reason == "length"


@pytest.mark.parametrize("field, value, says", [
    ("prompt_token_ids", [1, 2, 10**9], "prompt_token_ids"),
    ("output_token_ids", [-1], "output_token_ids"),
    ("num_computed_tokens", 10**6, "num_computed_tokens"),
    ("params", {"max_tokens": 8, "logit_bias": {10**9: 1.0}}, "params"),
    ("params", {"max_tokens": 8, "nonsense": 1}, "params"),
    ("output_logprobs", [[0.0, [1], [0.0, 1.0]]], "output_logprobs"),
    ("block_hashes", ["zz"], "block_hashes"),
    ("kv_story", {"request_id": 5}, "kv_story"),
    ("priority", True, "priority"),
])
def test_a_malformed_state_is_refused_before_it_touches_the_engine(cores, peers, field, value,
                                                                   says):
    """Token ids outside the vocabulary, computed tokens past the tokens, logprobs or a
    story of another shape: refused naming the field (InvalidRequestError); the engine's
    own request runs on untouched (nothing raises in its step)."""
    dst = cores("b")
    dst.add("victim", PROMPT, 30)
    offer = offer_of()
    offer[field] = value
    peer = peers(dst.address)
    peer.send(["reserve", "r", 1, offer, ticket("r")])
    kind, _, _, error = peer.answer(dst)
    assert kind == "err" and error[0] == "InvalidRequestError" and says in error[1]
    assert not dst.engine.migrator.incoming
    pump(dst, until=lambda: dst.ended("victim") is not None)
    assert dst.tokens("victim") == expected(PROMPT, 30)


def test_check_state_takes_a_real_offer_and_names_each_bad_field():
    """engine/transfer/check.py on its own: a real offer (and a fork's) passes; each mutation
    is an InvalidRequestError naming its field."""
    dest = Destination(vocab_size=VOCAB, block_size=BS, max_model_len=4096, num_groups=1)
    offer = offer_of()
    check_state(dest, offer)
    fork = offer_of(n=3)
    check_state(dest, fork)
    with pytest.raises(InvalidRequestError, match="samples"):
        check_state(dest, {**fork, "samples": fork["samples"][::-1]})
    for field, value in [("request_id", ""), ("arrival_time", "now"), ("root_hash", "00"),
                         ("sample_index", 99), ("groups", [[0, 1], [0, 1]]), ("tenant", 7),
                         ("prompt_logprobs", [[1, None, [1], [0.0]], [2]])]:
        with pytest.raises(InvalidRequestError, match=field):
            check_state(dest, {**offer, field: value})
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        check_state(dataclasses.replace(dest, vocab_size=min(OTHER)), offer)
    with pytest.raises(InvalidRequestError, match="output_token_ids"):
        check_state(dataclasses.replace(dest, max_model_len=len(PROMPT)), offer)


def test_frames_larger_or_more_than_declared_are_refused_before_decoding(cores, peers):
    """A write declaring 3,000,000 blocks in a few bytes, one declaring more blocks than
    are held, one whose bytes are not its blocks': refused, nothing decoded or written. A
    frame over the largest a legitimate move sends (ZMQ_MAXMSGSIZE) drops the
    connection before it is read; the core goes on."""
    dst = cores("b", max_model_len=256)
    offer = offer_of()
    peer = peers(dst.address)
    peer.send(["reserve", "r", 1, offer, ticket("r")])
    answer = peer.answer(dst)
    assert answer[0] == "ok"
    held = answer[3]["reserved_blocks"]
    for seq, (n, size) in enumerate([(3_000_000, 8), (held + 1, (held + 1) * BS * 8),
                                     (1, 7)], start=2):
        peer.send(["write", "r", seq, 0, {"kind": "ints", "n": n}], [bytes(size)])
        kind, _, _, error = peer.answer(dst)
        assert kind == "err" and error[0] == "InvalidRequestError", error
    limit = max(dst.link.header_bytes, dst.link.frame_bytes)
    big = peers(dst.address)
    big.send(["write", "r", 9, 0, {"kind": "ints", "n": 1}], [bytes(limit + 1)])
    peer.send(["check", "q", 10, {}, None])
    assert peer.answer(dst)[:3] == ["err", "q", 10]
    assert not big.sock.poll(200)
    assert "r" in dst.engine.migrator.incoming  # (its owner's move goes on)


def test_held_blocks_go_back_when_the_ticket_runs_out_even_while_writes_come(
        cores, peers, monkeypatch):
    """A reservation of every free block, kept alive by a write every little while, is
    still given back once its ticket's time (and HOLD_TIMEOUT_S) has passed."""
    monkeypatch.setattr(migration_link, "HOLD_TIMEOUT_S", 0.2)
    dst = cores("b")
    free = dst.engine.kv.gpu.num_free
    peer = peers(dst.address)
    peer.send(["reserve", "r", 1, offer_of(), ticket("r", expires_in=0.5)])
    assert peer.answer(dst)[0] == "ok"
    assert dst.engine.kv.gpu.num_free < free
    seq = 2
    while dst.engine.migrator.incoming:  # (bounded by pump's timeout)
        peer.send(["write", "r", seq, 0, {"kind": "ints", "n": 0}], [b""])
        pump(dst, until=lambda s=seq: peer.sock.poll(0) or not dst.engine.migrator.incoming)
        if peer.sock.poll(0):
            peer.sock.recv()
        seq += 1
    assert dst.engine.kv.gpu.num_free == free


def test_a_constraint_compiles_beside_the_loop_while_its_move_waits(cores, peers, monkeypatch):
    """A move carrying a structured-output constraint waits for the compile thread, the
    step loop going on meanwhile (the engine's own request makes its tokens); once the
    compile ends (here: a refusal), the move is answered."""
    dst = cores("b")
    compiling: Future = Future()
    asked = threading.Event()

    class Compiler:  # (the simulator constrains nothing: a compile thread stands in)
        def compile(self, spec):
            asked.set()
            return compiling

    monkeypatch.setattr(dst.engine.input_processor, "structured_outputs", Compiler)
    dst.add("victim", PROMPT, 60)
    offer = offer_of()
    offer["params"]["structured"] = {"regex": "[a-z]+"}
    peer = peers(dst.address)
    peer.send(["reserve", "r", 1, offer, ticket("r")])
    pump(dst, until=asked.is_set)
    made = len(dst.tokens("victim"))
    pump(dst, until=lambda: len(dst.tokens("victim")) >= made + 5)  # (the loop steps on)
    assert not peer.sock.poll(0) and not dst.engine.migrator.incoming
    compiling.set_exception(InvalidRequestError("structured regex: refused"))
    kind, _, _, error = peer.answer(dst)
    assert kind == "err" and "refused" in error[1]


def test_the_port_on_one_machine_is_a_socket_in_a_private_folder(cores):
    """ipc:// (the default): a socket file in a folder of mode 0700, so no other local
    user can connect."""
    core = cores("b")
    assert core.address.startswith("ipc://")
    folder = os.path.dirname(core.address.removeprefix("ipc://"))
    mode = os.stat(folder)
    assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.getuid()


def test_a_move_over_tcp_is_encrypted_and_goes_on(cores):
    """Between machines (tcp://): the same handshake, and a move works."""
    src = cores("a", migration_host="127.0.0.1")
    dst = cores("b", migration_host="127.0.0.1")
    assert dst.address.startswith("tcp://127.0.0.1:")
    moves_and_ends_there(src, dst, "r", 30)


def test_the_connection_that_committed_a_move_may_abort_it_and_no_other(cores, peers):
    """An abort (the request cancelled at the source while its commit was in flight)
    ends the request here only from the connection that committed it."""
    dst = cores("b")
    src = sim_engine(block_size=BS, num_gpu_blocks=96, num_cpu_blocks=0, name="a")
    src.add_request("r", OTHER, greedy(200))
    while len(src.scheduler.requests["r"].output_token_ids) < 3:
        src.step()
    owner, other = peers(dst.address), peers(dst.address)
    owner.send(["check", "r", 1, src.migrator.offer("r"), ticket("r")])
    assert owner.answer(dst)[0] == "ok"
    state, data = src.migrator.take_out("r", 0)
    header, frames = src.runner.blocks_to_frames(data)
    owner.send(["commit", "r", 2, state, 0, header, time.time() + 30], frames)
    assert owner.answer(dst)[0] == "ok"
    other.send(["abort", "r", 3])
    owner.send(["check", "q", 4, {}, None])  # (answered after the other's abort was read)
    owner.answer(dst)
    assert "r" in dst.engine.scheduler.requests and dst.ended("r") is None
    owner.send(["abort", "r", 5])
    pump(dst, until=lambda: dst.ended("r") is not None)
    assert dst.ended("r").finish_reason == "abort"
