"""ClientWatch: learn at once that an HTTP client went away, at no cost per token.

The ASGI server tells an app that its client is gone by answering `receive()` with an
`http.disconnect` message. Asking with `Request.is_disconnected()` every 0.5 s while a request
runs (as radixserve did: a cancel scope and a receive per check, ~6-8% of the HTTP process's time
per token under load, issue 57) is replaced by one task per HTTP request that waits on
`receive()` until that message comes and then wakes the request's waiters; the
TokenizerManager aborts the request in the scheduler when it sees `gone`, for a streaming and a
non-streaming request alike. Starlette's StreamingResponse listens the same way while it streams.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Dict, List, Optional


class ClientWatch:
    """Sets `gone` and the given events when the client of `receive` disconnects. `close()`
    when the request is over (its response may still be sent: the watch stops first, so a
    completed response, which uvicorn also reports as `http.disconnect`, is never mistaken for
    a client that left)."""

    def __init__(self, receive: Callable[[], Awaitable[Dict[str, Any]]], events: List[asyncio.Event]):
        self.gone = False
        self._events = events
        self._task: Optional[asyncio.Task] = asyncio.ensure_future(self._listen(receive))

    @classmethod
    def of(cls, request: Any, events: List[asyncio.Event]) -> Optional["ClientWatch"]:
        """A watch on a Starlette/FastAPI request's ASGI receive channel; None without one
        (the offline Engine, an internal request such as /health_generate's)."""
        receive = getattr(request, "receive", None)
        return cls(receive, events) if callable(receive) else None

    async def _listen(self, receive: Callable[[], Awaitable[Dict[str, Any]]]) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":  # the body was read already
                pass
        except Exception:  # a receive channel that fails tells nothing: stop watching
            return
        self.gone = True
        for event in self._events:
            event.set()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
