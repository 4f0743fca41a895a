"""Connection limits for the HTTP server: header and body read deadlines, and a cap on connections.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but a connection that has sent
part of a request's headers (or of its body) is kept open for as long as the client likes: a few
hundred of them hold sockets and memory forever (slowloris). The ASGI app cannot help, since it is
called only once the headers are complete, so the deadlines live in the protocol: a subclass of
uvicorn's h11 protocol arms a timer while the client owes the rest of the headers (from the first
byte of a request, or from the connection's start) and while it owes the rest of a body; when it fires,
the connection is answered 408 (headers) or closed (body; the app sees a disconnect). Past
`limit_concurrency` open connections plus running requests, uvicorn answers 503.

Settings (environment): XPULORA_HEADER_TIMEOUT_S (10), XPULORA_BODY_TIMEOUT_S (30),
XPULORA_MAX_CONNECTIONS (1024), XPULORA_KEEP_ALIVE_S (5). docs/RELIABILITY.md has a reverse-proxy recipe.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Literal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on a request's headers and on its body."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0
    _timer: asyncio.TimerHandle | None = None
    _phase: Literal["", "headers", "body"] = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # the next request (pipelined or not) starts its header deadline
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """(Re)arm the deadline for what the client owes now; the body deadline runs from the headers' end."""
        state = self.conn.their_state
        phase: Literal["", "headers", "body"] = ("headers" if state is h11.IDLE
                                                 else "body" if state is h11.SEND_BODY else "")
        if phase == self._phase:
            return
        self._disarm()
        self._phase = phase
        if phase and not self.transport.is_closing():
            timeout = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._timer = self.loop.call_later(timeout, self._expire, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, phase: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        log.info("closing a connection from %s: its request %s did not arrive within %gs", self.client, phase,
                 self.header_timeout_s if phase == "headers" else self.body_timeout_s)
        if phase == "headers":
            self.transport.write(_408)
        self.transport.close()


def uvicorn_limits(env: dict[str, str] | None = None) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for the limits above, read from the environment."""
    env = dict(os.environ) if env is None else env
    header_s = float(env.get("XPULORA_HEADER_TIMEOUT_S", "10"))
    body_s = float(env.get("XPULORA_BODY_TIMEOUT_S", "30"))
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,),
                    {"header_timeout_s": header_s, "body_timeout_s": body_s})
    return {"http": protocol, "limit_concurrency": int(env.get("XPULORA_MAX_CONNECTIONS", "1024")),
            "timeout_keep_alive": int(env.get("XPULORA_KEEP_ALIVE_S", "5"))}
