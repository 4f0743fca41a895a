"""Timing helpers shared by the kernel benchmarks: wall time with a device sync, and graph replay."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


def device_sync(dev: torch.device) -> Callable[[], None]:
    mod = getattr(torch, dev.type, None)
    fn = getattr(mod, "synchronize", None) if dev.type != "cpu" else None
    return fn if callable(fn) else (lambda: None)


def time_us(fn: Callable[[], object], sync: Callable[[], None], budget_s: float, max_iters: int = 5000) -> float:
    """Mean wall time per call in microseconds: one warm-up call, then enough calls to fill budget_s
    (at least 3, or 1 when budget_s is 0)."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    one = time.perf_counter() - t0
    if budget_s <= 0:
        return one * 1e6
    iters = int(min(max_iters, max(3, budget_s / max(one, 1e-7))))
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1e6


def graph_time_us(fn: Callable[[], object], dev: torch.device, budget_s: float, reps: int = 20) -> float | None:
    """Per-call time of `reps` calls captured in one device graph and replayed; None where unsupported."""
    mod = getattr(torch, dev.type, None)
    graph_cls = getattr(mod, "CUDAGraph", None) or getattr(mod, "XPUGraph", None)
    graph_ctx = getattr(mod, "graph", None)
    if dev.type == "cpu" or graph_cls is None or graph_ctx is None:
        return None
    sync = device_sync(dev)
    try:
        stream = mod.Stream()
        stream.wait_stream(mod.current_stream())
        with mod.stream(stream):
            fn()
        mod.current_stream().wait_stream(stream)
        sync()
        g = graph_cls()
        with graph_ctx(g):
            for _ in range(reps):
                fn()
        sync()
    except Exception as e:  # anything that cannot be captured is reported as such
        print(f"# graph capture failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return None
    return time_us(g.replay, sync, budget_s) / reps


def profile_by_name(fn: Callable[[], object], dev: torch.device) -> tuple[dict[str, float], dict[str, float]]:
    """Run fn under torch.profiler: (device microseconds by kernel name, host microseconds by op name, self
    time). Only the device's own events count as device time: a CPU op (aten::mm) also carries its kernels'
    time, which would count twice. Kernels inside replayed graphs are included."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    device_act = getattr(torch.profiler.ProfilerActivity, dev.type.upper(), None)
    if device_act is not None and device_act not in acts:  # CUDA, XPU; none on the CPU
        acts.append(device_act)
    with torch.profiler.profile(activities=acts) as prof:
        fn()
    device: dict[str, float] = {}
    host: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type != torch.autograd.DeviceType.CPU and ev.self_device_time_total > 0:
            device[ev.key[:70]] = device.get(ev.key[:70], 0.0) + ev.self_device_time_total
        elif ev.device_type == torch.autograd.DeviceType.CPU and ev.self_cpu_time_total > 0:
            host[ev.key[:70]] = host.get(ev.key[:70], 0.0) + ev.self_cpu_time_total
    return device, host


def top(by_name: dict[str, float], n: int, per: float = 1.0) -> list[tuple[str, float]]:
    """The n largest entries of a profile_by_name table, divided by per, rounded to 0.1."""
    return [(k, round(v / per, 1)) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:n]]

