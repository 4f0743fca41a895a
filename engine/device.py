"""The only module that knows device kinds (xpu / cuda / cpu) and picks the collective backend.

Everything else asks this module: which device a rank uses, how to synchronize, how much memory
is free, which distributed backend to use and which int4 kernel suits the device.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from engine.errors import ConfigError
from engine.lazy import LazyModule

if TYPE_CHECKING:
    import torch

    from kernels import triton_env
else:  # the API process reads the device names only (--device): torch loads with the first device use
    torch = LazyModule("torch")
    triton_env = LazyModule("kernels.triton_env")

DeviceKind = Literal["xpu", "cuda", "cpu"]
DeviceName = Literal["auto", "xpu", "cuda", "cpu"]
"""What --device accepts: auto picks xpu, then cuda, then cpu."""
DEVICE_CHOICES: tuple[str, ...] = get_args(DeviceName)
log = logging.getLogger(__name__)


def _has_xpu() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def _maybe_import_ipex() -> None:
    # IPEX is end-of-life; only an old torch without native XPU needs it to expose torch.xpu.
    if hasattr(torch, "xpu"):
        return
    try:
        importlib.import_module("intel_extension_for_pytorch")
    except ImportError:
        log.debug("no native torch.xpu and no intel_extension_for_pytorch")


def detect(requested: str = "auto") -> DeviceKind:
    """Resolve --device: auto picks xpu, then cuda, then cpu; an explicit kind must be present."""
    _maybe_import_ipex()
    if requested == "auto":
        if _has_xpu():
            return "xpu"
        if torch.cuda.is_available():
            return "cuda"
        return "cpu"
    if requested == "xpu" and not _has_xpu():
        raise RuntimeError("--device xpu: no Intel GPU visible to torch (torch.xpu.is_available() is False); "
                           "check the driver, the render group and ZE_AFFINITY_MASK")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device visible to torch")
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"unknown device {requested!r}; choose one of {', '.join(DEVICE_CHOICES)}")
    return requested  # type: ignore[return-value]


@dataclass(frozen=True)
class Kernels:
    """Each op's implementation, chosen once per engine (Device.kernels); every layer receives its own when
    the model is built. Names as kernels.attention, kernels.fused, kernels.gdn and kernels.int4 take them."""

    attention: str = "reference"
    fused: str = "reference"
    gdn: str = "reference"
    int4: str = "reference"


@dataclass(frozen=True)
class Device:
    """One rank's device: kind plus local index."""

    kind: DeviceKind
    index: int = 0

    @property
    def torch_device(self) -> torch.device:
        if self.kind == "cpu":
            return torch.device("cpu")
        return torch.device(self.kind, self.index)

    def activate(self) -> None:
        """Make this the current device of the process (each TP rank owns one device)."""
        if self.kind == "cuda":
            torch.cuda.set_device(self.index)
        elif self.kind == "xpu":
            torch.xpu.set_device(self.index)

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.index)
        elif self.kind == "xpu":
            torch.xpu.synchronize(self.index)

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes on the device; for the CPU, available and total RAM."""
        if self.kind == "cuda":
            return torch.cuda.mem_get_info(self.index)
        if self.kind == "xpu":
            return torch.xpu.mem_get_info(self.index)
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return avail, pages

    @property
    def dist_device_id(self) -> torch.device | None:
        """Device a process group binds to (None on the CPU, where gloo needs none)."""
        return None if self.kind == "cpu" else self.torch_device

    def default_dtype(self) -> torch.dtype:
        # float32 on the CPU: its oracles compare in it (bf16 is faster only where the CPU has AMX)
        return torch.float32 if self.kind == "cpu" else torch.bfloat16

    def lora_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """LoRA slots' dtype under lora_dtype "auto": the model's; float32 on the CPU, whose few-row LoRA GEMMs
        run faster in it than in 16 bits (and 16-bit slots would be converted on every call)."""
        return torch.float32 if self.kind == "cpu" else model_dtype

    @property
    def pins_memory(self) -> bool:
        """Host staging buffers are pinned (page-locked) so their copies to the device run asynchronously."""
        return self.kind != "cpu"

    def new_event(self) -> object | None:
        """An event to wait for one queued copy (None on the CPU, where copies finish when issued)."""
        if self.kind == "cpu":
            return None
        return torch.cuda.Event() if self.kind == "cuda" else torch.xpu.Event()

    def new_graph(self) -> object:
        return torch.cuda.CUDAGraph() if self.kind == "cuda" else torch.xpu.XPUGraph()

    def graph_pool(self) -> object:
        return torch.cuda.graph_pool_handle() if self.kind == "cuda" else torch.xpu.graph_pool_handle()

    @contextlib.contextmanager
    def graph_capture(self, graph: object, pool: object) -> Iterator[None]:
        """Capture the work queued on this device into graph. The garbage collector stays off meanwhile: a
        finalizer run mid-capture (a freed kernel module, an event) is an illegal call that invalidates the
        capture; on CUDA, calls from other threads (another engine's, a watchdog's) are left out of it. No
        collection here: a full one costs ~0.1 s before the heap is frozen and an engine captures ~50 graphs
        (the caller collects once per pass, engine/graph_runner)."""
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            if self.kind == "cuda":
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # type: ignore[arg-type]
                    yield
            else:
                with torch.xpu.graph(graph, pool=pool):  # type: ignore[attr-defined]
                    yield
        finally:
            if was_enabled:
                gc.enable()

    @contextlib.contextmanager
    def sync_debug(self) -> Iterator[None]:
        """Warn at every implicit host-device synchronization torch makes meanwhile (a blocking copy, .item(),
        a nonzero): the GPU checks count them in the steady-state steps of async scheduling, which must have
        none. CUDA only (torch has no such mode for other devices); elsewhere nothing is reported."""
        if self.kind != "cuda":
            yield
            return
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)

    @property
    def supports_graphs(self) -> bool:
        return self.kind == "cuda" or (self.kind == "xpu" and hasattr(torch.xpu, "XPUGraph"))

    def kernels(self, attention: str, fused: str, gdn: str, int4: str, hybrid: bool) -> Kernels:
        """Resolve each op's configured name ("auto": this device's choice); gdn only for hybrid models."""
        return Kernels(self.attention_backend(attention), self.fused_backend(fused),
                       self.gdn_backend(gdn) if hybrid else "reference", self.int4_backend(int4))

    def int4_backend(self, requested: str = "auto") -> str:
        """int4 matmul backend in kernels.int4 (KernelConfig.int4). auto: `tuned` on GPUs (1.5x faster decode
        at batch 32 on an H200 than the fixed thresholds, docs/PERFORMANCE.md), the reference on the CPU.
        tuned -> "tuned:" + the candidates timed per layer shape at start-up (engine.layers.quant,
        kernels.int4_tune). auto:native_X stays selectable: the fixed per-row-count dispatch."""
        if requested == "auto":
            requested = "reference" if self.kind == "cpu" else "tuned"
        if requested != "tuned":
            return requested
        if self.kind == "cpu":
            return "tuned:native_cpu,reference"
        cuda_c = "cuda_mma," if self.kind == "cuda" else ""  # CUDA C (kernels.int4_cuda): NVIDIA GPUs only
        return f"tuned:native_{self.kind},{cuda_c}triton_gemv,triton_mma,triton,dequant"

    def product_name(self) -> str:
        """The device's model name (keys tuned kernel tables: the same for every rank of one model of GPU)."""
        if self.kind == "cuda":
            return torch.cuda.get_device_name(self.index)
        if self.kind == "xpu":
            return torch.xpu.get_device_name(self.index)
        return f"cpu {platform.machine()} {os.cpu_count()} threads"

    def empty_cache(self) -> None:
        """Give the allocator's cached free blocks back to the device (after the int4 tuner's transient copies, so
        that the KV cache, sized from the free memory, does not lose them)."""
        if self.kind == "cuda":
            torch.cuda.empty_cache()
        elif self.kind == "xpu":
            torch.xpu.empty_cache()

    def time_calls(self, calls: Sequence[Callable[[], object]]) -> float:
        """Mean µs per call of `calls` (the int4 dispatch's tuner: each call on its own weight copy), run as the
        engine runs its decode steps: replayed from a device graph where the device has graphs, else eagerly."""
        for c in calls:  # warm-up: compiles, autotuner-free first launches, allocator pools
            c()
        self.synchronize()
        rounds = max(1, 32 // len(calls))
        replays = 5
        if self.supports_graphs:
            graph = self.new_graph()
            was_enabled = gc.isenabled()
            gc.disable()  # no finalizer may run mid-capture (see graph_capture); no gc.collect: this runs often
            try:
                ctx = (torch.cuda.graph(graph, capture_error_mode="thread_local") if self.kind == "cuda"  # type: ignore[arg-type]
                       else torch.xpu.graph(graph))  # type: ignore[attr-defined]
                with ctx:  # CUDA: calls from other threads are left out of the capture (as graph_capture)
                    for _ in range(rounds):
                        for c in calls:
                            c()
            finally:
                if was_enabled:
                    gc.enable()
            run: Callable[[], object] = graph.replay  # type: ignore[attr-defined]
        else:
            def run() -> None:
                for _ in range(rounds):
                    for c in calls:
                        c()
        run()
        self.synchronize()
        t0 = time.perf_counter()
        for _ in range(replays):
            run()
        self.synchronize()
        return (time.perf_counter() - t0) / (replays * rounds * len(calls)) * 1e6

    def attention_backend(self, requested: str = "auto") -> str:
        """Paged attention kernels (kernels.attention): Triton on GPUs, the torch reference on the CPU."""
        if requested != "auto":
            return requested
        return "reference" if self.kind == "cpu" else "triton"

    def fused_backend(self, requested: str = "auto") -> str:
        """Small per-layer ops (kernels.fused: norms, rotary, silu-and-mul): Triton on GPUs where it runs."""
        if requested != "auto":
            return requested
        return "triton" if self.kind != "cpu" and triton_env.usable() else "reference"

    def gdn_backend(self, requested: str = "auto") -> str:
        """Gated-delta-rule kernels (kernels.gdn.BACKENDS): on GPUs fla-core's for prompts when installed, our Triton
        kernels (kernels.gdn_triton) for the rest; without fla-core, prompts' recurrence on the torch reference."""
        if requested != "auto" or self.kind == "cpu":
            return "reference" if requested == "auto" else requested
        if importlib.util.find_spec("fla") is not None:
            return "fla"
        if triton_env.usable():
            log.warning("fla-core not installed: Gated DeltaNet prompts use the slow torch reference on %s", self.kind)
            return "triton"
        log.warning("no fla-core nor triton: Gated DeltaNet layers use the slow torch reference on %s", self.kind)
        return "reference"

    def describe(self) -> str:
        """The device and, for a GPU, its product name (check-device reports)."""
        if self.kind == "cuda":
            return f"cuda:{self.index} ({torch.cuda.get_device_name(self.index)})"
        if self.kind == "xpu":
            return f"xpu:{self.index} ({torch.xpu.get_device_name(self.index)})"
        return "cpu"

    def lora_candidates(self, requested: str) -> list[str]:
        """LoRA implementations (engine.lora.punica.LORA_IMPLS) to try in order, ending with the reference."""
        if requested == "reference" or (requested == "auto" and (self.kind == "cpu" or not triton_env.usable())):
            return ["reference"]
        return ["triton", "reference"]


def cuda_compiler_available() -> bool:
    """CUDA C can be compiled at run time here (NVRTC through torch, kernels.int4_cuda): CUDA, not ROCm, sm_80+."""
    if not torch.cuda.is_available() or torch.version.hip is not None or torch.cuda.get_device_capability() < (8, 0):
        return False
    try:
        from torch.cuda._utils import _cuda_load_module, _nvrtc_compile  # noqa: F401  (private: may move)
    except ImportError:
        return False
    return True


def cuda_build_key(index: int) -> str:
    """What a binary compiled by compile_cuda depends on besides its source: architecture, CUDA and torch."""
    return f"sm{''.join(map(str, torch.cuda.get_device_capability(index)))}|{torch.version.cuda}|{torch.__version__}"


CUDA_COMPILE_OPTIONS = ("-std=c++17", "--use_fast_math")
"""NVRTC options of the project's CUDA C (also tools/cuda_compile.py's, which compiles it without a GPU)."""


def compile_cuda(source: str, first_kernel: str, index: int) -> bytes:
    """One NVRTC program for CUDA device `index` (extern "C" kernels; a few seconds of one CPU)."""
    from torch.cuda._utils import _nvrtc_compile

    arch = "".join(map(str, torch.cuda.get_device_capability(index)))
    with torch.cuda.device(index):
        return _nvrtc_compile(source, first_kernel, compute_capability=arch,
                              nvcc_options=list(CUDA_COMPILE_OPTIONS))[0]


def load_cuda(binary: bytes, names: list[str], index: int) -> dict[str, Callable[..., None]]:
    """The named kernels of a compiled module on device `index`; each is called as
    kernel(grid=(x, y, z), block=(x, y, z), args=[tensors and ints]) on the current stream (graph-capturable)."""
    from torch.cuda._utils import _cuda_load_module

    with torch.cuda.device(index):
        kernels = _cuda_load_module(binary, names)
    assert isinstance(kernels, dict)
    return kernels  # type: ignore[return-value]


def device_count(kind: DeviceKind) -> int | None:
    """Devices of this kind visible to torch; None on the CPU, where TP ranks share the host."""
    if kind == "cuda":
        return torch.cuda.device_count()
    if kind == "xpu":
        return torch.xpu.device_count()
    return None


def core_threads(kind: DeviceKind, tp_size: int, cpus: int) -> int | None:
    """torch threads of TP rank 0 in the engine-core process, None where torch's default is right (GPUs).
    On the CPU the API process next to it (HTTP, detokenizing, SSE: one busy thread under load) keeps one
    core, and the ranks share the rest: with the default (every core) the core's compute threads and the
    API process take turns on the same cores, which on 2 cores cost 15-20 % of the server's tokens/s
    (docs/PERFORMANCE.md)."""
    if kind != "cpu":
        return None
    return max(1, (cpus - 1) // tp_size)


def check_tp_fits(kind: DeviceKind, tp_size: int, visible: int | None) -> None:
    """One device per TP rank: fail before spawning ranks that could never join (a rank on a missing
    device dies, and rank 0 would wait out the rendezvous timeout)."""
    if visible is not None and tp_size > visible:
        raise ConfigError(f"tensor_parallel_size {tp_size} needs {tp_size} {kind} devices; {visible} visible "
                          "(CUDA_VISIBLE_DEVICES / ZE_AFFINITY_MASK limit what torch sees)")


def rank_device(kind: DeviceKind, local_rank: int) -> Device:
    """Device of a TP rank. On XPU, ZE_AFFINITY_MASK (set by the operator) already limits what is visible."""
    if kind == "cpu":
        return Device("cpu", 0)
    return Device(kind, local_rank)


def dist_backend(kind: DeviceKind) -> str:
    """Collective backend: xccl (torch >= 2.8) or the old ccl bindings on XPU, nccl on CUDA, gloo on the CPU."""
    if kind == "cuda":
        return "nccl"
    if kind == "cpu":
        return "gloo"
    is_xccl = getattr(torch.distributed, "is_xccl_available", None)
    if is_xccl is not None and is_xccl():
        return "xccl"
    try:
        importlib.import_module("oneccl_bindings_for_pytorch")
    except ImportError as e:
        raise RuntimeError("XPU tensor parallelism needs torch >= 2.8 (xccl) or "
                           "oneccl_bindings_for_pytorch (ccl)") from e
    return "ccl"


def worker_env(kind: DeviceKind) -> dict[str, str]:
    """Environment for spawned TP workers."""
    env: dict[str, str] = {}
    if kind == "cpu":
        # Each rank gets its share of the cores instead of oversubscribing them.
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    return env
