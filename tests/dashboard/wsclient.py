"""Talking to the websocket consumers in-process (channels' WebsocketCommunicator over
the real channel layer: the tests' private Redis)."""
from __future__ import annotations

import asyncio
import json
import time

from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator

from engine.observe.feed import decode
from tests.support.local_publisher import LocalPublisher
from kvops.dashboard.ws_routing import websocket_urlpatterns

APP = URLRouter(websocket_urlpatterns)


def wait_for(predicate, what: str, timeout_s: float = 10) -> None:
    deadline = time.time() + timeout_s
    while not predicate():
        if time.time() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


async def connect(path: str, user) -> tuple[WebsocketCommunicator, bool, int | None]:
    comm = WebsocketCommunicator(APP, path)
    comm.scope["user"] = user
    ok, code = await comm.connect(timeout=5)
    return comm, ok, code


async def receive(comm: WebsocketCommunicator, timeout: float = 5) -> dict:
    """The next frame: a text frame's JSON, or a binary frame's document (`_binary`)."""
    out = await comm.receive_output(timeout)
    assert out["type"] == "websocket.send", out
    if out.get("bytes") is not None:
        return {**decode(out["bytes"]), "_binary": True}
    return json.loads(out["text"])


async def receive_type(comm, kind: str, timeout: float = 5) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        message = await receive(comm, max(0.1, deadline - time.monotonic()))
        if message["type"] == kind:
            return message


async def settle(publisher: LocalPublisher, engine) -> int:
    """Let the publisher catch up with the engine; the seq of its last delta."""
    publisher(engine)
    await asyncio.to_thread(wait_for, lambda: publisher.mirror.version == engine.version
                            and publisher.idle, "publisher caught up")
    await asyncio.sleep(0.05)
    return publisher.mirror.seq
