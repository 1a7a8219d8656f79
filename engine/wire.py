"""Every message that crosses an engine's sockets, as typed structs, and the one codec.

Two protocols, both msgpack over ZMQ (docs/design.md, "The core protocol"):

* the core protocol, between a worker's engine client (engine/serve/client.py) and its
  engine core (engine/serve/core_proc.py): ToCore in, FromCore out;
* the migration protocol, between two cores' migration links (engine/transfer/link.py):
  PeerRequest from the source, PeerAnswer from the destination; the K/V travels beside
  the header as raw frames, never through the codec.

A message is a struct tagged by its Kind and encoded as an array, `[kind, field, ...]`,
so that it costs no field names on the wire and decodes in one C call. A Codec decodes
one direction of one socket: it refuses data over its size limit before reading a byte
of it, then anything that is not one of its messages field for field (no msgpack, a
field of the wrong type, one missing or extra, an unknown kind), with MalformedMessage;
nothing acts on a message before that. Encoding checks the same limit, so a sender
learns at once that a peer would refuse it.

This module sits beside errors.py rather than in serve/: the migration link, a layer
below the core process, speaks through it too.
"""
from __future__ import annotations

import enum
from typing import Any, Generic, TypeVar

import msgspec

from engine.errors import MalformedMessage
from engine.outputs import CoreOutput


class Kind(enum.StrEnum):
    """A message's type: the first field of its array on the wire."""
    # worker -> core
    ADDS = "adds"
    COMMAND = "cmd"
    STOP = "stop"
    KV_ASK = "kvask"
    SHUTDOWN = "shutdown"
    # core -> worker
    READY = "ready"
    OUTPUTS = "out"
    FAILED = "failed"
    REPLY = "reply"
    ADDED = "added"
    METRICS = "metrics"
    KV_ITEM = "kv"
    # migration source -> destination
    RESERVE = "reserve"
    CHECK = "check"
    WRITE = "write"
    COMMIT = "commit"
    CANCEL = "cancel"
    ABORT = "abort"
    # migration destination -> source
    OK = "ok"
    ERR = "err"


class _Fields(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """An array on the wire, every field checked, no field more (not tracked by the
    garbage collector: nothing of ours refers back to a message)."""


def _tag(kind: Kind) -> dict:
    return {"tag": kind.value}  # (msgspec takes a plain str, not the enum member)


class Refusal(_Fields):
    """Why a call or an item was refused: an EngineError's type name and its text
    (errors.error_from_wire raises it again on the caller's side)."""
    type: str
    message: str

    @classmethod
    def of(cls, error: BaseException) -> Refusal:
        return cls(type(error).__name__, str(error))


# --- worker -> core ------------------------------------------------------------------------

class HandOff(_Fields):
    """Where a prefill engine hands a request over once its first token is out (its
    decode engine's migration address and name, and the ticket the service signed)."""
    address: str
    to: str
    ticket: dict[str, Any] | None = None


class AddRequest(_Fields):
    """One new request (LLMEngine.add_request's arguments)."""
    request_id: str
    prompt: str | list[int]  # text, or token ids
    params: dict[str, Any]  # SamplingParams' fields, checked when the core builds them
    priority: int = 0
    job_id: str | None = None
    cache_salt: str | None = None
    tenant: str | None = None
    decode_on: HandOff | None = None  # None: it decodes where it is added


def add_request(request_id: str, prompt: str | list[int], params: dict[str, Any],
                priority: int = 0, job_id: str | None = None, cache_salt: str | None = None,
                tenant: str | None = None, decode_on: dict | None = None) -> AddRequest:
    """A request for the core, from a service's values: `decode_on` as the service's
    router gives it ({"address", "to", "ticket"}) or None."""
    return AddRequest(request_id, prompt, params, priority, job_id, cache_salt, tenant,
                      None if decode_on is None else HandOff(
                          decode_on["address"], decode_on["to"], decode_on.get("ticket")))


class Adds(_Fields, **_tag(Kind.ADDS)):
    """New requests, added between the same two steps; answered by Added."""
    call_id: int
    requests: list[AddRequest]


class Command(_Fields, **_tag(Kind.COMMAND)):
    """An operator command (engine/serve/commands.py; "migrate": engine/transfer/link.py);
    answered by a Reply, or dropped as CommandExpired once its deadline has passed."""
    call_id: int
    name: str
    arguments: dict[str, Any]
    deadline: float | None  # Unix time; None: none


class Stop(_Fields, **_tag(Kind.STOP)):
    """A request's text reached one of its stop strings: it ends (not answered)."""
    request_id: str


class KVAsk(_Fields, **_tag(Kind.KV_ASK)):
    """A question to the core's live KV view (KVFeed.ask); answered by a Reply."""
    call_id: int
    kind: str
    argument: Any


class Shutdown(_Fields, **_tag(Kind.SHUTDOWN)):
    """The core stops serving."""


ToCore = Adds | Command | Stop | KVAsk | Shutdown
CALL_KINDS = frozenset({Kind.ADDS, Kind.COMMAND, Kind.KV_ASK})  # answered by their call_id


# --- core -> worker ------------------------------------------------------------------------

class StepOutput(_Fields):
    """A request's progress in one step: engine.outputs.CoreOutput's fields, without its
    Request object, which stays in the core. The client hands these on as decoded; they
    read as CoreOutputs do."""
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    logprobs: list[list[Any]] | None = None
    prompt_logprobs: list[list[Any]] | None = None
    error: str | None = None
    kv_story: dict[str, Any] | None = None
    migration: dict[str, Any] | None = None

    @classmethod
    def of(cls, o: CoreOutput) -> StepOutput:
        return cls(o.request_id, o.new_token_ids, o.finished, o.finish_reason,
                   o.num_prompt_tokens, o.num_cached_tokens, o.num_preemptions, o.logprobs,
                   o.prompt_logprobs, o.error, o.kv_story, o.migration)


class Ready(_Fields, **_tag(Kind.READY)):
    """The core serves: its describe_config() (with its "migration_address") and metrics."""
    config: dict[str, Any]
    metrics: dict[str, Any]


class Outputs(_Fields, **_tag(Kind.OUTPUTS)):
    """One step's outputs: every request that progressed or ended in it."""
    outputs: list[StepOutput]


class StepFailed(_Fields, **_tag(Kind.FAILED)):
    """A step raised: these requests ended with it."""
    request_ids: list[str]
    message: str


class Reply(_Fields, **_tag(Kind.REPLY)):
    """The answer to a Command or a KVAsk (or to an Adds refused whole): its result, or
    the error that refused it."""
    call_id: int
    result: Any = None
    error: Refusal | None = None


class Added(_Fields, **_tag(Kind.ADDED)):
    """The answer to an Adds: per request, in order, None (added) or why it was refused."""
    call_id: int
    refusals: list[Refusal | None]


class Metrics(_Fields, **_tag(Kind.METRICS)):
    """The core's metrics (a few times a second, and after a command changed its state)."""
    metrics: dict[str, Any]


class KVItem(_Fields, **_tag(Kind.KV_ITEM)):
    """An item of the live KV view (engine/observe/feed.py)."""
    item: dict[str, Any]


FromCore = Ready | Outputs | StepFailed | Reply | Added | Metrics | KVItem


# --- migration source -> destination -------------------------------------------------------

class _MoveMessage(_Fields):
    """Every migration message names its move's request and its sequence number (the
    answer repeats both)."""
    request_id: str
    seq: int


class _Opening(_MoveMessage):
    offer: dict[str, Any]  # Migrator.offer(), checked by engine/transfer/check.py
    ticket: dict[str, Any] | None  # the service's (engine/transfer/ticket.py)


class Reserve(_Opening, **_tag(Kind.RESERVE)):
    """Open a staged move: hold blocks for the request's computed blocks."""


class Check(_Opening, **_tag(Kind.CHECK)):
    """Open a stop-and-copy move: how many of its blocks are cached here."""


class Write(_MoveMessage, **_tag(Kind.WRITE)):
    """A stage of held blocks from `start` on; their K/V follows as frames."""
    start: int
    kv_header: dict[str, Any]  # the frames' (Runner.blocks_to_frames)


class Commit(_MoveMessage, **_tag(Kind.COMMIT)):
    """The request's state and its last blocks (from `skip` on): it runs here from now on."""
    state: dict[str, Any]  # Migrator.take_out(), checked by engine/transfer/check.py
    skip: int
    kv_header: dict[str, Any]
    deadline: float  # Unix time: later than this it is refused


class Cancel(_MoveMessage, **_tag(Kind.CANCEL)):
    """The source gave up: the blocks held go back (not answered)."""


class Abort(_MoveMessage, **_tag(Kind.ABORT)):
    """The request was cancelled at the source while its commit was in flight (not
    answered)."""


PeerRequest = Reserve | Check | Write | Commit | Cancel | Abort


# --- migration destination -> source -------------------------------------------------------

class Ok(_MoveMessage, **_tag(Kind.OK)):
    result: dict[str, Any]


class Err(_MoveMessage, **_tag(Kind.ERR)):
    error: Refusal


PeerAnswer = Ok | Err


# --- the codec ------------------------------------------------------------------------------

M = TypeVar("M")

_encoder = msgspec.msgpack.Encoder()  # (shared by threads: each call has its own buffer)

# The core protocol's limit, both ways: an Adds of 256 requests of 128K tokens (msgpack
# spends at most 5 bytes on a token id below 2**32) fits, and so does a snapshot of the
# largest engine; the socket's ZMQ_MAXMSGSIZE is set to it too.
MAX_CORE_MESSAGE_BYTES = 1 << 28


class Codec(Generic[M]):
    """One direction of one socket: `message_type` (a union of tagged structs) up to
    `max_bytes` encoded."""

    def __init__(self, message_type: Any, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def encode(self, message: M) -> bytes:
        """MalformedMessage if it is larger than the receiver takes, or holds a value
        msgpack cannot carry."""
        try:
            data = _encoder.encode(message)
        except (msgspec.EncodeError, TypeError, OverflowError) as e:
            raise MalformedMessage(f"a {type(message).__name__} cannot be encoded: {e}") \
                from None
        if len(data) > self.max_bytes:
            raise MalformedMessage(f"a {type(message).__name__} of {len(data)} bytes is over "
                                   f"the limit of {self.max_bytes}")
        return data

    def decode(self, data: bytes | memoryview) -> M:
        """The message in `data`, checked whole: MalformedMessage for anything else, its
        size refused before it is read."""
        size = memoryview(data).nbytes
        if size > self.max_bytes:
            raise MalformedMessage(f"a message of {size} bytes is over the limit of "
                                   f"{self.max_bytes}")
        try:
            return self._decoder.decode(data)
        except msgspec.DecodeError as e:  # (ValidationError too: a schema's)
            raise MalformedMessage(f"a malformed message: {e}") from None

    def head(self, data: bytes | memoryview, fields: int) -> list | None:
        """The first `fields` fields of a message that decode() refused, read without a
        schema (its kind, call id or move), to answer it; None for data over the limit
        or that is no array of at least that many fields, the first a string."""
        if memoryview(data).nbytes > self.max_bytes:
            return None
        try:
            message = msgspec.msgpack.decode(data)
        except msgspec.DecodeError:
            return None
        if not isinstance(message, list) or len(message) < fields or \
                not isinstance(message[0], str):
            return None
        return message[:fields]


def kind_of(message: msgspec.Struct) -> Kind:
    """A message's Kind."""
    return Kind(message.__struct_config__.tag)


TO_CORE: Codec[ToCore] = Codec(ToCore, MAX_CORE_MESSAGE_BYTES)
FROM_CORE: Codec[FromCore] = Codec(FromCore, MAX_CORE_MESSAGE_BYTES)
