"""Tensor-parallel ranks. Rank 0 lives in the engine process and samples; ranks 1..N-1 are spawned
processes that receive each step as a small typed message and run their shard of the model.

A rank that dies or raises makes the next step fail loudly (EngineDeadError) instead of hanging: a
dead peer closes its sockets, so the pending collective errors out (and a process-group timeout is
the backstop); a worker that raises sends its traceback first. Shutdown leaves no process behind.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from engine.config import EngineConfig
from engine.device import DeviceKind, check_tp_fits, detect, device_count, dist_backend, rank_device, worker_env
from engine.distributed import destroy_tp, init_tp
from engine.errors import EngineDeadError
from engine.gc_pauses import freeze_startup_heap
from engine.loader import CheckpointInfo, inspect_checkpoint, thread_locked_progress
from engine.lora.adapter import LoRAAdapter
from engine.model_runner import KVCacheSpec, ModelRunner
from engine.sampler import SamplerOutput, StepFuture
from engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)
TP_TIMEOUT_S = float(os.environ.get("XPULORA_TP_TIMEOUT", "120"))


# -- messages (rank 0 -> workers, workers -> rank 0) ------------------------------------------------------
@dataclass(frozen=True)
class StepMsg:
    step: SchedulerOutput
    lora_loads: list[tuple[int, LoRAAdapter]]


@dataclass(frozen=True)
class ShutdownMsg:
    pass


@dataclass(frozen=True)
class ReadyMsg:
    rank: int


@dataclass(frozen=True)
class ErrorMsg:
    rank: int
    message: str


# -- executors ------------------------------------------------------------------------------------------------
class _Executor:
    """What the engine reads from rank 0's runner, the same for both executors."""

    runner: ModelRunner
    dead: str | None = None
    """Why the engine can no longer run (a worker died or a collective failed); None while healthy."""

    @property
    def kv(self) -> KVCacheSpec:
        return self.runner.kv

    def lora_target_shapes(self) -> dict[str, tuple[int, int]]:
        return self.runner.lora_target_shapes()

    def execute(self, step: SchedulerOutput, lora_loads: list[tuple[int, LoRAAdapter]]) -> SamplerOutput:
        """launch and wait for the sampled ids."""
        return self.launch(step, lora_loads).result()


class LocalExecutor(_Executor):
    """tp = 1: the runner in this process (nothing else can die, so `dead` stays None)."""

    def __init__(self, config: EngineConfig, info: CheckpointInfo, kind: DeviceKind, max_model_len: int,
                 progress: bool, eos_ids: frozenset[int] = frozenset()) -> None:
        device = rank_device(kind, 0)
        device.activate()
        self.runner = ModelRunner(config, info, device, max_model_len, progress, eos_ids)

    def launch(self, step: SchedulerOutput, lora_loads: list[tuple[int, LoRAAdapter]]) -> StepFuture:
        return self.runner.launch(step, lora_loads)

    def shutdown(self) -> None:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _threads_per_rank(kind: DeviceKind, size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size) if kind == "cpu" else 1


def _worker_main(config: EngineConfig, max_model_len: int, rank: int, size: int, init_method: str,
                 conn: Connection) -> None:
    try:
        thread_locked_progress()
        kind = detect(config.parallel.device)
        torch.set_num_threads(_threads_per_rank(kind, size))
        device = rank_device(kind, rank)
        device.activate()
        init_tp(rank, size, dist_backend(kind), init_method, device.dist_device_id, TP_TIMEOUT_S)
        runner = ModelRunner(config, inspect_checkpoint(config.model.path), device, max_model_len)
        freeze_startup_heap()  # a collection's pause here would stall every rank's collective (engine.gc_pauses)
        conn.send(ReadyMsg(rank))
        while True:
            msg = conn.recv()
            if isinstance(msg, ShutdownMsg):
                break
            runner.execute(msg.step, msg.lora_loads)
    except (EOFError, KeyboardInterrupt):
        log.info("tp rank %d: rank 0 went away, exiting", rank)
    except BaseException:
        try:
            conn.send(ErrorMsg(rank, traceback.format_exc()))
        finally:
            os._exit(1)
    finally:
        destroy_tp()


class MultiprocExecutor(_Executor):
    """tp > 1: rank 0 here, ranks 1..N-1 spawned."""

    def __init__(self, config: EngineConfig, info: CheckpointInfo, kind: DeviceKind, max_model_len: int,
                 progress: bool, eos_ids: frozenset[int] = frozenset()) -> None:
        size = config.parallel.tensor_parallel_size
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        self._closing = False
        saved = {k: os.environ.get(k) for k in worker_env(kind)}
        os.environ.update(worker_env(kind))  # inherited by the spawned children
        try:
            for rank in range(1, size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, args=(config, max_model_len, rank, size, init_method, child),
                                name=f"xpulora-tp{rank}", daemon=True)
                p.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(p)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            device = rank_device(kind, 0)
            device.activate()
            init_tp(0, size, dist_backend(kind), init_method, device.dist_device_id, TP_TIMEOUT_S)
            self.runner = ModelRunner(config, info, device, max_model_len, progress, eos_ids)
            for conn in self.conns:
                msg = conn.recv()
                if isinstance(msg, ErrorMsg):
                    raise EngineDeadError(f"tensor-parallel rank {msg.rank} failed to start:\n{msg.message}")
        except BaseException:
            self.shutdown()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="xpulora-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        exited = mp.connection.wait([p.sentinel for p in self.procs])
        if not self._closing:
            dead = [p for p in self.procs if p.sentinel in exited]
            self.dead = ", ".join(f"{p.name} exited with code {_exit_code(p)}" for p in dead) or "a worker exited"
            log.error("tensor-parallel worker died: %s", self.dead)

    def _failure(self) -> str:
        # A peer's socket closes a moment before its process exits. Exits are read from the sentinels, not
        # from is_alive(): the watchdog thread may be reaping the same process, and then our own waitpid
        # finds nothing and is_alive() says True until the watchdog has stored the exit code.
        exited = mp.connection.wait([p.sentinel for p in self.procs], timeout=2)
        msgs = []
        for conn in self.conns:
            try:
                while conn.poll(0.5):
                    m = conn.recv()
                    if isinstance(m, ErrorMsg):
                        msgs.append(f"rank {m.rank}:\n{m.message}")
            except (EOFError, OSError):
                continue
        dead = [f"{p.name} exited with code {_exit_code(p)}" for p in self.procs if p.sentinel in exited]
        return "; ".join(dead + msgs) or "a tensor-parallel collective failed"

    def launch(self, step: SchedulerOutput, lora_loads: list[tuple[int, LoRAAdapter]]) -> StepFuture:
        if self.dead is None and any(not p.is_alive() for p in self.procs):
            self.dead = f"tensor-parallel worker died: {self._failure()}"
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        msg = StepMsg(step, lora_loads)
        try:
            for conn in self.conns:
                conn.send(msg)
            return _GuardedFuture(self, self.runner.launch(step, lora_loads))
        except (RuntimeError, OSError, EOFError) as e:
            raise self._step_failed(e) from e

    def _step_failed(self, e: BaseException) -> EngineDeadError:
        self.dead = f"tensor-parallel step failed ({e}); {self._failure()}"
        return EngineDeadError(self.dead)

    def shutdown(self) -> None:
        self._closing = True
        for conn in self.conns:
            try:
                conn.send(ShutdownMsg())
            except (OSError, EOFError, BrokenPipeError):
                continue
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        destroy_tp()


class _GuardedFuture(StepFuture):
    """A tensor-parallel step's future: a collective that failed on the way (a dead peer) surfaces when the
    result is read, and is reported as the engine's death, as a failure at launch is."""

    def __init__(self, executor: MultiprocExecutor, inner: StepFuture) -> None:
        self.executor, self.inner = executor, inner

    def result(self) -> SamplerOutput:
        try:
            return self.inner.result()
        except (RuntimeError, OSError, EOFError) as e:
            raise self.executor._step_failed(e) from e


def _exit_code(p: mp.process.BaseProcess, wait_s: float = 1.0) -> int | None:
    """The exit code of a process whose sentinel is ready, once whichever thread reaps it has stored it."""
    deadline = time.monotonic() + wait_s
    while p.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return p.exitcode


def make_executor(config: EngineConfig, info: CheckpointInfo, kind: DeviceKind, max_model_len: int,
                  progress: bool, eos_ids: frozenset[int] = frozenset()) -> LocalExecutor | MultiprocExecutor:
    """eos_ids: rank 0's sampler masks them under min_tokens."""
    if config.parallel.tensor_parallel_size == 1:
        return LocalExecutor(config, info, kind, max_model_len, progress, eos_ids)
    check_tp_fits(kind, config.parallel.tensor_parallel_size, device_count(kind))
    return MultiprocExecutor(config, info, kind, max_model_len, progress, eos_ids)
