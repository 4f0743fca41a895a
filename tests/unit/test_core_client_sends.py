"""The API process's sends to the engine core never block: once the core's process is gone, its socket has no
peer, and a plain ZMQ PUSH send would then wait for ever on the event loop (seen as a TP test whose streams
never got their error event: the stream closes after the failure sent aborts into a core that had exited)."""

from __future__ import annotations

import threading
import time

import zmq

from engine.core_client import EngineClient
from engine.core_sockets import bind as _bind
from engine.core_sockets import close as _close
from engine.messages import Abort, encoder, inbound_decoder


def _client(push: zmq.Socket) -> EngineClient:
    client = object.__new__(EngineClient)  # only what _send reads: the socket, its lock, the encoder
    client._push, client._lock, client._enc, client._closing = push, threading.Lock(), encoder(), False
    return client


def test_send_goes_while_the_core_reads_and_fails_fast_once_it_is_gone(tmp_path) -> None:
    ctx = zmq.Context()
    push, pull, in_addr, _ = _bind(ctx, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    core_inbox = ctx.socket(zmq.PULL)
    core_inbox.connect(in_addr)
    client = _client(push)
    time.sleep(0.2)  # the connection is up
    for i in range(3000):  # far past ZMQ's default queue limit of 1000: a busy core never turns sends away
        assert client._send(Abort([f"r{i}"]))
    assert inbound_decoder().decode(core_inbox.recv()) == Abort(["r0"])
    core_inbox.close(linger=0)  # the core's process exits
    time.sleep(0.3)
    result: list[bool] = []
    sender = threading.Thread(target=lambda: result.append(client._send(Abort(["late"]))), daemon=True)
    sender.start()
    sender.join(2.0)
    assert not sender.is_alive(), "a send to a vanished core blocked"
    assert result == [False]
    _close(ctx, push, pull)
