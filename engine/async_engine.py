"""The engine behind an asyncio server: one background thread steps the LLMEngine.

The model step is blocking CPU/GPU work, so it runs in its own thread and the event loop stays free.
The event loop never calls into the engine directly: it posts commands (add, abort) to an inbox; the
step thread applies them under the engine lock between steps and hands each step's outputs back to
per-request asyncio queues through ``loop.call_soon_threadsafe``. Adapter load/unload only touch the
LoRA manager (which has its own lock) and run in worker threads, so they are safe while stepping.

If a step raises, or a tensor-parallel worker dies (noticed within IDLE_CHECK_S even when idle), the
engine is failed: every open stream gets EngineFailedError, /health turns unhealthy and `on_failure`
runs once on the event loop (the server shuts down and exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from engine.errors import AdapterError, EngineDeadError, EngineFailedError, OverloadedError, RequestError
from engine.llm_engine import LLMEngine
from engine.lora.adapter import validate_name
from engine.lora.adapter_files import resolve_under_roots
from engine.protocol import RequestOutput, SamplingParams
from engine.served import LoRAStats, ServedModel, served_model

log = logging.getLogger(__name__)
IDLE_CHECK_S = 0.5  # how often an idle step thread checks that the tensor-parallel workers live


@dataclass(frozen=True)
class EngineStats:
    """A snapshot published by the step thread after every iteration (read lock-free by /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    timestamp: float = field(default_factory=time.time)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    lora_name: str | None


_Item = list[int] | RequestOutput | BaseException  # accepted (prompt ids), an output, or a failure


class RequestStream:
    """The outputs of one accepted request. close() (or leaving `async with`) before the end aborts it,
    which frees its KV blocks and adapter slot."""

    def __init__(self, owner: AsyncEngine, request_id: str, queue: asyncio.Queue[_Item],
                 prompt_token_ids: list[int]) -> None:
        self.owner, self.request_id, self._queue = owner, request_id, queue
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
            self.owner._release(self.request_id, abort=not self.finished)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine  # the server uses `served` and the methods below, never this
        self.served: ServedModel = served_model(engine)
        self.max_waiting_requests = max_waiting_requests
        self.on_failure = on_failure
        self.lock = threading.Lock()  # everything that touches scheduler / request state
        self._cv = threading.Condition()  # guards the inbox, the queued count and the stats
        self._inbox: list[_Add | str] = []  # str: a request id to abort
        self._queued = 0  # adds posted and not yet in the scheduler
        self._stop = False
        self._abort_all = False
        self._stats = EngineStats()
        self._streams: dict[str, asyncio.Queue[_Item]] = {}  # touched on the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False
        # Per adapter name (loads, autoloads), with a count of holders and waiters: dropped when the
        # count returns to 0, or a churn of new names would grow this dict without bound.
        self._load_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._unloaded: set[str] = set()  # names explicitly unloaded and not explicitly loaded since
        self.error: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="xpulora-step", daemon=True)
        self._thread.start()
        self._accepting = True

    @property
    def healthy(self) -> bool:
        return (self.error is None and self._thread is not None and self._thread.is_alive()
                and self._worker_failure() is None)

    def _worker_failure(self) -> str | None:
        """Why a tensor-parallel worker is gone (the executor's watchdog sets `dead`), else None."""
        return self.engine.executor.dead

    def stop_accepting(self) -> None:
        """New requests get 503 from now on; the ones already in keep running."""
        self._accepting = False

    def abort_all(self) -> None:
        """End every request now with finish_reason "abort" (the end of a shutdown's grace period)."""
        self._accepting = False
        with self._cv:
            self._abort_all = True
            self._cv.notify()

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish for up to grace_s, abort the rest, join."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self._streams and self.healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

    def stats(self) -> EngineStats:
        with self._cv:
            return self._stats

    def lora_stats(self) -> LoRAStats | None:
        """The adapter manager's counters now (None with LoRA off)."""
        lora = self.engine.lora
        if lora is None:
            return None
        return LoRAStats(lora.num_loads, lora.num_unloads, lora.num_evictions, len(lora.list_adapters()),
                         self.served.lora.max_loras)

    def list_adapters(self) -> list[tuple[str, str]]:
        """(name, path) of every registered adapter."""
        lora = self.engine.lora
        return [] if lora is None else [(name, path) for name, path, _ in lora.list_adapters()]

    def has_adapter(self, name: str) -> bool:
        lora = self.engine.lora
        return lora is not None and name in lora

    # -- requests ------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          lora_name: str | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepts it. Raises RequestError (400; its
        ModelNotFoundError subclass 404) or OverloadedError (503) with nothing left behind."""
        if lora_name is not None:
            await self.ensure_adapter(lora_name)
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        with self._cv:
            self._check_accepting()
            limit = self.max_waiting_requests
            if limit is not None and self._would_wait() >= limit:
                raise OverloadedError(f"the server is overloaded ({limit} requests waiting); retry later")
            if request_id in self._streams:
                raise RequestError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = queue
            self._inbox.append(_Add(request_id, prompt, params, lora_name))
            self._queued += 1
            self._cv.notify()
        try:
            first = await queue.get()
        except BaseException:  # cancelled while queued: the add may still happen, so abort after it
            self._release(request_id, abort=True)
            raise
        if isinstance(first, BaseException):
            self._release(request_id, abort=False)
            raise first
        assert isinstance(first, list)
        return RequestStream(self, request_id, queue, first)

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; closing or cancelling the iterator aborts the request."""
        async with await self.add_request(request_id, prompt, params, lora_name) as stream:
            async for out in stream:
                yield out

    def _release(self, request_id: str, abort: bool) -> None:
        with self._cv:
            self._streams.pop(request_id, None)
            if abort:
                self._inbox.append(request_id)
                self._cv.notify()

    def _would_wait(self) -> int:
        """Requests that will be waiting once the queued adds reach the scheduler (free sequence slots
        take some of them first), so a burst below max_num_seqs + the limit is never refused."""
        free = max(0, self.engine.config.scheduler.max_num_seqs - self._stats.num_running)
        return self._queued + self._stats.num_waiting - free

    def _check_accepting(self) -> None:
        if self.error is not None:
            raise EngineFailedError(f"the engine failed and serves no more requests: {self.error!r}")
        if not self._accepting:
            raise OverloadedError("the server is shutting down")

    # -- adapters ------------------------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str, roots: Sequence[str] = (), replace: bool = False) -> None:
        """Load (validated) in a worker thread; serialized per name with autoload. roots: confine the
        load (and later re-reads) to these folders, checked on the opened files. An explicit load lifts
        an earlier explicit unload (see unload_adapter); replace swaps a loaded adapter of that name."""
        async with self._name_lock(name):
            await asyncio.to_thread(self.engine.load_lora_adapter, name, path, False, tuple(roots), replace)
            self._unloaded.discard(name)

    async def unload_adapter(self, name: str) -> None:
        """Unregister; until an explicit load_adapter of this name, autoload does not bring it back
        (an operator who unloads an adapter to retire it expects it gone, DESIGN.md §6)."""
        if name in self.engine.base_names:
            raise AdapterError(f"{name!r} is the base model; it cannot be unloaded")
        async with self._name_lock(name):  # not between an autoload's check and its load
            self.engine.unload_lora_adapter(name)
            if self._autoload_path(name) is not None:  # only names autoload could find: a bounded set
                self._unloaded.add(name)

    def _autoload_path(self, name: str) -> str | None:
        """The folder autoload would load `name` from, or None (autoload off, or no such folder)."""
        cfg = self.engine.config.lora
        if self.engine.lora is None or not cfg.lora_autoload or name in self.engine.base_names:
            return None
        try:
            validate_name(name)
            path = resolve_under_roots(name, cfg.lora_roots)
        except AdapterError:
            return None  # not a loadable name: add_request answers "model not found"
        return path if os.path.isdir(path) else None

    async def ensure_adapter(self, name: str) -> None:
        """Autoload: a model name that is not loaded but names a folder under a lora root is loaded
        once (concurrent first requests wait for the same load), unless it was explicitly unloaded."""
        lora = self.engine.lora
        if lora is None or name in lora or name in self._unloaded:
            return
        path = self._autoload_path(name)
        if path is None:
            return
        async with self._name_lock(name):
            if name in lora or name in self._unloaded:
                return
            try:
                await asyncio.to_thread(self.engine.load_lora_adapter, name, path, False,
                                        self.engine.config.lora.lora_roots)
            except AdapterError as e:
                raise RequestError(f"model {name!r}: loading it from {path} failed: {e}") from e
            log.info("autoloaded adapter %r from %s", name, path)

    @contextlib.asynccontextmanager
    async def _name_lock(self, name: str) -> AsyncIterator[None]:
        lock, users = self._load_locks.setdefault(name, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._load_locks[name]

    # -- the step thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._inbox and not self._stop and not self._abort_all and not engine.has_unfinished():
                    self._cv.wait(IDLE_CHECK_S)
                    if self._worker_failure() is not None:
                        break
                cmds, self._inbox = self._inbox, []
                stop, abort_all, self._abort_all = self._stop, self._abort_all, False
            added: list[tuple[str, list[int] | BaseException]] = []
            outs: list[RequestOutput] = []
            try:
                if (dead := self._worker_failure()) is not None:  # also when idle: fail now, not at the next request
                    raise EngineDeadError(f"tensor-parallel worker died: {dead}")
                with self.lock:
                    for cmd in cmds:
                        if isinstance(cmd, str):
                            engine.abort(cmd)
                        else:
                            added.append((cmd.request_id, self._add(cmd)))
                    if stop or abort_all:
                        outs = [self._abort_output(rid) for rid in list(engine.requests)]
                    elif engine.has_unfinished():
                        outs = engine.step()
                    stats = self._collect()
            except Exception as e:  # the model step failed: nothing is served any more
                log.exception("engine step failed; the server is now unhealthy")
                with self._cv:
                    self.error = e
                self._publish(added, [], None)
                self._notify_failure(e)
                return
            self._publish(added, outs, stats)
            if stop:
                return

    def _notify_failure(self, e: BaseException) -> None:
        if self.on_failure is None or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            self._loop.call_soon_threadsafe(self.on_failure, e)

    def _add(self, cmd: _Add) -> list[int] | BaseException:
        try:
            return self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.lora_name)
        except RequestError as e:
            return e

    def _abort_output(self, request_id: str) -> RequestOutput:
        self.engine.abort(request_id)
        return RequestOutput(request_id, [], "", None, True, "abort")

    def _collect(self) -> EngineStats:
        e = self.engine
        name_of = e.lora.name_of if e.lora is not None else (lambda _id: None)
        running = {n for s in e.scheduler.running if s.lora_id is not None and (n := name_of(s.lora_id))}
        waiting = {n for s in e.scheduler.waiting if s.lora_id is not None and (n := name_of(s.lora_id))}
        return EngineStats(len(e.scheduler.running), len(e.scheduler.waiting), e.blocks.usage, e.num_preemptions,
                           e.blocks.num_queries, e.blocks.num_hits, tuple(sorted(running)), tuple(sorted(waiting)))

    def _publish(self, added: list[tuple[str, list[int] | BaseException]], outs: list[RequestOutput],
                 stats: EngineStats | None) -> None:
        with self._cv:
            self._queued -= len(added)
            if stats is not None:
                self._stats = stats
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, added, outs)
        except RuntimeError:  # the loop is closed (interpreter exit): nobody is listening
            log.warning("event loop closed; %d outputs dropped", len(outs))

    def _deliver(self, added: list[tuple[str, list[int] | BaseException]], outs: list[RequestOutput]) -> None:
        """On the event loop: feed acceptances, failures and outputs to the per-request queues."""
        for rid, result in added:
            if (q := self._streams.get(rid)) is not None:
                q.put_nowait(result)
        for out in outs:
            if (q := self._streams.get(out.request_id)) is not None:
                q.put_nowait(out)
        if self.error is not None:
            dead = EngineFailedError(f"the engine failed: {self.error!r}")
            for q in self._streams.values():
                q.put_nowait(dead)
