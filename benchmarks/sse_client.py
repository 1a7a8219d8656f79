"""A light streaming client for /v1/completions, for load generation: one HTTP/1.1
request on a raw asyncio connection (`Connection: close`), the chunked body and the
server-sent events split by hand. It costs a fraction of the
official client's CPU per chunk, so one process can drive hundreds of streams on a
small machine and the figures measure the server, not the client. Loopback only."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse


@dataclass(slots=True)
class StreamResult:
    """What one stream delivered, as its client saw it."""
    sent_at: float  # perf_counter when the request went out
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    text: str = ""
    finish_reason: str | None = None
    done: bool = False  # `data: [DONE]` arrived
    error: str | None = None  # an error event, a bad status, or a broken connection
    status: int = 0

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def gaps(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


def completion_request(url: str, token: str, body: dict) -> bytes:
    """The bytes of a streamed /v1/completions request (the connection closes at the
    answer's end)."""
    netloc = urlparse(url).netloc
    payload = json.dumps({**body, "stream": True}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {netloc}\r\nConnection: close\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


async def stream_completion(url: str, token: str, body: dict) -> StreamResult:
    """POST body (with stream=true) to url's /v1/completions and read the stream to its
    end. Never raises for what the server does: the result says it."""
    parsed = urlparse(url)
    result = StreamResult(sent_at=time.perf_counter())
    try:
        reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port)
    except OSError as e:
        result.error = f"connect: {e}"
        return result
    try:
        writer.write(completion_request(url, token, body))
        await writer.drain()
        header = await reader.readuntil(b"\r\n\r\n")
        result.status = int(header.split(b" ", 2)[1])
        if result.status != 200:
            result.error = f"HTTP {result.status}: {(await reader.read(500)).decode(errors='replace')}"
            return result
        body = _Dechunker() if b"chunked" in header.lower() else None
        buffer = b""
        while True:
            data = await reader.read(65536)
            if not data:
                break
            buffer += body.feed(data) if body else data
            *events, buffer = buffer.split(b"\n\n")
            now = time.perf_counter()
            for event in events:
                _take_event(result, event, now)
            if body and body.ended:
                break
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        result.error = f"connection: {e}"
    finally:
        writer.close()
    if not result.done and result.error is None:
        result.error = "the stream ended without [DONE]"
    return result


class _Dechunker:
    """Undoes HTTP/1.1's chunked transfer encoding on a body read piece by piece."""

    __slots__ = ("raw", "ended")

    def __init__(self) -> None:
        self.raw = b""
        self.ended = False  # the last (empty) chunk came

    def feed(self, data: bytes) -> bytes:
        """The body bytes that `data` completes."""
        raw, out, at = self.raw + data, [], 0
        while not self.ended:
            line_end = raw.find(b"\r\n", at)
            if line_end < 0:
                break
            size = int(raw[at:line_end].split(b";", 1)[0], 16)
            if size == 0:
                self.ended = True
                break
            end = line_end + 2 + size
            if len(raw) < end + 2:
                break
            out.append(raw[line_end + 2:end])
            at = end + 2
        self.raw = raw[at:]
        return b"".join(out)


def _take_event(result: StreamResult, event: bytes, now: float) -> None:
    if not event.startswith(b"data: "):
        return
    data = event[6:]
    if data == b"[DONE]":
        result.done = True
        return
    doc = json.loads(data)
    if "error" in doc:
        result.error = doc["error"].get("message", "error event")
        return
    choice = doc["choices"][0]
    if choice.get("text"):
        result.text += choice["text"]
        result.chunk_times.append(now)
    if choice.get("finish_reason"):
        result.finish_reason = choice["finish_reason"]
