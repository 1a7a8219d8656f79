"""Talking to the websocket consumers in-process (channels' WebsocketCommunicator over
the real channel layer: the tests' private Redis)."""
from __future__ import annotations

import asyncio
import json

from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator

from engine.observe.feed import decode
from tests.support.local_publisher import LocalPublisher
from kvops.dashboard.ws_routing import websocket_urlpatterns
from tests.support.wait import wait_until, wait_until_async

APP = URLRouter(websocket_urlpatterns)


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
    """The next frame of this type; those before it are dropped."""
    return await wait_until_async(lambda: receive(comm, timeout), f"a {kind!r} frame", timeout,
                                  until=lambda message: message["type"] == kind, poll_s=0)


async def settle(publisher: LocalPublisher, engine) -> int:
    """Let the publisher catch up with the engine; the seq of its last delta."""
    publisher(engine)
    await asyncio.to_thread(wait_until, lambda: publisher.mirror.version == engine.version
                            and publisher.idle, "the publisher to catch up", 10)
    await asyncio.sleep(0.05)
    return publisher.mirror.seq
