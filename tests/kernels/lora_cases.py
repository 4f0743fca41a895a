"""LoRA epilogue cases shared by the int4 kernels' tests (kernels.int4_mma's Triton kernel, kernels.int4_cuda's CUDA C
one): the epilogue's inputs and the expand it must add, computed per token in float32."""

from __future__ import annotations

import torch

from kernels.int4_lora import LoRAEpilogue


def epilogue_case(m: int, n: int, starts: tuple[int, ...], nslots: int, r_max: int, split_h: int, dtype: torch.dtype,
                  g: torch.Generator) -> tuple[LoRAEpilogue, torch.Tensor]:
    """(epilogue on the CPU, delta [m, n] float32): ranks 0..r_max per slice and slot (slot 0 at r_max), slot -1
    rows (row 0 among them), and NaN wherever the shrink writes nothing, which a kernel must never read."""
    ns = len(starts)
    ranks = torch.randint(0, r_max + 1, (ns, nslots), generator=g, dtype=torch.int32)
    ranks[:, 0] = r_max
    slots = torch.randint(-1, nslots, (m,), generator=g, dtype=torch.int32)
    slots[0] = -1
    h = torch.randn(split_h, ns, m, r_max, generator=g)
    b = torch.randn(nslots, r_max, n, generator=g).to(dtype)
    hs, bounds = h.sum(0), (*starts, n)
    delta = torch.zeros(m, n)
    for t in range(m):
        s_t = int(slots[t])
        for i in range(ns):
            if s_t >= 0:
                r = int(ranks[i, s_t])
                delta[t, bounds[i]:bounds[i + 1]] = hs[i, t, :r] @ b[s_t, :r, bounds[i]:bounds[i + 1]].float()
                h[:, i, t, r:] = float("nan")
            else:
                h[:, i, t] = float("nan")
    return LoRAEpilogue(h, b, ranks, slots, starts), delta
