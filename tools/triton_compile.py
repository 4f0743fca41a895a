"""Compile Triton kernels for an NVIDIA GPU on a machine without one.

Inside `compile_only(arch)` the kernels' own launchers run on CPU tensors as they would on a device, but every
kernel launch only compiles (triton's compiler, then the ptxas its wheel ships) and nothing runs: a stub driver
reports the target and JITFunction.run is told to warm up instead of launching. Outputs are left unwritten.

What it checks: that each kernel a launcher picks compiles for that target with the launcher's real arguments,
constexprs and launch options, which the interpreter cannot see (types, constexpr misuse, what the compiler or
ptxas refuses). Results are the interpreter tests' and the GPU checks' business. Used by
tests/kernels/test_compile_cuda.py; `python -m tools.triton_compile` prints what the engine's start-up checks and
the LoRA kernels compile to.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kernels import triton_env
from kernels.triton_env import interpreting, triton


@dataclass
class Compiled:
    """What a compile_only block compiled: (kernel name, triton's compiled kernel) per launch, and (kernel name,
    error) for failures."""

    kernels: list[tuple[str, Any]] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)

    def names(self) -> set[str]:
        return {name for name, _ in self.kernels}


class _TargetOnly:
    """The parts of a triton driver that compilation asks for: the target, and a device and stream number."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> object:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def nvidia_tool(name: str) -> str:
    """A tool of the triton wheel's NVIDIA backend (ptxas, cuobjdump), also tools.cuda_compile's ptxas."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_available() -> bool:
    """The triton wheel's NVIDIA backend and its ptxas are installed (PyPI's triton ships both)."""
    if triton is None or interpreting():
        return False
    return os.access(nvidia_tool("ptxas"), os.X_OK)


def usage(kernel: Any) -> dict[str, int]:
    """A compiled kernel's launch resources, from its cubin (the wheel's cuobjdump): registers per thread, local
    memory per thread (spills and stack), static and dynamic shared memory per program, warps, pipeline stages.
    What bounds its programs per SM, without a GPU."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([nvidia_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return {"registers": int(fields.get("REG", 0)), "local_bytes": int(fields.get("LOCAL", 0)),
            "stack_bytes": int(fields.get("STACK", 0)), "static_shared": int(fields.get("SHARED", 0)),
            "dynamic_shared": int(kernel.metadata.shared), "warps": int(kernel.metadata.num_warps),
            "stages": int(kernel.metadata.num_stages)}


@contextlib.contextmanager
def compile_only(arch: int = 90) -> Iterator[Compiled]:
    """Kernel launches inside compile for sm_<arch> and run nothing (see the module docstring). Not thread-safe:
    it swaps triton's active driver and JITFunction.run for the block's duration."""
    if not ptxas_available():
        raise RuntimeError("compile_only needs triton with its NVIDIA backend (ptxas), outside the interpreter")
    from triton.runtime.jit import JITFunction

    done = Compiled()
    launch = JITFunction.run
    # A JITFunction keeps its compiled kernels and target per device number, and the stub's device is 0: each one
    # launched here gets an empty cache for the block and its own back after, so a GPU's kernels are neither reused
    # for the stub's target nor replaced by the stub's (which its GPU could not load).
    saved: dict[int, tuple[JITFunction, object]] = {}

    def compile_instead(self: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> object:
        name = self.fn.__name__
        if id(self) not in saved:
            saved[id(self)] = (self, self.device_caches)
            self.device_caches = defaultdict(self.create_binder)
        try:
            kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # recorded, then raised as the launch would have
            done.errors.append((name, f"{type(e).__name__}: {str(e)[:2000]}"))
            raise
        done.kernels.append((name, kernel))
        return kernel

    drivers = triton.runtime.driver
    before = drivers._active
    drivers.set_active(_TargetOnly(arch))  # type: ignore[arg-type]
    JITFunction.run = compile_instead  # type: ignore[method-assign]
    try:
        yield done
    finally:
        JITFunction.run = launch  # type: ignore[method-assign]
        drivers._active = before
        for fn, caches in saved.values():
            fn.device_caches = caches
        triton_env.usable_on.cache_clear()  # it may have cached an answer for the stub's target


def run_all() -> None:
    """Launch every Triton kernel of the project through its launcher on small CPU problems (inside
    compile_only): the engine's start-up checks of the fused ops, paged attention (a split decode with its merge
    too) and int4 (each Triton backend, the dequantization), in bfloat16 and float32; the LoRA kernels split,
    fused, with fp8 weights, with ranks above one rank tile, with one-token programs and with the column expand, and
    the shrink joined to the RMSNorm and to silu-and-mul; the Gated DeltaNet decode step, conv, gating, gated
    norm and the decode step with its gating and norm (decode_out); the skinny linear (Qwen3.5's [b | a] projection)."""
    import torch

    from engine.lora.token_groups import group_tokens
    from kernels import checks, lora_triton
    from kernels.attention_triton import paged_attention_decode
    from kernels.gdn_triton import (
        conv_decode_triton,
        decode_out_triton,
        delta_rule_decode_triton,
        gated_rms_norm_triton,
        gating_triton,
    )
    from kernels.int4 import dequant_triton
    from kernels.lora_prologue import act_shrink, norm_shrink
    from kernels.skinny_triton import skinny_linear_triton

    cpu = torch.device("cpu")
    shapes = checks.CheckShapes(hidden=256, intermediate=512, num_heads=4, num_kv_heads=2, head_dim=64,
                                rotary_dim=64, zero_centered=False, qk_norm=True, block_size=16, int4_group=128)
    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float32):
        checks.check_fused("triton", shapes, dt, cpu)
        checks.check_attention("triton", shapes, dt, cpu)
        checks.check_int4("tuned:triton,triton_mma,triton_gemv,reference", shapes, dt, cpu)
        q = torch.randn(2, 4, 64, generator=g).to(dt)
        kc = vc = torch.zeros(8, 16, 2, 64, dtype=dt)
        tables = torch.arange(8, dtype=torch.int32).reshape(2, 4)
        paged_attention_decode(q, kc, vc, tables, torch.tensor([0, 1, 2], dtype=torch.int32),
                               torch.tensor([64, 50], dtype=torch.int32), 0.125, num_splits=2)
        qw = torch.zeros(32, 64, dtype=torch.int32)
        dequant_triton(qw, torch.zeros(2, 8, dtype=torch.int32), torch.ones(2, 64, dtype=torch.float16), 128, 1, dt)
    t, slots_n, k = 8, 4, 256
    x = torch.randn(t, k, generator=g).to(torch.bfloat16)
    for r_max, fp8, mode, run in ((16, False, "split", 16), (16, True, "split", 16), (16, False, "fused", 16),
                                  (128, False, "split", 16), (16, False, "split", 1), (16, False, "fused", 1),
                                  (16, False, "cols", 16)):
        info = group_tokens([0, 1, 2, 3, -1, 0, 1, 2], slots_n, block_m=run)
        wd = torch.float8_e4m3fn if fp8 else torch.bfloat16
        a = [torch.randn(slots_n, r_max, k, generator=g).to(wd) for _ in range(3)]
        b = [torch.randn(slots_n, r_max, n, generator=g).to(wd).transpose(1, 2) for n in (256, 64, 64)]
        sa = [torch.ones(slots_n, r_max) for _ in a] if fp8 else None
        sb = [torch.ones(slots_n, bb.size(1)) for bb in b] if fp8 else None
        ranks = torch.full((3, slots_n), min(r_max, 70), dtype=torch.int32)
        y = torch.zeros(t, 384, dtype=torch.bfloat16)
        before = dict(lora_triton.CONFIG_OVERRIDES)
        lora_triton.CONFIG_OVERRIDES.update(fused=int(mode == "fused"), cols=64 if mode == "cols" else 0)
        try:
            lora_triton.add_lora(y, x, a, b, info, [0, 256, 320], ranks, True, sa, sb)
        finally:
            lora_triton.CONFIG_OVERRIDES.clear()
            lora_triton.CONFIG_OVERRIDES.update(before)
    info = group_tokens([0, 1, 2, 3, -1, 0, 1, 2], slots_n)
    store = torch.randn(slots_n, 16, 3 * k, generator=g).to(torch.bfloat16)
    ranks = torch.full((3, slots_n), 16, dtype=torch.int32)
    norm_shrink(x, torch.ones(k, dtype=torch.bfloat16), 1e-6, False, x, [store[:, :, i * k:(i + 1) * k] for i in
                                                                         range(3)], info, ranks)
    act_shrink(torch.cat([x, x], 1), store[:, :, :k], info, ranks[:1])
    for dt in (torch.bfloat16, torch.float32):  # the Gated DeltaNet decode step, Qwen3.6-27B's heads (Hv = 3 Hk)
        qkv = torch.randn(3, 2 * 2 * 128 + 6 * 128, generator=g).to(dt)
        q, k2, v = qkv.split([256, 256, 768], dim=-1)
        delta_rule_decode_triton(q.view(3, 2, 128), k2.view(3, 2, 128), v.view(3, 6, 128), torch.zeros(3, 6),
                                 torch.ones(3, 6, dtype=dt), torch.zeros(4, 6, 128, 128), torch.tensor([3, 0, 1]))
        conv_decode_triton(qkv, torch.zeros(4, qkv.size(1), 3, dtype=dt), torch.tensor([3, 0, 1]),
                           torch.zeros(qkv.size(1), 4, dtype=dt))
        gated_rms_norm_triton(torch.zeros(3, 6, 128), v.view(3, 6, 128), torch.ones(128, dtype=dt), 1e-6, dt)
        gating_triton(qkv[:, :12], torch.zeros(6), torch.zeros(6))
        decode_out_triton(q.view(3, 2, 128), k2.view(3, 2, 128), v.view(3, 6, 128), qkv[:, :12], torch.zeros(6),
                          torch.zeros(6), v.view(3, 6, 128), torch.ones(128, dtype=dt), 1e-6,
                          torch.zeros(4, 6, 128, 128), torch.tensor([3, 0, 1]), dt)
        for rows in (1, 16):
            skinny_linear_triton(torch.zeros(rows, 5120, dtype=dt), torch.zeros(96, 5120, dtype=dt),
                                 torch.zeros(96, dtype=dt) if rows == 1 else None)


def main() -> int:
    """One JSON line per distinct compiled variant (kernel, resources) and one summary line per target."""
    failed = 0
    for arch in (90, 80):
        with compile_only(arch) as done:
            run_all()
        seen: set[str] = set()
        for name, kernel in done.kernels:
            line = json.dumps({"arch": f"sm_{arch}", "kernel": name, **usage(kernel)})
            if line not in seen:
                seen.add(line)
                print(line)
        print(json.dumps({"arch": f"sm_{arch}", "kernels": sorted(done.names()), "launches": len(done.kernels),
                          "errors": done.errors}))
        failed += len(done.errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
