"""Issue 57: a request learns that its HTTP client left from the ASGI `http.disconnect` message
(ClientWatch), not from a poll per request every 0.5 s; a stream whose client left ends quietly."""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List

from radixserve.entrypoints.serving_base import chain_first
from radixserve.managers.client_watch import ClientWatch
from radixserve.managers.tokenizer_manager import ClientDisconnected


class FakeChannel:
    """An ASGI receive channel: the test pushes the messages the server would deliver."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    async def receive(self) -> Dict[str, Any]:
        return await self.queue.get()


def test_disconnect_sets_gone_and_wakes_every_waiter():
    async def run() -> None:
        channel, events = FakeChannel(), [asyncio.Event(), asyncio.Event()]
        watch = ClientWatch(channel.receive, events)
        channel.queue.put_nowait({"type": "http.request", "body": b"", "more_body": False})
        await asyncio.sleep(0.01)
        assert not watch.gone and not any(e.is_set() for e in events)  # a body message is no disconnect
        channel.queue.put_nowait({"type": "http.disconnect"})
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 5)
        assert watch.gone
        watch.close()

    asyncio.run(run())


def test_a_closed_watch_ignores_the_end_of_its_response():
    """uvicorn answers receive() with http.disconnect once the response is complete too: the
    watch is closed before, so a finished request is not taken for a client that left."""
    async def run() -> None:
        channel, event = FakeChannel(), asyncio.Event()
        watch = ClientWatch(channel.receive, [event])
        await asyncio.sleep(0)
        watch.close()
        channel.queue.put_nowait({"type": "http.disconnect"})
        await asyncio.sleep(0.01)
        assert not watch.gone and not event.is_set()

    asyncio.run(run())


def test_a_request_without_a_receive_channel_has_no_watch():
    assert ClientWatch.of(None, []) is None  # the offline Engine, /health_generate's own request


def test_a_stream_whose_client_left_ends_without_an_error():
    async def gen():
        yield {"n": 2}
        raise ClientDisconnected("rid")

    async def run() -> List[Any]:
        return [item async for item in chain_first({"n": 1}, gen())]

    assert asyncio.run(run()) == [{"n": 1}, {"n": 2}]
