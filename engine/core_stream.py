"""What the engine client hands the server: one request's output stream, and the core's stats snapshot."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine.messages import Stats
from engine.protocol import RequestOutput

EngineStats = Stats
"""The core's counters as of its last message (read lock-free by /metrics)."""


_Item = list[int] | RequestOutput | BaseException


class RequestStream:
    """The outputs of one accepted request. close() (or leaving `async with`) before the end aborts it,
    which frees its KV blocks and adapter slot."""

    def __init__(self, release: Callable[[str, bool], None], request_id: str, queue: asyncio.Queue[_Item],
                 prompt_token_ids: list[int]) -> None:
        self._release, self.request_id, self._queue = release, request_id, queue
        self.prompt_token_ids = prompt_token_ids
        self.finished = False
        self._closed = False
        self._error: BaseException | None = None
        """A failure ready() took off the queue, raised by the next __anext__."""

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = self._error if self._error is not None else await self._queue.get()
        if isinstance(item, BaseException):
            self._error = None
            self.close()
            raise item
        assert isinstance(item, RequestOutput)
        self.finished = item.finished
        return item

    def ready(self) -> list[RequestOutput]:
        """The outputs already queued behind the last one returned, taken without waiting (a streaming
        response that fell behind the engine writes them at once). A failure stays for the next __anext__."""
        outs: list[RequestOutput] = []
        while not self.finished and self._error is None and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                self._error = item
            else:
                assert isinstance(item, RequestOutput)
                self.finished = item.finished
                outs.append(item)
        return outs

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release(self.request_id, not self.finished)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
