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
from collections.abc import Iterator
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
        # float32 on the CPU: bf16 matmuls are slow there and exactness helps tests.
        return torch.float32 if self.kind == "cpu" else torch.bfloat16

    @property
    def pins_memory(self) -> bool:
        """Host staging buffers are pinned (page-locked) so their copies to the device run asynchronously."""
        return self.kind != "cpu"

    def new_event(self) -> object | None:
        """An event to wait for one queued copy (None on the CPU, where copies finish when issued)."""
        if self.kind == "cuda":
            return torch.cuda.Event()
        if self.kind == "xpu":
            return torch.xpu.Event()
        return None

    def new_graph(self) -> object:
        return torch.cuda.CUDAGraph() if self.kind == "cuda" else torch.xpu.XPUGraph()

    def graph_pool(self) -> object:
        return torch.cuda.graph_pool_handle() if self.kind == "cuda" else torch.xpu.graph_pool_handle()

    @contextlib.contextmanager
    def graph_capture(self, graph: object, pool: object) -> Iterator[None]:
        """Capture the work queued on this device into graph. The garbage collector stays off meanwhile: a
        finalizer run mid-capture (a freed kernel module, an event) is an illegal call that invalidates the
        capture; on CUDA, calls from other threads (another engine's, a watchdog's) are left out of it."""
        gc.collect()
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
    def capture_session(self) -> Iterator[None]:
        """Around captures begun and ended by hand (engine.piecewise): a side stream, since a graph cannot be
        captured on the default stream, and the garbage collector off, as in graph_capture."""
        self.synchronize()
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        mod = torch.cuda if self.kind == "cuda" else torch.xpu
        stream = mod.Stream()
        stream.wait_stream(mod.current_stream())
        try:
            with mod.stream(stream):
                yield
        finally:
            mod.current_stream().wait_stream(stream)
            if was_enabled:
                gc.enable()

    def begin_capture(self, graph: object, pool: object) -> None:
        if self.kind == "cuda":
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")  # type: ignore[attr-defined]
        else:
            graph.capture_begin(pool=pool)  # type: ignore[attr-defined]

    def end_capture(self, graph: object) -> None:
        graph.capture_end()  # type: ignore[attr-defined]

    @property
    def supports_graphs(self) -> bool:
        if self.kind == "cuda":
            return True
        if self.kind == "xpu":
            return hasattr(torch.xpu, "XPUGraph")
        return False

    def kernels(self, attention: str, fused: str, gdn: str, int4: str, hybrid: bool) -> Kernels:
        """Resolve each op's configured name ("auto": this device's choice); gdn only for hybrid models."""
        return Kernels(self.attention_backend(attention), self.fused_backend(fused),
                       self.gdn_backend(gdn) if hybrid else "reference", self.int4_backend(int4))

    def int4_backend(self, requested: str = "auto") -> str:
        """int4 matmul backend in kernels.int4 (KernelConfig.int4); auto: the device's per-row-count dispatch."""
        if requested != "auto":
            return requested
        return {"cpu": "reference", "cuda": "auto:native_cuda", "xpu": "auto:native_xpu"}[self.kind]

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
        """Gated-delta-rule kernels: fla-core's Triton kernels on GPUs when installed, else the torch reference."""
        if requested != "auto":
            return requested
        if self.kind == "cpu":
            return "reference"
        if importlib.util.find_spec("fla") is None:
            log.warning("fla-core is not installed: Gated DeltaNet layers use the slow torch reference on %s",
                        self.kind)
            return "reference"
        return "fla"

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
