"""The engine core: a plain loop around LLMEngine that talks to the API process over ZMQ.

Each iteration drains every waiting message without blocking (it blocks, up to POLL_S, only when nothing
runs), applies them (adds, aborts, utilities), runs one core step and sends one Outputs message:
acceptances, one TokenDelta per request that sampled, and the stats /metrics shows. Adapter loads read
files, so they run on threads (the LoRA manager has its own lock) and their replies are sent by the
loop. The loop ends on a shutdown utility, when the API process goes away (its parent sentinel closes,
or getppid() changes: checked every iteration) and, with a Failed message, when a step raises or a
tensor-parallel rank dies. It runs in its own process (`core_main`) or, in-process, on a thread.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch
import zmq

from engine.config import EngineConfig
from engine.device import core_threads, detect
from engine.errors import AdapterError, EngineDeadError, RequestError
from engine.gc_pauses import PROCESS, GcPauses, freeze_startup_heap
from engine.llm_engine import LLMEngine
from engine.loader import thread_locked_progress
from engine.messages import (
    Abort,
    Accepted,
    AdapterCall,
    Add,
    Failed,
    Outbound,
    Outputs,
    Ready,
    Reply,
    StartupFailed,
    Stats,
    TokenDelta,
    Utility,
    encoder,
    error_info,
    inbound_decoder,
)

log = logging.getLogger(__name__)
POLL_S = 0.1  # idle: how long to block on the inbox before checking the parent and the TP ranks again


class EngineCore:
    def __init__(self, llm: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket,
                 parent_alive: Callable[[], bool] = lambda: True, parent_fd: int | None = None,
                 gc_pauses: GcPauses | None = None) -> None:
        self.llm, self.inbox, self.outbox = llm, inbox, outbox
        self.parent_alive = parent_alive
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        if parent_fd is not None:  # readable (EOF) the moment the parent dies: no wait for the poll timeout
            self.poller.register(parent_fd, zmq.POLLIN)
        self._parent_fd = parent_fd
        self._enc, self._dec = encoder(), inbound_decoder()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="xpulora-adapter")
        self._replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        self._pending_calls = 0
        self._stop = False
        self.failed = False
        self._got = False  # a message arrived this iteration: send fresh stats
        self.idle_seconds = 0.0
        """Time blocked on the inbox with nothing to run (the rest of the loop outside steps moves messages)."""
        # this process's collections when it is the engine-core process; on a thread of the API process, the API
        # process's count covers the core's
        self.gc = gc_pauses or GcPauses()

    def send(self, msg: Outbound) -> None:
        self.outbox.send(self._enc.encode(msg))

    def run(self) -> None:
        llm = self.llm
        try:
            while not self._stop:
                busy = llm.has_unfinished()
                self._got = False
                waits = not (busy or self._pending_calls)
                accepted = self._drain(POLL_S if waits else 0)
                if not self.parent_alive():
                    log.warning("the API process is gone; the engine core exits")
                    return
                if (dead := llm.executor.dead) is not None:
                    raise EngineDeadError(f"tensor-parallel worker died: {dead}")
                deltas = llm.core_step() if not self._stop and llm.has_unfinished() else []
                replies = [self._replies.get() for _ in range(self._replies.qsize())]
                if accepted or deltas or busy or self._got or replies or waits:
                    # after an idle wait too (at most once per POLL_S): /metrics' idle time stays current
                    self.send(Outputs(accepted, deltas, self._stats()))
                for reply in replies:
                    self._pending_calls -= 1
                    self.send(reply)
        except Exception as e:  # the model step failed: nothing is served any more
            log.exception("engine step failed; the engine core stops")
            self.failed = True
            self.send(Failed(repr(e)))
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- inputs ---------------------------------------------------------------------------------------
    def _drain(self, timeout_s: float) -> list[Accepted]:
        accepted: list[Accepted] = []
        t0 = time.perf_counter()
        events = dict(self.poller.poll(int(timeout_s * 1000)))
        if timeout_s:
            self.idle_seconds += time.perf_counter() - t0
        if self._parent_fd is not None and self._parent_fd in events:
            self.parent_alive = lambda: False
        while not self._stop:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self._dec.decode(raw)
            self._got = True
            if isinstance(msg, Add):
                accepted.append(self._add(msg))
            elif isinstance(msg, Abort):
                for rid in msg.request_ids:
                    self.llm.abort(rid)
            elif isinstance(msg, AdapterCall):
                self._pending_calls += 1
                self._pool.submit(self._adapter_call, msg)
            else:
                self._utility(msg)
        return accepted

    def _add(self, msg: Add) -> Accepted:
        try:
            return Accepted(msg.request_id, self.llm.add_core(msg.request_id, msg.prompt, msg.params, msg.lora_name))
        except RequestError as e:
            return Accepted(msg.request_id, None, error_info(e))

    def _utility(self, msg: Utility) -> None:
        if msg.op == "reset_prefix_cache":
            self.llm.reset_prefix_cache()
        else:  # abort_all, shutdown: every request ends with "abort"
            ids = list(self.llm.requests)
            for rid in ids:
                self.llm.abort(rid)
            self.send(Outputs([], [TokenDelta(rid, [], None, "abort", 0) for rid in ids], self._stats()))
            self._stop = msg.op == "shutdown"
        self.send(Reply(msg.call_id))

    def _adapter_call(self, msg: AdapterCall) -> None:
        """On a pool thread: the reply goes through the queue (a ZMQ socket belongs to one thread)."""
        llm = self.llm
        try:
            if msg.op == "load":
                llm.load_lora_adapter(msg.name, msg.path, False, msg.roots, msg.replace)
            else:
                llm.unload_lora_adapter(msg.name)
            reply = Reply(msg.call_id, adapters=self._adapters())
        except (AdapterError, KeyError, RequestError) as e:  # AdapterNotLoadedError is a KeyError
            reply = Reply(msg.call_id, error_info(e), adapters=self._adapters())
        except Exception as e:  # a bug, not the request: say so and keep serving
            log.exception("adapter %s of %r failed", msg.op, msg.name)
            reply = Reply(msg.call_id, error_info(e))
        self._replies.put(reply)

    def _adapters(self) -> list[tuple[str, str]]:
        lora = self.llm.lora
        return [] if lora is None else [(name, path) for name, path, _ in lora.list_adapters()]

    def _stats(self) -> Stats:
        e = self.llm
        lora = e.lora
        name_of = lora.name_of if lora is not None else (lambda _id: None)
        running = {n for s in e.scheduler.running if s.lora_id is not None and (n := name_of(s.lora_id))}
        waiting = {n for s in e.scheduler.waiting if s.lora_id is not None and (n := name_of(s.lora_id))}
        counts = (lora.num_loads, lora.num_unloads, lora.num_evictions) if lora is not None else (0, 0, 0)
        return Stats(len(e.scheduler.running), len(e.scheduler.waiting), e.blocks.usage, e.num_preemptions,
                     e.blocks.num_queries, e.blocks.num_hits, tuple(sorted(running)), tuple(sorted(waiting)), *counts,
                     time.time(), msgspec.structs.replace(e.steps), self.idle_seconds, self.gc.total_seconds,
                     self.gc.collections[2], self.gc.frozen_objects)


def ready(llm: LLMEngine) -> Ready:
    lora = [] if llm.lora is None else [(n, p) for n, p, _ in llm.lora.list_adapters()]
    kernels = [(c.op, c.chosen, [tuple(r) for r in c.rejected], c.checked) for c in llm.runner.kernel_choices]
    tok = type(llm.tokenizer)
    return Ready((llm.served_model_name, *llm.config.model.extra_served_model_names), llm.max_model_len,
                 llm.vocab_size, sorted(llm.eos_ids), llm.lora is not None, llm.config.scheduler.max_num_seqs,
                 lora, kernels, os.getpid(), f"{tok.__module__}.{tok.__qualname__}")


def _sockets(ctx: zmq.Context, in_addr: str, out_addr: str) -> tuple[zmq.Socket, zmq.Socket]:
    """The client binds both ends; the core connects."""
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    return inbox, outbox


def start_thread(llm: LLMEngine, ctx: zmq.Context, in_addr: str, out_addr: str) -> threading.Thread:
    """The core on a thread of this process (tests, embedding): same loop, same messages, inproc sockets."""
    inbox, outbox = _sockets(ctx, in_addr, out_addr)

    def run() -> None:
        try:
            core = EngineCore(llm, inbox, outbox)
            core.send(ready(llm))
            core.run()
        finally:
            inbox.close(linger=0)
            outbox.close(linger=1000)

    thread = threading.Thread(target=run, name="xpulora-core", daemon=True)
    thread.start()
    return thread


def core_main(config: EngineConfig, in_addr: str, out_addr: str, progress: bool) -> None:
    """The engine-core process (spawned by the API process): build the engine, say Ready, serve, exit.
    A start-up failure is sent as StartupFailed (the API process reports it as the server did before)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Ctrl-C or a SIGTERM to the whole process group is the API process's to handle: it drains, then
    # tells the core to stop (the tensor-parallel ranks inherit the ignore).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    alive, parent_fd = parent_watch()
    _set_threads(config)
    thread_locked_progress()
    ctx = zmq.Context()
    inbox, outbox = _sockets(ctx, in_addr, out_addr)
    enc = encoder()
    code = 0
    try:
        llm = LLMEngine(config, progress)
    except Exception as e:  # every start-up failure goes back to the API process
        outbox.send(enc.encode(StartupFailed(error_info(e))))
        log.info("engine start-up failed: %s", e)
        code = 1
    else:
        # what start-up built lives as long as the process: out of every later full collection's walk
        frozen = freeze_startup_heap()
        log.info("engine core: %d start-up objects frozen out of garbage collection", frozen)
        core = EngineCore(llm, inbox, outbox, alive, parent_fd, PROCESS.install())
        try:
            core.send(ready(llm))
            core.run()
        finally:
            if not core.parent_alive():  # orphaned: exit now; the ranks exit on their pipe's EOF (worker.py)
                os._exit(1)
            llm.shutdown()  # the tensor-parallel ranks
        code = 0 if not core.failed else 1
    inbox.close(linger=0)
    outbox.close(linger=1000)
    ctx.term()
    os._exit(code)  # no atexit joins of leftover threads (adapter pool): the process is done


def _set_threads(config: EngineConfig) -> None:
    """Rank 0's compute threads (engine.device.core_threads), unless the operator set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    try:
        kind = detect(config.parallel.device)
    except (RuntimeError, ValueError):  # LLMEngine reports a missing device itself
        return
    n = core_threads(kind, config.parallel.tensor_parallel_size, len(os.sched_getaffinity(0)))
    if n is not None:
        torch.set_num_threads(n)


def parent_watch() -> tuple[Callable[[], bool], int | None]:
    """How the core notices that the API process died: getppid() changing, and the multiprocessing parent
    sentinel (a pipe that reads EOF when the parent exits), None when there is none."""
    import multiprocessing as mp

    ppid = os.getppid()
    parent = mp.parent_process()
    return (lambda: os.getppid() == ppid), (parent.sentinel if parent is not None else None)
