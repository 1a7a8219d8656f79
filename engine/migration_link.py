"""Requests moving between engine cores over ZMQ: engine/migration.py's steps with each
engine in a process (or on a machine) of its own.

Every core binds a ROUTER socket at its migration address (tcp://host:port, in its
`describe_config()` as "migration_address"). A move is started by a command to the
source core ("migrate": request_id, address, to, staged) and driven by the source's step
loop between its steps, through a DEALER socket to the destination, as Llumnix's
migration does between vLLM instances; the destination answers between its steps:

  source -> destination                               destination -> source
  ["reserve", rid, seq, offer]                        ["ok", rid, seq, {"cached_blocks"}]
  ["write", rid, seq, start, header] + K/V frames     ["ok", rid, seq, {}]
  ["commit", rid, seq, state, skip, header, deadline] + K/V frames
                                                      ["ok", rid, seq, commit's result]
  ["check", rid, seq, offer]         (stop-and-copy)  ["ok", rid, seq, {"cached_blocks"}]
  ["cancel", rid, seq]     (the source gave up: the held blocks go back)
  ["abort", rid, seq]      (the request was cancelled while its commit was in flight)
  a refusal: ["err", rid, seq, [error type, message]]

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
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from engine.errors import (CommandExpired, EngineError, InvalidRequestError, InvalidStateError,
                           MigrationFailed, error_from_wire)

log = logging.getLogger("engine.migration")

LINK_TIMEOUT_S = 10.0  # a destination silent this long on one message has failed
COMMIT_TIMEOUT_S = 5.0  # a commit must reach the destination within this
COMMIT_GRACE_S = 1.0  # its answer may take this much longer to come back
HOLD_TIMEOUT_S = 30.0  # destination: a held copy its source forgot is given back
STAGE_BLOCKS = 64  # blocks staged between two steps, over every move under way

Reply = Callable[[bool, Any], None]  # (ok, result or [error type, message])


def _pack(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def _unpack(data) -> list:
    return msgpack.unpackb(data, raw=False)


def _in_parts(state: dict) -> bool:
    """Whether a commit's K/V comes in parts: a fork's samples, or layer groups."""
    return bool(state.get("fork")) or state.get("groups") is not None


def _header(data: bytes, fields: int) -> list | None:
    """A message's header, [kind, request id, sequence number, ...] with at least
    `fields` fields; None, said in the log, for anything else (a stray or hostile peer on
    the port: dropped, the loop goes on)."""
    try:
        message = _unpack(data)
    except Exception:  # noqa: BLE001  (msgpack's errors for any bytes at all)
        message = None
    if isinstance(message, list) and len(message) >= fields and \
            isinstance(message[0], str) and isinstance(message[1], str) and \
            isinstance(message[2], int):
        return message
    log.warning("migration link: a malformed message was dropped (%d bytes)", len(data))
    return None


class HostFrames:
    """K/V through host memory, as ZMQ frames (the runner's own encoding)."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def encode(self, data) -> tuple[dict, list]:
        if data is None:
            return {"kind": "none"}, []
        return self.runner.blocks_to_frames(data)

    def decode(self, header: dict, frames: list):
        if header.get("kind") == "none":
            return None
        return self.runner.blocks_from_frames(header, frames)


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


class MigrationLink:
    """A core's end of the moves: its ROUTER (requests coming in) and its DEALERs (one
    per destination, requests going out). Called on the step loop's thread only."""

    def __init__(self, engine, context: zmq.Context, host: str = "127.0.0.1",
                 port: int = 0, transport=None) -> None:
        self.engine = engine
        self.transport = transport or HostFrames(engine.runner)
        self.context = context
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        bind_host = "0.0.0.0" if host in ("0.0.0.0", "*") else host
        if port:
            self.router.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self.router.bind_to_random_port(f"tcp://{bind_host}")
        if bind_host == "0.0.0.0":
            import socket
            host = socket.gethostname()
        self.address = f"tcp://{host}:{port}"
        self._out: dict[str, zmq.Socket] = {}  # destination address -> DEALER
        self._moves: dict[str, _Move] = {}  # request id -> its move out
        self._held: dict[str, float] = {}  # request id -> last word from its source
        self._seq = 0

    # --- sockets -------------------------------------------------------------------------
    def sockets(self) -> list[zmq.Socket]:
        return [self.router, *self._out.values()]

    def on_readable(self, sock: zmq.Socket) -> None:
        """Handle every message waiting on `sock`."""
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if sock is self.router:  # [peer, header, K/V frames...]
                header = _header(frames[1].bytes if len(frames) > 1 else b"", 3)
                if header is not None:
                    self._serve(frames[0].bytes, header, [f.buffer for f in frames[2:]])
            else:
                header = _header(frames[0].bytes, 4)
                if header is not None:
                    self._answered(header)

    @property
    def busy(self) -> bool:
        """Whether a move out waits for this core's loop (a stage to send)."""
        return any(m.phase == "stage" and not m.seq for m in self._moves.values())

    def close(self) -> None:
        for move in list(self._moves.values()):
            self._give_up(move, InvalidStateError("the engine core is stopping"))
        for sock in self.sockets():
            sock.close(linger=0)

    # --- source side ---------------------------------------------------------------------
    def start(self, arguments: dict, deadline: float | None, reply: Reply) -> None:
        """Begin moving a running request (the "migrate" command); `reply` is called once
        it runs at the destination, or could not move. Raises at once what is wrong with
        the command itself."""
        rid = arguments.get("request_id")
        address = arguments.get("address")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("`request_id` must be a non-empty string")
        if not isinstance(address, str) or not address.startswith("tcp://"):
            raise InvalidRequestError("`address` must be the destination's tcp:// address")
        if address == self.address:
            raise InvalidRequestError("a request cannot move to the engine it runs on")
        if rid in self._moves:
            raise InvalidStateError(f"request {rid!r} is already moving")
        offer = self.engine.migration_offer(rid)
        move = _Move(rid, str(arguments.get("to") or address), address,
                     bool(arguments.get("staged", True)) and not offer.get("fork")
                     and offer.get("groups") is None, reply,
                     deadline if deadline is not None else time.time() + 2 * LINK_TIMEOUT_S,
                     "decode" if arguments.get("reason") == "decode" else "migration")
        self._moves[rid] = move
        move.phase = "reserve" if move.staged else "check"
        self._send(move, [move.phase, rid, 0, offer])

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
        data, end = self.engine.migration_stage(move.request_id, move.next_block, end)
        if end <= move.next_block:  # (nothing newly full: cannot happen below held_end)
            self._stop(move)
            return 0
        header, frames = self.transport.encode(data)
        self._send(move, ["write", move.request_id, 0, move.next_block, header], frames)
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
        state, data = self.engine.migrate_out(move.request_id, move.next_block)
        move.stopped = time.monotonic()
        move.phase = "commit"
        move.commit_deadline = commit_deadline
        header, frames = self._encode(state, data)
        runner = self.engine.runner
        n = sum(runner.num_blocks_in(d) for d in data if d is not None) \
            if _in_parts(state) else runner.num_blocks_in(data) if data is not None else 0
        move.blocks_sent += n
        move.stop_blocks = n
        self._send(move, ["commit", move.request_id, 0, state, move.next_block, header,
                          move.commit_deadline], frames)

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

    def _decode(self, header: dict, frames: list):
        if header.get("kind") != "parts":
            return self.transport.decode(header, frames)
        out, at = [], 0
        for part in header["parts"]:
            out.append(self.transport.decode(part, frames[at:at + part["frames"]]))
            at += part["frames"]
        return out

    def _send(self, move: _Move, message: list, frames: list = ()) -> None:
        self._seq += 1
        move.seq, move.sent_at = self._seq, time.monotonic()
        message[2] = move.seq
        sock = self._out.get(move.address)
        if sock is None:
            sock = self._out[move.address] = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(move.address)
        move.bytes_sent += sum(memoryview(f).nbytes for f in frames)
        sock.send_multipart([_pack(message), *frames], copy=False)

    def _tell(self, move: _Move, kind: str) -> None:
        """A message the destination does not answer ("cancel", "abort")."""
        sock = self._out.get(move.address)
        if sock is not None:
            self._seq += 1
            sock.send_multipart([_pack([kind, move.request_id, self._seq])])

    def _answered(self, message: list) -> None:
        kind, rid, seq, payload = message[:4]
        move = self._moves.get(rid)
        if move is None or move.seq != seq:  # (an answer to a move given up on)
            return
        move.seq = 0
        if kind != "ok":
            error_type, text = payload
            self._give_up(move, error_from_wire(error_type, f"engine {move.to} refused: {text}"),
                          tell=move.phase != "commit")
            return
        if move.phase in ("reserve", "check"):
            move.cached = move.next_block = payload["cached_blocks"]
            move.held_end = move.cached + payload.get("reserved_blocks", 0)
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

    def _finish(self, move: _Move, committed: dict) -> None:
        del self._moves[move.request_id]
        engine = self.engine
        if not self._out_of_batch(move.request_id):
            # cancelled here while its commit was in flight: it ends there too
            self._tell(move, "abort")
            move.reply(False, ["InvalidStateError", f"request {move.request_id!r} was "
                               "cancelled while it moved"])
            return
        engine.migration_done(move.request_id, True, move.to, move.reason)
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
            self.engine.migration_done(move.request_id, False)
        if tell and move.phase != "offer":
            self._tell(move, "cancel")
        log.warning("request %s did not move to %s: %s", move.request_id, move.to, error)
        move.reply(False, [type(error).__name__, str(error)])

    # --- destination side ----------------------------------------------------------------
    def _serve(self, peer: bytes, message: list, data: list) -> None:
        kind, rid, seq = message[0], message[1], message[2]
        engine = self.engine
        try:
            if kind == "reserve":
                result = engine.migration_reserve(message[3])
                self._held[rid] = time.monotonic()
            elif kind == "check":
                result = engine.migration_check(message[3])
            elif kind == "write":
                self._held[rid] = time.monotonic()
                engine.migration_write(rid, message[3], self.transport.decode(
                    message[4], data))
                result = {}
            elif kind == "commit":
                _, _, _, state, skip, header, deadline = message
                if time.time() > deadline:
                    raise MigrationFailed(f"request {rid!r}: its commit came too late")
                result = engine.migration_commit(state, self._decode(header, data), skip)
                self._held.pop(rid, None)
            elif kind == "cancel":
                self._let_go(rid)
                return
            elif kind == "abort":
                try:
                    engine.abort(rid)
                except EngineError:
                    pass
                return
            else:
                raise InvalidRequestError(f"unknown message {kind!r}")
        except EngineError as e:
            if kind == "commit":
                self._let_go(rid)
            self._answer(peer, ["err", rid, seq, [type(e).__name__, str(e)]])
            return
        except Exception as e:  # noqa: BLE001  (said to the source; this core goes on)
            log.exception("moving request %s in: %s failed", rid, kind)
            if kind == "commit":
                self._let_go(rid)
            self._answer(peer, ["err", rid, seq, [type(e).__name__, str(e)]])
            return
        self._answer(peer, ["ok", rid, seq, result])

    def _answer(self, peer: bytes, message: list) -> None:
        self.router.send_multipart([peer, _pack(message)])

    def _let_go(self, rid: str) -> None:
        self._held.pop(rid, None)
        if rid in self.engine.incoming_migrations:
            self.engine.migration_cancel(rid)

    def expire(self) -> None:
        """Give back the blocks held for copies whose source stopped talking."""
        if not self._held:
            return
        now = time.monotonic()
        for rid, last in list(self._held.items()):
            if now - last > HOLD_TIMEOUT_S:
                log.warning("request %s: its source stopped sending it; the blocks held "
                            "for it go back", rid)
                self._let_go(rid)
