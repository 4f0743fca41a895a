"""`xpulora check-device`: the start-up kernel checks (kernels/registry.py) run on their own, on typical
model shapes, with a table to read or attach to a bug report. The engine runs the same checks on the
served model's own shapes when it starts (ModelRunner.kernel_choices)."""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

from engine.config import LoRAKernelName
from engine.device import detect, rank_device
from engine.lora.punica import choose_impl
from kernels import triton_env
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
                f"{'op':8s} {'chosen':10s} {'checked':8s} rejected"]
        for c in self.choices:
            why = "; ".join(f"{n}: {w}" for n, w in c.rejected) or "-"
            rows.append(f"{c.op:8s} {c.chosen:10s} {'yes' if c.checked else 'no':8s} {why}")
        rows.append("")
        rows.append("all fast kernels match their references" if self.ok else
                    "SOME FAST KERNELS FAILED their checks: the engine serves with the next candidate; "
                    "please attach this table to a bug report")
        return "\n".join(rows)


def check_device(device: str = "auto", dtype: str = "auto", lora_kernel: LoRAKernelName = "auto",
                 hidden: int = 1024, out_sizes: tuple[int, ...] = (1024, 256, 256), max_rank: int = 64,
                 max_loras: int = 4) -> DeviceReport:
    """Check every op that has a registry on this device (today: the batched LoRA kernels), on a
    QKV-shaped layer (hidden -> out_sizes) with max_rank and max_loras slots."""
    dev = rank_device(detect(device), 0)
    dev.activate()
    dt = dev.default_dtype() if dtype == "auto" else DTYPES[dtype]
    _, lora = choose_impl(dev.lora_candidates(lora_kernel), hidden, list(out_sizes), max_rank, max_loras, dt,
                          dev.torch_device)
    triton_version = getattr(triton_env.triton, "__version__", None)
    env = (f"torch {torch.__version__}, triton {triton_version or 'not installed'}"
           f"{' (interpreter)' if triton_env.interpreting() else ''}, python {platform.python_version()}")
    return DeviceReport(dev.describe(), str(dt).removeprefix("torch."), env, (lora,))
