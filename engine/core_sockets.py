"""The API process's ends of its two ZMQ sockets to the engine core: bound here, connected by the core."""

from __future__ import annotations

from collections.abc import Callable

import zmq

from engine.errors import EngineDeadError
from engine.messages import Ready, StartupFailed, outbound_decoder, raise_error


def bind(ctx: zmq.Context, in_addr: str, out_addr: str) -> tuple[zmq.Socket, zmq.Socket, str, str]:
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    # No queue limit: a send fails (EngineClient._push_frame) only when no core is connected any more,
    # never because a busy core has not read its inbox yet.
    push.setsockopt(zmq.SNDHWM, 0)
    push.bind(in_addr)
    pull.bind(out_addr)
    return push, pull, in_addr, out_addr


def close(ctx: zmq.Context, push: zmq.Socket, pull: zmq.Socket) -> None:
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


def first_message(pull: zmq.Socket, alive: Callable[[], bool]) -> Ready:
    """The core's Ready (start-up can take minutes: wait as long as it lives), or its start-up error."""
    dec = outbound_decoder()
    while not pull.poll(100):
        if not alive():
            raise EngineDeadError("the engine core exited during start-up")
    msg = dec.decode(pull.recv())
    if isinstance(msg, StartupFailed):
        raise raise_error(msg.error)
    if not isinstance(msg, Ready):
        raise EngineDeadError(f"the engine core sent {type(msg).__name__} before Ready")
    return msg
