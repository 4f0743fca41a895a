"""Small pieces of the HTTP side of streaming: SSE events and the client disconnect watch."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec
from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    pass


_JSON = msgspec.json.Encoder()


def sse_event(obj: dict[str, Any]) -> bytes:
    """One SSE event: compact UTF-8 JSON (msgspec: ~9x faster than json.dumps, which cost ~10 % of the API
    process's time per streamed token). No NaN reaches it: logprobs are floored (server/logprobs.py)."""
    return b"data: " + _JSON.encode(obj) + b"\n\n"


async def _wait_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(raw: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client goes away first (raises ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    return task.result()
