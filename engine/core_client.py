"""The API process's handle on the engine core (engine/core.py): what the server calls the engine.

Requests, aborts, adapter calls and utilities go out as msgspec messages over a ZMQ PUSH socket; one
receiver thread reads the core's per-step Outputs, turns token deltas into text (OutputProcessor:
detokenization, stop strings, which it aborts in the core) and hands each batch to the event loop with
one call_soon_threadsafe, into per-request asyncio queues. Autoload, the per-name load locks, explicit
unloads and the waiting-queue limit live here; the core only executes. `spawn` starts the core in its own
process (the server); `in_thread` runs the same loop on a thread over inproc sockets (tests, embedding).

If the core fails (a step raised, a tensor-parallel rank died: a Failed message) or its process exits
unasked, every open stream gets EngineFailedError, /health turns unhealthy and `on_failure` runs once on
the event loop (the server shuts down and exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import multiprocessing as mp
import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import zmq

from engine.config import EngineConfig
from engine.core_adapters import AdapterCalls
from engine.core_sockets import bind as _bind
from engine.core_sockets import close as _close
from engine.core_sockets import first_message as _first_message
from engine.core_stream import EngineStats, RequestStream
from engine.errors import EngineCoreExitedError, EngineDeadError, EngineFailedError, OverloadedError, RequestError
from engine.messages import (
    Abort,
    AdapterCall,
    Add,
    Failed,
    Inbound,
    Outputs,
    Ready,
    Reply,
    Utility,
    encoder,
    outbound_decoder,
    raise_error,
)
from engine.output_processor import OutputProcessor
from engine.protocol import RequestOutput, SamplingParams
from engine.served import LoRAStats, served_from_ready

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
_Item = list[int] | RequestOutput | BaseException  # accepted (prompt ids), an output, or a failure


class EngineClient(AdapterCalls):
    def __init__(self, config: EngineConfig, ready: Ready, ctx: zmq.Context, push: zmq.Socket, pull: zmq.Socket,
                 max_waiting_requests: int | None, on_failure: Callable[[BaseException], None] | None,
                 llm: LLMEngine | None = None) -> None:
        self.config = config
        self.served = served_from_ready(config, ready, llm)
        self.core_pid = ready.pid
        self.max_num_seqs = ready.max_num_seqs
        self.max_waiting_requests = max_waiting_requests
        self.on_failure = on_failure
        self._ctx, self._push, self._pull = ctx, push, pull
        self._lock = threading.Lock()  # the PUSH socket, the processor, the pending adds, the queued count
        self._enc = encoder()
        self._processor = OutputProcessor(copy.deepcopy(self.served.tokenizer), ready.eos_ids)
        self._params: dict[str, SamplingParams] = {}  # sent adds whose acceptance has not arrived
        self._queued = 0
        self._stats = EngineStats(timestamp=time.time())
        self.output_seconds = 0.0
        """Receiver-thread time turning the core's outputs into text (detokenization, stop strings): with the
        event loop's work it shares this process's one interpreter."""
        self._adapters: dict[str, str] = dict(ready.adapters)  # the core's registry after its last reply
        self._streams: dict[str, asyncio.Queue[_Item]] = {}  # event loop only
        self._calls: dict[int, asyncio.Future[Reply]] = {}
        self._call_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._receiver: threading.Thread | None = None
        self._core_alive: Callable[[], bool] = lambda: True
        self._join: Callable[[float], None] = lambda _t: None
        self._accepting = False
        self._closing = False
        self._load_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._unloaded: set[str] = set()
        self.error: BaseException | None = None

    # -- construction --------------------------------------------------------------------------------
    @classmethod
    async def spawn(cls, config: EngineConfig, progress: bool = False, max_waiting_requests: int | None = None,
                    on_failure: Callable[[BaseException], None] | None = None) -> EngineClient:
        """Start the engine-core process and wait for its Ready; its start-up error is raised here."""
        ctx = zmq.Context()
        folder = tempfile.mkdtemp(prefix="xpulora-")
        push, pull, in_addr, out_addr = _bind(ctx, f"ipc://{folder}/in", f"ipc://{folder}/out")
        proc = mp.get_context("spawn").Process(target=_core_main, args=(config, in_addr, out_addr, progress),
                                               name="xpulora-core", daemon=False)
        proc.start()
        try:
            ready = await asyncio.to_thread(_first_message, pull, proc.is_alive)
        except BaseException:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
            _close(ctx, push, pull)
            raise
        finally:
            with contextlib.suppress(OSError):
                for name in ("in", "out"):
                    os.unlink(os.path.join(folder, name))
                os.rmdir(folder)
        client = cls(config, ready, ctx, push, pull, max_waiting_requests, on_failure)
        client._core_alive, client._join = proc.is_alive, proc.join
        threading.Thread(target=client._watch, args=(proc,), name="xpulora-core-watch", daemon=True).start()
        return client

    @classmethod
    def in_thread(cls, llm: LLMEngine, max_waiting_requests: int | None = None,
                  on_failure: Callable[[BaseException], None] | None = None) -> EngineClient:
        """The core loop on a thread over the given engine (which the caller keeps and shuts down)."""
        from engine.core import start_thread

        ctx = zmq.Context()
        tag = f"inproc://xpulora-{id(llm)}-{time.monotonic_ns()}"
        push, pull, in_addr, out_addr = _bind(ctx, tag + "-in", tag + "-out")
        thread = start_thread(llm, ctx, in_addr, out_addr)
        client = cls(llm.config, _first_message(pull, thread.is_alive), ctx, push, pull,
                     max_waiting_requests, on_failure, llm)
        client._core_alive, client._join = thread.is_alive, thread.join
        return client

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._receiver = threading.Thread(target=self._receive, name="xpulora-receive", daemon=True)
        self._receiver.start()
        self._accepting = True

    @property
    def healthy(self) -> bool:
        return self.error is None and not self._closing and self._receiver is not None and self._core_alive()

    def stop_accepting(self) -> None:
        """New requests get 503 from now on; the ones already in keep running."""
        self._accepting = False

    def abort_all(self) -> None:
        """End every request now with finish_reason "abort" (the end of a shutdown's grace period)."""
        self._accepting = False
        self._send(Utility(0, "abort_all"))

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish for up to grace_s, abort the rest, stop the core."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self._streams and self.healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.error is None and self._core_alive():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._call(Utility(next(self._call_ids), "shutdown")), 30.0)
        self._closing = True
        await asyncio.to_thread(self._join, 30.0)
        if self._receiver is not None:
            await asyncio.to_thread(self._receiver.join, 5.0)
        _close(self._ctx, self._push, self._pull)

    def stats(self) -> EngineStats:
        return self._stats

    def lora_stats(self) -> LoRAStats | None:
        """The adapter manager's counters as of the core's last message (None with LoRA off)."""
        if not self.served.lora_enabled:
            return None
        s = self._stats
        return LoRAStats(s.lora_loads, s.lora_unloads, s.lora_evictions, len(self._adapters),
                         self.served.lora.max_loras)

    def list_adapters(self) -> list[tuple[str, str]]:
        """(name, path) of every registered adapter."""
        return list(self._adapters.items())

    def has_adapter(self, name: str) -> bool:
        return name in self._adapters

    async def reset_prefix_cache(self) -> None:
        await self._call(Utility(next(self._call_ids), "reset_prefix_cache"))

    # -- requests ------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          lora_name: str | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepts it. Raises RequestError (400; its
        ModelNotFoundError subclass 404) or OverloadedError (503) with nothing left behind."""
        if lora_name is not None:
            await self.ensure_adapter(lora_name)
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._check_accepting()
        params.validate(self.config.max_logprobs, self.served.vocab_size)  # the core's check, before encoding
        if params.max_tokens > self.served.max_model_len:  # may not fit msgpack's 64-bit integers
            raise RequestError(f"max_tokens ({params.max_tokens}) exceeds max_model_len {self.served.max_model_len}")
        try:
            wire = self._enc.encode(Add(request_id, prompt, params, lora_name))
        except OverflowError as e:  # msgpack carries 64-bit integers; nothing valid is larger
            raise RequestError(f"a request field is out of range: {e}") from e
        limit = self.max_waiting_requests
        with self._lock:
            free = max(0, self.max_num_seqs - self._stats.num_running)
            if limit is not None and self._queued + self._stats.num_waiting - free >= limit:
                raise OverloadedError(f"the server is overloaded ({limit} requests waiting); retry later")
            if request_id in self._streams:
                raise RequestError(f"duplicate request id {request_id!r}")
            if not self._push_frame(wire):
                raise EngineFailedError("the engine core is gone; no request is served")
            self._streams[request_id] = queue
            self._params[request_id] = params
            self._queued += 1
        try:
            first = await queue.get()
        except BaseException:  # cancelled while queued: the core may still add it, so abort after it
            self._release(request_id, abort=True)
            raise
        if isinstance(first, BaseException):
            self._release(request_id, abort=False)
            raise first
        assert isinstance(first, list)
        return RequestStream(self._release, request_id, queue, first)

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; closing or cancelling the iterator aborts the request."""
        async with await self.add_request(request_id, prompt, params, lora_name) as stream:
            async for out in stream:
                yield out

    def _release(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        with self._lock:
            self._processor.drop(request_id)
            self._params.pop(request_id, None)
        if abort:
            self._send(Abort([request_id]))

    def _check_accepting(self) -> None:
        if self.error is not None:
            raise EngineFailedError(f"the engine failed and serves no more requests: {self.error!r}")
        if not self._accepting:
            raise OverloadedError("the server is shutting down")

    def _send(self, msg: Inbound) -> bool:
        """False when it could not go: closing, or no core reads the inbox any more (then an abort has nothing
        left to free)."""
        with self._lock:
            return not self._closing and self._push_frame(self._enc.encode(msg))

    def _push_frame(self, frame: bytes) -> bool:
        """Send without blocking (the caller holds the lock). A PUSH socket with no peer blocks a plain send
        for ever: once the core's process is gone, that would freeze the event loop, and with it the error
        events of the streams and the server's shutdown."""
        try:
            self._push.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def _call(self, msg: AdapterCall | Utility) -> Reply:
        """Send a call and wait for its reply; its error is raised as the same engine.errors class."""
        assert self._loop is not None
        if self.error is not None:
            raise EngineFailedError(f"the engine failed: {self.error!r}")
        fut: asyncio.Future[Reply] = self._loop.create_future()
        self._calls[msg.call_id] = fut
        try:
            if not self._send(msg):
                raise EngineFailedError(f"the engine core cannot be reached ({msg.op} not sent)")
            reply = await fut
        finally:
            self._calls.pop(msg.call_id, None)
        if reply.adapters is not None:
            self._adapters = dict(reply.adapters)
        if reply.error is not None:
            raise raise_error(reply.error)
        return reply

    # -- the receiver thread ---------------------------------------------------------------------------
    def _receive(self) -> None:
        dec = outbound_decoder()
        while not self._closing:
            if not self._pull.poll(100):
                continue
            msg = dec.decode(self._pull.recv(copy=False).buffer)
            if isinstance(msg, Outputs):
                t0 = time.perf_counter()
                items = self._outputs_items(msg)
                self.output_seconds += time.perf_counter() - t0
                self._post(self._outputs, items)
            elif isinstance(msg, Reply):
                self._post(self._reply, msg)
            elif isinstance(msg, Failed):
                self._fail(EngineDeadError(msg.message))
                return

    def _outputs_items(self, msg: Outputs) -> list[tuple[str, _Item]]:
        items: list[tuple[str, _Item]] = []
        with self._lock:
            self._queued -= len(msg.accepted)
            for acc in msg.accepted:
                params = self._params.pop(acc.request_id, None)
                if acc.error is not None:
                    items.append((acc.request_id, raise_error(acc.error)))
                elif params is not None and acc.prompt_token_ids is not None:  # else released meanwhile
                    self._processor.add(acc.request_id, acc.prompt_token_ids, params)
                    items.append((acc.request_id, acc.prompt_token_ids))
            outs, stopped = self._processor.process(msg.deltas)
            if stopped and not self._closing:  # a stop string ended them: free their KV blocks now
                self._push_frame(self._enc.encode(Abort(stopped)))
            if msg.stats is not None:
                self._stats = msg.stats
        items.extend((o.request_id, o) for o in outs)
        return items

    def _post(self, fn: Callable[..., None], arg: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed (interpreter exit): nobody is listening
            log.warning("event loop closed; engine output dropped")

    def _outputs(self, items: list[tuple[str, _Item]]) -> None:
        for rid, item in items:
            if (q := self._streams.get(rid)) is not None:
                q.put_nowait(item)

    def _reply(self, reply: Reply) -> None:
        fut = self._calls.get(reply.call_id)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _watch(self, proc: mp.process.BaseProcess) -> None:
        """The core's process exiting unasked is a failure, seen within milliseconds of it."""
        mp.connection.wait([proc.sentinel])
        deadline = time.monotonic() + 0.1  # a Failed message sent just before the exit is read first
        while self.error is None and not self._closing and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._closing and self.error is None:
            log.error("the engine-core process (pid %s) exited with code %s", proc.pid, proc.exitcode)
            self._fail(EngineCoreExitedError(f"the engine-core process exited with code {proc.exitcode}"))

    def _fail(self, e: BaseException) -> None:
        self.error = e
        if self._loop is not None:
            self._post(self._fail_on_loop, e)

    def _fail_on_loop(self, e: BaseException) -> None:
        dead = EngineFailedError(f"the engine failed: {e!r}")
        for q in self._streams.values():
            q.put_nowait(dead)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(dead)
        if self.on_failure is not None:
            self.on_failure(e)


def _core_main(config: EngineConfig, in_addr: str, out_addr: str, progress: bool) -> None:
    """The engine-core process's entry: engine.core (torch, the model code) is imported there, never here."""
    from engine.core import core_main

    core_main(config, in_addr, out_addr, progress)
