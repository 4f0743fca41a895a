"""`xpulora check-device`: the start-up kernel checks (kernels/registry.py) run on their own, on typical
model shapes, with a table to read or attach to a bug report. The engine runs the same checks on the
served model's own shapes when it starts (ModelRunner.kernel_choices)."""

from __future__ import annotations

import dataclasses
import platform
from dataclasses import dataclass

import torch

from engine.config import KernelConfig
from engine.device import Kernels, detect, rank_device
from engine.loader import CheckpointInfo, is_hybrid
from engine.lora.impl_check import choose_impl
from engine.models.qwen import QwenArgs
from engine.models.qwen3_5 import Qwen35Args
from kernels import triton_env
from kernels.checks import CheckShapes, check_ops
from kernels.registry import Choice

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DeviceReport:
    device: str
    dtype: str
    environment: str
    choices: tuple[Choice, ...]

    @property
    def ok(self) -> bool:
        """No fast implementation failed its check."""
        return not any(c.rejected for c in self.choices)

    def table(self) -> str:
        rows = [f"device: {self.device}  dtype: {self.dtype}", f"environment: {self.environment}", "",
                f"{'op':10s} {'chosen':16s} {'checked':8s} rejected"]
        for c in self.choices:
            why = "; ".join(f"{n}: {w}" for n, w in c.rejected) or "-"
            rows.append(f"{c.op:10s} {c.chosen:16s} {'yes' if c.checked else 'no':8s} {why}")
        rows.append("")
        rows.append("all fast kernels match their references" if self.ok else
                    "SOME FAST KERNELS FAILED their checks: the engine serves with the next candidate; "
                    "please attach this table to a bug report")
        return "\n".join(rows)


TYPICAL = CheckShapes(hidden=1024, intermediate=3072, num_heads=16, num_kv_heads=8, head_dim=128, rotary_dim=128,
                      zero_centered=False, qk_norm=True, block_size=16, int4_group=128, int4_zero_offset=0,
                      gdn=(16, 32, 128, 128))
"""check-device's model shapes: a Qwen3-0.6B-sized layer, Qwen3.5's Gated DeltaNet heads."""


def kernel_shapes(info: CheckpointInfo, block_size: int) -> CheckShapes:
    """The served model's shapes for the start-up checks (unsharded: the checks run before the model)."""
    q = info.quant
    group = (q.group_size, q.zero_offset) if q.method == "int4" else (None, 0)
    if is_hybrid(info):
        h = Qwen35Args.from_hf(info.hf_config)
        return CheckShapes(h.hidden_size, h.intermediate_size, h.num_heads, h.num_kv_heads, h.head_dim, h.rotary_dim,
                           True, True, block_size, *group, (h.lin_k_heads, h.lin_v_heads, h.lin_k_dim, h.lin_v_dim))
    a = QwenArgs.from_hf(info.hf_config)
    return CheckShapes(a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads, a.head_dim, a.head_dim,
                       False, a.qk_norm, block_size, *group)


def check_kernels(kernels: Kernels, shapes: CheckShapes, dtype: torch.dtype,
                  device: torch.device) -> tuple[Kernels, list[Choice]]:
    """Check the fast implementations in kernels against their references; failed ones are replaced by the
    next candidate (kernels.checks.candidates_for). Returns what to build the model with, and the choices."""
    choices = check_ops([("attention", kernels.attention), ("fused", kernels.fused), ("gdn", kernels.gdn),
                         ("int4", kernels.int4)], shapes, dtype, device)
    return dataclasses.replace(kernels, **{c.op: c.chosen for c in choices}), choices


def check_device(device: str = "auto", dtype: str = "auto", kernels: KernelConfig | None = None,
                 shapes: CheckShapes = TYPICAL, out_sizes: tuple[int, ...] = (1024, 256, 256), max_rank: int = 64,
                 max_loras: int = 4) -> DeviceReport:
    """Check every op that has a start-up check on this device: the batched LoRA kernels on a QKV-shaped
    layer (hidden -> out_sizes) with max_rank and max_loras slots, then attention, the fused ops and
    int4 GEMM on `shapes`."""
    kernels = kernels or KernelConfig()
    dev = rank_device(detect(device), 0)
    dev.activate()
    dt = dev.default_dtype() if dtype == "auto" else DTYPES[dtype]
    _, lora = choose_impl(dev.lora_candidates(kernels.lora), shapes.hidden, list(out_sizes), max_rank, max_loras,
                          dt, dev.torch_device)
    chosen = dev.kernels(kernels.attention, kernels.fused, kernels.gdn, kernels.int4, hybrid=True)
    _, others = check_kernels(chosen, shapes, dt, dev.torch_device)
    triton_version = getattr(triton_env.triton, "__version__", None)
    env = (f"torch {torch.__version__}, triton {triton_version or 'not installed'}"
           f"{' (interpreter)' if triton_env.interpreting() else ''}, python {platform.python_version()}")
    return DeviceReport(dev.describe(), str(dt).removeprefix("torch."), env, (lora, *others))
