"""Job updates: one ordered stream from the engine workers to the web processes.

Every producer (an engine worker's output processor, or a process that changes a job's
state: claim, cancel, fail, requeue) appends entries to the Redis stream `kvops:jobs`.
An entry is one batch: a worker writes one per flush, with the progress of every job that
moved since the last one, so the number of Redis writes does not grow with the number of
jobs. Each web process reads the stream with one task (kvops/stream/stream_hub.py) and hands
each job's updates to whoever in that process listens (SSE responses, job websockets).

Nothing is dropped silently: entries carry their producer's id and a sequence number
(a write that failed still uses its number), so a reader that sees a gap knows it lost
something and ends the affected listeners with an error instead of letting them hang.

An update (a dict) says where its text goes, so a listener can assemble the output from
pieces that arrive from two places (the database row, then the stream):
  job       the job id
  attempt   the job's attempt (a re-run after a worker died starts its text anew)
  offset    where `text` starts in the attempt's output (characters)
  text      the new text (a state update carries the whole text at offset 0)
  n         output tokens so far
  state     only when the job's status changed: the job's payload (job_store.job_payload),
            `finished` among it
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

import msgpack

log = logging.getLogger(__name__)

STREAM_KEY = "kvops:jobs"
# Entries kept (trimmed lazily). A reader this far behind has lost entries and says so;
# at one entry per 10 ms step per engine this is many minutes.
STREAM_MAXLEN = 100_000


def encode_entry(src: str, seq: int, engine: str, updates: list[dict]) -> dict[str, bytes]:
    """An entry's one field: msgpack (a third of JSON's cost to write, and to read)."""
    doc = {"src": src, "seq": seq, "engine": engine, "u": updates}
    return {"d": msgpack.packb(doc, use_bin_type=True)}


def decode_entry(fields: dict) -> dict:
    return msgpack.unpackb(fields[b"d"] if b"d" in fields else fields["d"], raw=False)


class StreamProducer:
    """Appends batches of updates to the stream, numbering them."""

    def __init__(self, redis_client, engine: str = "") -> None:
        self.redis = redis_client
        self.engine = engine
        self.src = uuid.uuid4().hex[:16]
        self.seq = 0  # the number of the last batch tried (sent or not)

    def send(self, updates: list[dict]) -> None:
        """Append one batch; raises the Redis error if it could not (its number is used
        all the same, so readers see the gap)."""
        if not updates:
            return
        self.seq += 1
        self.redis.xadd(STREAM_KEY, encode_entry(self.src, self.seq, self.engine, updates),
                        maxlen=STREAM_MAXLEN, approximate=True)


def state_update(job_id: int, attempt: int, payload: dict) -> dict:
    """A status change: the whole job as its listeners see it."""
    return {"job": job_id, "attempt": attempt, "offset": 0, "text": payload.get("text", ""),
            "n": payload.get("num_output_tokens", 0), "state": payload}


@dataclass(slots=True)
class TextAssembler:
    """One job's output text, put together from updates that may come out of order
    (a database read, then stream pieces that started before or after it)."""
    attempt: int = 0
    text: str = ""
    pending: dict[int, str] = field(default_factory=dict)  # offset -> text, past a hole

    def add(self, attempt: int, offset: int, text: str) -> bool:
        """Place a piece; False if it belongs to an older attempt (ignored)."""
        if attempt < self.attempt:
            return False
        if attempt > self.attempt:
            self.attempt, self.text, self.pending = attempt, "", {}
        if offset > len(self.text):
            self.pending[offset] = text
            return True
        self._place(offset, text)
        while self.pending:
            ready = [o for o in self.pending if o <= len(self.text)]
            if not ready:
                break
            for o in sorted(ready):
                self._place(o, self.pending.pop(o))
        return True

    def _place(self, offset: int, text: str) -> None:
        # Within an attempt the output only grows, so a piece either adds to the end or
        # repeats what is there.
        if offset + len(text) > len(self.text):
            self.text = self.text[:offset] + text

    @property
    def has_hole(self) -> bool:
        return bool(self.pending)
