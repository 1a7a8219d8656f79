"""Requests moving between engine cores over ZMQ: engine/transfer/migration.py's steps with each
engine in a process (or on a machine) of its own.

Every core binds a ROUTER socket at its migration address (in its `describe_config()` as
"migration_address"): on one machine ipc:// in a folder of its own (0700), on many
tcp://host:port. A move is started by a command to the source core ("migrate":
request_id, address, to, staged, ticket) and driven by the source's step loop between
its steps, through a DEALER socket to the destination, as Llumnix's migration does
between vLLM instances; the destination answers between its steps. The messages are
engine/wire.py's, each a header frame through its codec (the K/V frames follow it raw):

  source -> destination                               destination -> source
  Reserve(rid, seq, offer, ticket)                    Ok(rid, seq, {"cached_blocks", ...})
  Write(rid, seq, start, kv_header) + K/V frames      Ok(rid, seq, {})
  Commit(rid, seq, state, skip, kv_header, deadline) + K/V frames
                                                      Ok(rid, seq, commit's result)
  Check(rid, seq, offer, ticket) (stop-and-copy)      Ok(rid, seq, {"cached_blocks"})
  Cancel(rid, seq)     (the source gave up: the held blocks go back)
  Abort(rid, seq)      (the request was cancelled while its commit was in flight)
  a refusal: Err(rid, seq, Refusal(error type, message))

Who may talk on the port: on one machine (ipc://) only this user's processes, by the
folder's mode; over tcp:// the socket speaks CurveZMQ with key pairs derived from the
deployment's secret (engine/keys.py), and its ZAP handler admits only the deployment's
client key, so a peer without the secret cannot complete the handshake and never
reaches this code (it learns nothing: no model, no counts, no error text). A move's
first message carries the ticket the service signed for it (engine/transfer/ticket.py):
this request, from that engine, to this one, once, before a deadline. Every later
message of the move must come from the connection that opened it; `cancel` and `abort`
touch only the moves that connection opened. What a message carries is checked before
it touches the engine: the header frame's size and schema (the codec: a malformed one is
refused if it opens a move or is its opener's, else dropped), the state field by field
(engine/transfer/check.py), the K/V frames' sizes against the blocks they declare and the
blocks the move may fill (Runner.blocks_from_frames), and no frame may exceed the
largest legitimate one (ZMQ_MAXMSGSIZE, from the longest request this engine takes). A
structured-output constraint is compiled on the compile thread while its message waits
beside the loop, never on it.

Staged (the default): the destination holds blocks for the request's full computed
blocks; the source sends them STAGE_BLOCKS at a time, one message in flight, while the
request keeps decoding; once every held block is sent, the request leaves the source's
batch and the commit carries its state and the blocks computed since (a few), so the
pause does not grow with the context. Stop-and-copy (staged False) sends everything in
the commit; a fork (n > 1) always moves so, its samples together, and so does a request
of an engine with sliding windows or layer groups. Blocks the destination caches under the same hashes are never sent.

K/V travels as ZMQ frames sent without a copy from the runner's host buffer
(`Runner.blocks_to_frames`: a CUDA engine reads its blocks into pinned memory) and read
without a copy on arrival (`blocks_from_frames`). `HostFrames` is the one transport; a
GPU-to-GPU one (NIXL: the destination reads the source's registered blocks) would take
its place behind the same two calls, the header then naming remote memory instead of
carrying it.

Failures: a destination that refuses (full, another model or block size, paused or
draining), answers nothing within LINK_TIMEOUT_S or dies: the request runs on at the
source, and the source tells the destination to give back what it held. A source that
stops talking (it died mid-copy): the destination gives its held blocks back after
HOLD_TIMEOUT_S. A commit carries a deadline: a destination that reaches it too late
refuses it, and the source waits for its answer until the deadline and COMMIT_GRACE_S
more before it takes the request back, so a request never runs at both ends.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq
from zmq.utils import z85

from engine import keys, wire
from engine.transfer import check as move_check, ticket as move_ticket
from engine.errors import (CommandExpired, EngineError, InvalidRequestError, InvalidStateError,
                           MalformedMessage, MigrationFailed, MigrationRefused, error_from_wire)
from engine.kv.layout import cdiv
from engine.sampling_params import MAX_N

log = logging.getLogger("engine.migration")

LINK_TIMEOUT_S = 10.0  # a destination silent this long on one message has failed
COMMIT_TIMEOUT_S = 5.0  # a commit must reach the destination within this
COMMIT_GRACE_S = 1.0  # its answer may take this much longer to come back
HOLD_TIMEOUT_S = 30.0  # destination: a held copy its source forgot is given back
STAGE_BLOCKS = 64  # blocks staged between two steps, over every move under way
GRAMMAR_COMPILE_S = 30.0  # a move's constraint compiles within this, or the move is refused
HEADER_BYTES_PER_TOKEN = 512  # a state's bytes per token (ids, logprobs), at most
ANSWER_BYTES = 1 << 20  # an answer's largest frame
ZAP_DOMAIN = b"kvops-migration"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # (where libzmq asks, in the port's context)

Reply = Callable[[bool, Any], None]  # (ok, result or [error type, message])


_ANSWERS = wire.Codec(wire.PeerAnswer, ANSWER_BYTES)  # what a destination answers


def _in_parts(state: dict) -> bool:
    """Whether a commit's K/V comes in parts: a fork's samples, or layer groups."""
    return bool(state.get("fork")) or state.get("groups") is not None


class HostFrames:
    """K/V through host memory, as ZMQ frames (the runner's own encoding)."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def encode(self, data) -> tuple[dict, list]:
        if data is None:
            return {"kind": "none"}, []
        return self.runner.blocks_to_frames(data)

    def decode(self, header: object, frames: list, most: int):
        """At most `most` blocks (checked before anything is decoded: ValueError)."""
        if isinstance(header, dict) and header.get("kind") == "none":
            return None
        return self.runner.blocks_from_frames(header, frames, most)


@dataclasses.dataclass
class _Move:
    """A request this core is sending to another (source side)."""
    request_id: str
    to: str
    address: str
    staged: bool
    reply: Reply
    deadline: float  # Unix time: the caller's
    reason: str = "migration"  # or "decode": a prefill engine's hand-over
    phase: str = "offer"  # reserve/check -> stage -> commit
    seq: int = 0  # of the message whose answer is awaited (0: none)
    sent_at: float = 0.0  # monotonic, of that message
    commit_deadline: float = 0.0  # Unix time
    next_block: int = 0  # the first block not sent yet
    held_end: int = 0  # the destination holds blocks below this
    cached: int = 0  # leading blocks cached there (never sent)
    bytes_sent: int = 0
    blocks_sent: int = 0
    stages: int = 0
    stop_blocks: int = 0  # blocks sent with the commit, the request stopped
    started: float = dataclasses.field(default_factory=time.monotonic)
    stopped: float = 0.0  # when the request left the batch


@dataclasses.dataclass
class _Incoming:
    """A move into this core that its ticket opened (destination side)."""
    peer: bytes  # the connection that opened it: the only one its messages may come from
    ticket: move_ticket.Ticket
    last: float  # monotonic: its last message
    held: bool  # blocks are held here for it (a staged copy)


class _Parked(Exception):
    """The message waits beside the loop for its constraint to compile."""


class _Ignored(Exception):
    """The message is dropped unanswered: it is not the sending connection's to send."""


class MigrationLink:
    """A core's end of the moves: its ROUTER (requests coming in) and its DEALERs (one
    per destination, requests going out). Called on the step loop's thread only."""

    def __init__(self, engine, secret: str, host: str = "", port: int = 0,
                 transport=None) -> None:
        """secret: the deployment's (EngineConfig.secret): the port's keys and the tickets'
        come from it; host: "" for ipc:// in a private folder (one machine), else the
        host to bind on tcp:// ("0.0.0.0": every interface, the machine's name given)."""
        self.engine = engine
        self.name = engine.config.name
        self.transport = transport or HostFrames(engine.runner)
        self._ticket_key = keys.derive(secret, "migration ticket")
        self._server_public, server_secret = keys.curve_pair(secret, "server")
        self._client_public, self._client_secret = keys.curve_pair(secret, "client")
        self.header_bytes, self.frame_bytes = _limits(engine)
        # the moves' messages, in (checked before they are served) and out
        self._codec = wire.Codec(wire.PeerRequest, self.header_bytes)
        # Sockets of a context of its own (with its own ZAP handler, over tcp)
        self.context = zmq.Context()
        self._zap = None
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, max(self.header_bytes, self.frame_bytes))
        self._dir = None
        if not host:
            # One machine: a socket file in a folder only this user may enter (mkdtemp
            # makes it 0700), so only this user's processes connect, and K/V moves in the
            # clear at memory speed (CurveZMQ costs about four times that on a core)
            self._dir = tempfile.mkdtemp(prefix="kvops-migration-")
            self.address = f"ipc://{self._dir}/link"
            self.router.bind(self.address)
        else:
            # Between machines: CurveZMQ, its handshake admitting only the deployment's
            # client key. libzmq asks the context's ZAP handler (RFC 27) about each
            # handshake, and admits every client when none is bound, so it is bound
            # before the port; it is served on the step loop beside the port (_answer_zap)
            self._zap = self.context.socket(zmq.REP)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind(ZAP_ENDPOINT)
            self.router.curve_server = True
            self.router.curve_secretkey = server_secret
            self.router.zap_domain = ZAP_DOMAIN
            bind_host = "0.0.0.0" if host in ("0.0.0.0", "*") else host
            if port:
                self.router.bind(f"tcp://{bind_host}:{port}")
            else:
                port = self.router.bind_to_random_port(f"tcp://{bind_host}")
            self.address = f"tcp://{socket.gethostname() if bind_host == '0.0.0.0' else host}:{port}"
        self._out: dict[str, zmq.Socket] = {}  # destination address -> DEALER
        self._moves: dict[str, _Move] = {}  # request id -> its move out
        self._incoming: dict[str, _Incoming] = {}  # request id -> its move in
        self._arrived: dict[str, tuple[bytes, float]] = {}  # moved in: (peer, until when
        #                                                     its source may still abort it)
        self._used: dict[str, float] = {}  # tickets' nonces -> their expiry
        self._next_purge = 0.0  # (Unix time) when expired nonces are forgotten next
        self._parked: list[tuple[bytes, wire.PeerRequest, list, Future, float]] = []  # (a grammar)
        self._seq = 0

    # --- sockets -------------------------------------------------------------------------
    def sockets(self) -> list[zmq.Socket]:
        return [self.router, *self._out.values(), *([self._zap] if self._zap else [])]

    def _answer_zap(self) -> None:
        """Answer each waiting ZAP request (RFC 27: version, request id, domain, address,
        identity, mechanism, credentials): 200 for a CURVE client with the deployment's
        client key on the port's domain, 400 for anything else."""
        while True:
            try:
                request = self._zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ok = len(request) == 7 and request[0] == b"1.0" and request[2] == ZAP_DOMAIN \
                and request[5] == b"CURVE" and z85.encode(request[6]) == self._client_public
            version = request[0] if request else b"1.0"
            request_id = request[1] if len(request) > 1 else b""
            self._zap.send_multipart([version, request_id, b"200" if ok else b"400",
                                      b"OK" if ok else b"not of this deployment",
                                      b"deployment" if ok else b"", b""])

    def on_readable(self, sock: zmq.Socket) -> None:
        """Handle every message waiting on `sock`."""
        if sock is self._zap:
            self._answer_zap()
            return
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if sock is self.router:  # [peer, header, K/V frames...]
                if 2 <= len(frames) <= 2 + 2 * max(MAX_N, 8):
                    self._receive(frames[0].bytes, frames[1].buffer,
                                  [f.buffer for f in frames[2:]])
                else:
                    log.warning("migration link: a message of %d frames was dropped",
                                len(frames))
            else:
                self._answered(frames[0].buffer)

    @property
    def busy(self) -> bool:
        """Whether a move out waits for this core's loop (a stage to send)."""
        return any(m.phase == "stage" and not m.seq for m in self._moves.values())

    def close(self) -> None:
        for move in list(self._moves.values()):
            self._give_up(move, InvalidStateError("the engine core is stopping"))
        for rid in list(self._incoming):
            self._let_go(rid)
        for sock in self.sockets():
            sock.close(linger=0)
        self.context.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # --- source side ---------------------------------------------------------------------
    def start(self, arguments: dict, deadline: float | None, reply: Reply) -> None:
        """Begin moving a running request (the "migrate" command); `reply` is called once
        it runs at the destination, or could not move. Raises at once what is wrong with
        the command itself."""
        rid = arguments.get("request_id")
        address = arguments.get("address")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("`request_id` must be a non-empty string")
        if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
            raise InvalidRequestError("`address` must be the destination's migration address "
                                      "(tcp:// or ipc://)")
        if address == self.address:
            raise InvalidRequestError("a request cannot move to the engine it runs on")
        ticket = arguments.get("ticket")
        if not isinstance(ticket, dict):
            raise InvalidRequestError("`ticket` must be the move's ticket, signed by the "
                                      "service (engine/transfer/ticket.py)")
        if rid in self._moves:
            raise InvalidStateError(f"request {rid!r} is already moving")
        offer = self.engine.migrator.offer(rid)
        move = _Move(rid, str(arguments.get("to") or address), address,
                     bool(arguments.get("staged", True)) and not offer.get("fork")
                     and offer.get("groups") is None, reply,
                     deadline if deadline is not None else time.time() + 2 * LINK_TIMEOUT_S,
                     "decode" if arguments.get("reason") == "decode" else "migration")
        move.phase = "reserve" if move.staged else "check"
        opening = wire.Reserve if move.staged else wire.Check
        self._send(move, opening(rid, 0, offer, ticket))
        self._moves[rid] = move

    def advance(self) -> None:
        """Between two steps: send the next stage of every move that may, give up on those
        whose destination is silent."""
        now = time.monotonic()
        budget = STAGE_BLOCKS  # blocks staged between two steps, over every move
        for move in list(self._moves.values()):
            if move.phase != "commit" and time.time() > move.deadline:
                self._give_up(move, CommandExpired(
                    f"request {move.request_id!r} had not moved by its caller's deadline; "
                    "it runs on here"))
            elif move.seq:
                limit = (move.commit_deadline + COMMIT_GRACE_S - time.time()
                         if move.phase == "commit" else move.sent_at + LINK_TIMEOUT_S - now)
                if limit < 0:
                    self._give_up(move, InvalidStateError(
                        f"engine {move.to} did not answer ({move.phase}) in time"))
            elif move.phase == "stage" and (budget > 0 or move.next_block >= move.held_end):
                try:
                    budget -= self._stage(move, budget)
                except EngineError as e:  # ended or preempted here meanwhile
                    self._give_up(move, e)

    def _stage(self, move: _Move, budget: int) -> int:
        """Send up to `budget` of the move's held blocks, or stop it once all are sent;
        the blocks sent."""
        if move.next_block >= move.held_end:
            self._stop(move)
            return 0
        end = min(move.held_end, move.next_block + budget)
        data, end = self.engine.migrator.stage(move.request_id, move.next_block, end)
        if end <= move.next_block:  # (nothing newly full: cannot happen below held_end)
            self._stop(move)
            return 0
        header, frames = self.transport.encode(data)
        self._send(move, wire.Write(move.request_id, 0, move.next_block, header), frames)
        sent = end - move.next_block
        move.blocks_sent += sent
        move.next_block = end
        move.stages += 1
        return sent

    def _stop(self, move: _Move) -> None:
        """The request leaves the batch; its state and its last blocks go. The commit's
        deadline and the wait for its answer end within the caller's deadline: a move is
        never done after its caller gave up."""
        commit_deadline = min(time.time() + COMMIT_TIMEOUT_S, move.deadline - 2 * COMMIT_GRACE_S)
        if commit_deadline - time.time() < 0.05:
            raise CommandExpired(f"request {move.request_id!r}: too little time is left "
                                 "before its caller's deadline to move it")
        state, data = self.engine.migrator.take_out(move.request_id, move.next_block)
        move.stopped = time.monotonic()
        move.phase = "commit"
        move.commit_deadline = commit_deadline
        header, frames = self._encode(state, data)
        runner = self.engine.runner
        n = sum(runner.num_blocks_in(d) for d in data if d is not None) \
            if _in_parts(state) else runner.num_blocks_in(data) if data is not None else 0
        move.blocks_sent += n
        move.stop_blocks = n
        self._send(move, wire.Commit(move.request_id, 0, state, move.next_block, header,
                                     move.commit_deadline), frames)

    def _encode(self, state: dict, data) -> tuple[dict, list]:
        """The commit's K/V: a fork's, each sample's in turn; a windowed engine's, each
        layer group's (their frames counted)."""
        if not _in_parts(state):
            return self.transport.encode(data)
        parts, frames = [], []
        for d in data:
            header, more = self.transport.encode(d)
            parts.append({**header, "frames": len(more)})
            frames += more
        return {"kind": "parts", "parts": parts}, frames

    def _send(self, move: _Move, message: wire.PeerRequest, frames: list = ()) -> None:
        """Send a message of the move, its answer awaited (MalformedMessage, nothing sent,
        for one over the header's limit)."""
        self._seq += 1
        message.seq = self._seq
        data = self._codec.encode(message)
        move.seq, move.sent_at = self._seq, time.monotonic()
        sock = self._out.get(move.address)
        if sock is None:
            sock = self._out[move.address] = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, ANSWER_BYTES)
            if move.address.startswith("tcp://"):
                # every engine of the deployment serves with the same derived key pair
                sock.curve_serverkey = self._server_public
                sock.curve_publickey = self._client_public
                sock.curve_secretkey = self._client_secret
            sock.connect(move.address)
        move.bytes_sent += sum(memoryview(f).nbytes for f in frames)
        sock.send_multipart([data, *frames], copy=False)

    def _tell(self, move: _Move, message_type: type[wire.Cancel | wire.Abort]) -> None:
        """A message the destination does not answer (Cancel, Abort)."""
        sock = self._out.get(move.address)
        if sock is not None:
            self._seq += 1
            sock.send_multipart([self._codec.encode(message_type(move.request_id, self._seq))])

    def _answered(self, data: memoryview) -> None:
        try:
            answer = _ANSWERS.decode(data)
        except MalformedMessage as e:
            self._answered_malformed(data, e)
            return
        move = self._moves.get(answer.request_id)
        if move is None or move.seq != answer.seq:  # (an answer to a move given up on)
            return
        move.seq = 0
        if isinstance(answer, wire.Err):
            error = answer.error
            self._give_up(move, error_from_wire(error.type, f"engine {move.to} refused: "
                                                f"{error.message}"),
                          tell=move.phase != "commit")
            return
        payload = answer.result
        if move.phase in ("reserve", "check"):
            cached, reserved = payload.get("cached_blocks"), payload.get("reserved_blocks", 0)
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                       for x in (cached, reserved)):
                self._give_up(move, MigrationFailed(f"engine {move.to} answered a malformed "
                                                    f"{move.phase}"))
                return
            move.cached = move.next_block = cached
            move.held_end = move.cached + reserved
            move.phase = "stage"  # (its stages go from advance(), within its budget)
            if not move.staged:
                try:
                    self._stop(move)
                except EngineError as e:
                    self._give_up(move, e)
        elif move.phase == "stage":
            return  # the next stage goes from advance()
        elif move.phase == "commit":
            self._finish(move, payload)

    def _answered_malformed(self, data: memoryview, error: MalformedMessage) -> None:
        """An answer not of the protocol gives its move up, if it names one that awaits
        it; anything else is dropped."""
        head = _ANSWERS.head(data, 3)
        move = self._moves.get(head[1]) if head is not None and type(head[1]) is str else None
        if move is None or type(head[2]) is not int or move.seq != head[2]:
            log.warning("migration link: a malformed answer was dropped: %s", error)
            return
        move.seq = 0
        self._give_up(move, MigrationFailed(f"engine {move.to} answered {head[0]!r} "
                                            f"malformed: {error}"))

    def _finish(self, move: _Move, committed: dict) -> None:
        del self._moves[move.request_id]
        engine = self.engine
        if not self._out_of_batch(move.request_id):
            # cancelled here while its commit was in flight: it ends there too
            self._tell(move, wire.Abort)
            move.reply(False, ["InvalidStateError", f"request {move.request_id!r} was "
                               "cancelled while it moved"])
            return
        engine.migrator.done(move.request_id, True, move.to, move.reason)
        now = time.monotonic()
        move.reply(True, {
            "request_id": move.request_id, "to": move.to, "moved": True,
            "staged": move.staged, "stages": move.stages,
            "blocks_sent": move.blocks_sent, "blocks_at_stop": move.stop_blocks,
            "blocks_cached": move.cached,
            "bytes_sent": move.bytes_sent,
            "pause_ms": round(1000 * (now - move.stopped), 2),
            "ms": round(1000 * (now - move.started), 2),
            "num_blocks": committed.get("num_blocks")})

    def _out_of_batch(self, request_id: str) -> bool:
        """Whether the request (a fork: all its samples) waits out of the batch for its
        commit's answer, as the stop left it (not cancelled meanwhile)."""
        scheduler = self.engine.scheduler
        ids = scheduler.forks.get(request_id, [request_id])
        return all(i in scheduler.suspended for i in ids)

    def _give_up(self, move: _Move, error: Exception, tell: bool = True) -> None:
        """The move failed: the request runs on here; the destination lets go."""
        self._moves.pop(move.request_id, None)
        if self._out_of_batch(move.request_id):
            self.engine.migrator.done(move.request_id, False)
        if tell and move.phase != "offer":
            self._tell(move, wire.Cancel)
        log.warning("request %s did not move to %s: %s", move.request_id, move.to, error)
        move.reply(False, [type(error).__name__, str(error)])

    # --- destination side ----------------------------------------------------------------
    def _receive(self, peer: bytes, header: memoryview, data: list) -> None:
        """A message from a peer: its header decoded and checked whole, then served."""
        try:
            message = self._codec.decode(header)
        except MalformedMessage as e:
            self._refuse(peer, header, e)
            return
        self._serve(peer, message, data)

    def _refuse(self, peer: bytes, header: memoryview, error: MalformedMessage) -> None:
        """A message not of the protocol is refused as one of its kind would be: a move's
        opening from anyone, a write or commit from the connection whose move it names
        (a commit's held blocks then go back); anything else is dropped unanswered."""
        head = self._codec.head(header, 3)
        if head is None or type(head[1]) is not str or type(head[2]) is not int:
            log.warning("migration link: a malformed message was dropped: %s", error)
            return
        kind, rid, seq = head
        incoming = self._incoming.get(rid)
        if kind not in (wire.Kind.RESERVE, wire.Kind.CHECK) and not (
                kind in (wire.Kind.WRITE, wire.Kind.COMMIT) and incoming is not None
                and incoming.peer == peer):
            log.warning("migration link: a malformed %r of %r was dropped: %s", kind, rid, error)
            return
        self._failed(rid, kind, peer)
        self._answer(peer, wire.Err(rid, seq, wire.Refusal.of(error)))

    def _serve(self, peer: bytes, message: wire.PeerRequest, data: list) -> None:
        kind, rid, seq = wire.kind_of(message), message.request_id, message.seq
        try:
            result = self._apply(peer, message, data)
        except _Parked:
            return
        except _Ignored as e:
            log.warning("migration link: %s %s from a peer ignored: %s", kind, rid, e)
            return
        except EngineError as e:
            self._failed(rid, kind, peer)
            self._answer(peer, wire.Err(rid, seq, wire.Refusal.of(e)))
            return
        except (KeyError, TypeError, ValueError) as e:  # (a state not of its kind's shape)
            self._failed(rid, kind, peer)
            self._answer(peer, wire.Err(rid, seq, wire.Refusal(
                "InvalidRequestError", f"a malformed {kind}: {e}")))
            return
        except Exception as e:  # noqa: BLE001  (said to the source; this core goes on)
            log.exception("moving request %s in: %s failed", rid, kind)
            self._failed(rid, kind, peer)
            self._answer(peer, wire.Err(rid, seq, wire.Refusal.of(e)))
            return
        if result is not None:
            self._answer(peer, wire.Ok(rid, seq, result))

    def _apply(self, peer: bytes, message: wire.PeerRequest, data: list) -> dict | None:
        """A message's effect here, and its answer (None: none is sent)."""
        engine, rid = self.engine, message.request_id
        if isinstance(message, (wire.Reserve, wire.Check)):
            offer, reserve = message.offer, isinstance(message, wire.Reserve)
            checked = self._opens(rid, offer, message.ticket)
            self._compiled(peer, message, data, offer)
            result = engine.migrator.reserve(offer) if reserve else engine.migrator.check(offer)
            self._incoming[rid] = _Incoming(peer, checked, time.monotonic(), reserve)
            self._used[checked.nonce] = checked.expires
            return result
        if isinstance(message, wire.Abort):  # (cancelled while its commit was in flight)
            arrived = self._arrived.get(rid)
            if arrived is None or arrived[0] != peer:
                raise _Ignored("no move of this connection's just committed this request")
            del self._arrived[rid]
            try:
                engine.abort(rid)
            except EngineError:  # (it ended meanwhile)
                pass
            return None
        move = self._own(peer, rid)
        move.last = time.monotonic()
        if isinstance(message, wire.Write):
            if not move.held:
                raise InvalidRequestError(f"no blocks are held for request {rid!r}")
            most = engine.migrator.room(rid, message.start)
            engine.migrator.write(rid, message.start,
                                  self.transport.decode(message.kv_header, data, most))
            return {}
        if isinstance(message, wire.Commit):
            state = message.state
            if time.time() > message.deadline:
                raise MigrationFailed(f"request {rid!r}: its commit came too late")
            self._checked(rid, state, move.ticket)
            self._compiled(peer, message, data, state)
            blocks = self._decode(message.kv_header, data,
                                  engine.migrator.commit_blocks(state, message.skip))
            result = engine.migrator.commit(state, blocks, message.skip)
            del self._incoming[rid]
            self._arrived[rid] = (peer, time.monotonic() + COMMIT_TIMEOUT_S + COMMIT_GRACE_S)
            return result
        self._let_go(rid)  # Cancel
        return None

    def _opens(self, rid: str, offer: object, ticket: object) -> move_ticket.Ticket:
        """A move's first message: its ticket (for this request, to this engine, unused)
        and its offer, checked whole."""
        if rid in self._incoming:
            raise InvalidRequestError(f"request {rid!r} is already being copied here")
        checked = move_ticket.verify(self._ticket_key, ticket, self.name)
        if checked.request_id != rid:
            raise MigrationRefused(f"the move's ticket is for request {checked.request_id!r}")
        if checked.nonce in self._used:
            raise MigrationRefused("the move's ticket was used already")
        self._checked(rid, offer, checked)
        return checked

    def _checked(self, rid: str, state: object, ticket: move_ticket.Ticket | None) -> None:
        """The state whole (engine/transfer/check.py), and that it is the ticket's request,
        from the ticket's engine, of the ticket's job."""
        engine = self.engine
        move_check.check_state(move_check.Destination(
            engine.runner.vocab_size, engine.config.block_size, engine.max_model_len,
            engine.kv.num_groups), state)
        if state["request_id"] != rid:
            raise InvalidRequestError(f"the state is of request {state['request_id']!r}, "
                                      f"not {rid!r}")
        if ticket is not None and (state["engine"] != ticket.source or
                                   (ticket.job_id is not None and
                                    state["job_id"] != ticket.job_id)):
            raise MigrationRefused(f"request {rid!r} is not the ticket's: another engine's "
                                   "or another job's")

    def _compiled(self, peer: bytes, message: wire.PeerRequest, data: list,
                  state: dict) -> None:
        """Raise _Parked, the message kept beside the loop, while the state's constraint
        compiles on the compile thread (it is served again once compiled)."""
        spec = state["params"].get("structured")
        if spec is None:
            return
        future = self.engine.input_processor.structured_outputs().compile(spec)
        if not future.done():
            self._parked.append((peer, message, data, future, time.monotonic()))
            raise _Parked

    def _own(self, peer: bytes, rid: str) -> _Incoming:
        """The move in of `rid`, if this connection opened it (_Ignored otherwise: a
        peer's message about another's move, or about none, is dropped unanswered)."""
        move = self._incoming.get(rid)
        if move is None or move.peer != peer:
            raise _Ignored("no move of this connection's goes by this request id")
        return move

    def _failed(self, rid: str, kind: str, peer: bytes) -> None:
        """A failed commit lets its held blocks go (the request runs on at the source)."""
        move = self._incoming.get(rid)
        if kind == "commit" and move is not None and move.peer == peer:
            self._let_go(rid)

    def _decode(self, header: object, frames: list, counts: list[int] | int):
        """The commit's K/V: `counts` blocks (a fork's or a windowed engine's: a count per
        part), each part's header and frames checked before it is decoded."""
        if not isinstance(counts, list):
            data = self.transport.decode(header, frames, counts)
            if data is not None and self.engine.runner.num_blocks_in(data) != counts:
                raise InvalidRequestError(f"{counts} blocks were to come with the commit")
            return data
        if not isinstance(header, dict) or header.get("kind") != "parts" or \
                not isinstance(header.get("parts"), list) or len(header["parts"]) != len(counts):
            raise InvalidRequestError("the commit's K/V must come in one part per sample or "
                                      "layer group")
        out, at = [], 0
        for part, n in zip(header["parts"], counts):
            taken = part.get("frames") if isinstance(part, dict) else None
            if not isinstance(taken, int) or not 0 <= taken <= len(frames) - at:
                raise InvalidRequestError("the commit's parts name frames it does not have")
            out.append(self._decode(part, frames[at:at + taken], n))
            at += taken
        return out

    def _answer(self, peer: bytes, message: wire.PeerAnswer) -> None:
        self.router.send_multipart([peer, _ANSWERS.encode(message)])

    def _let_go(self, rid: str) -> None:
        self._incoming.pop(rid, None)
        if rid in self.engine.migrator.incoming:
            self.engine.migrator.cancel(rid)

    def expire(self) -> None:
        """Serve the messages whose constraint has compiled; give back the blocks held for
        copies whose source stopped talking or whose ticket ran out; forget used tickets
        once they have expired."""
        if self._parked:
            parked, self._parked = self._parked, []
            for peer, message, data, future, since in parked:
                if future.done():
                    self._serve(peer, message, data)
                elif time.monotonic() - since > GRAMMAR_COMPILE_S:
                    self._answer(peer, wire.Err(message.request_id, message.seq, wire.Refusal(
                        "MigrationFailed", "its structured-output constraint did not compile "
                        f"within {GRAMMAR_COMPILE_S:.0f} s")))
                else:
                    self._parked.append((peer, message, data, future, since))
        now, wall = time.monotonic(), time.time()
        for rid, move in list(self._incoming.items()):
            if now - move.last > HOLD_TIMEOUT_S or wall > move.ticket.expires + HOLD_TIMEOUT_S:
                log.warning("request %s: its source stopped sending it; the blocks held "
                            "for it go back", rid)
                self._let_go(rid)
        for rid, (_, until) in list(self._arrived.items()):
            if now > until:
                del self._arrived[rid]
        if wall > self._next_purge:  # (tickets live as long as a job: purged now and then)
            self._next_purge = wall + 1.0
            for nonce, expires in list(self._used.items()):
                if wall > expires:
                    del self._used[nonce]


def _limits(engine) -> tuple[int, int]:
    """(header, K/V frame): the largest frames a legitimate move into this engine sends.
    A state weighs at most HEADER_BYTES_PER_TOKEN a token (ids, logprobs), for every
    sample of the largest fork; a K/V frame holds at most the longest request's blocks
    (the simulator's weight frame: its bytes per token in every slot)."""
    runner = engine.runner
    blocks = cdiv(engine.max_model_len, engine.config.block_size) + 1
    per_block = max(runner.block_bytes, engine.config.block_size *
                    getattr(runner, "kv_bytes_per_token", 0))
    return (1 << 20) + MAX_N * engine.max_model_len * HEADER_BYTES_PER_TOKEN, blocks * per_block
