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

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        assert isinstance(item, RequestOutput)
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release(self.request_id, not self.finished)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
