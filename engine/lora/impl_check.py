"""The engine's start-up check of the LoRA implementations (engine.lora.punica.LORA_IMPLS): each candidate runs a
real layer's shapes against the torch reference, and the first that matches serves."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.lora.punica import LORA_IMPLS, LoRABatch, Scales, SlotRanks
from kernels import reference
from kernels.registry import Choice, choose

CHECK_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (1.6e-2, 1e-2)}
"""(rtol, atol relative to max|ref|) of the start-up check: fp32 differs only in summation order; 16-bit
rounds the shrink result and the output once more than the reference (see tests/kernels/test_lora_triton.py)."""


def _after_ops(batch: LoRABatch, x: torch.Tensor, y: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
               ranks: SlotRanks, offsets: list[int], scales: Scales | None) -> dict[str, torch.Tensor]:
    """The layer after an RMSNorm (all slices) and after silu-and-mul (the first slice), and the op's own output
    (what the base GEMM reads): the shrink joined to the op where the batch joins it (LoRABatch.norm_shrink /
    act_shrink), else the reference op, then add_lora."""
    w = torch.linspace(0.5, 1.5, x.size(1), dtype=x.dtype, device=x.device)
    joined = batch.norm_shrink(x, None, w, 1e-6, False, a, ranks, scales)
    if joined is None:
        normed = reference.rms_norm(x, w, 1e-6)[0]
        after_norm = batch.add_lora(y.clone(), normed, a, b, ranks, offsets, scales=scales)
    else:
        normed, after_norm = joined[0], batch.finish_prologue(y.clone(), joined[2], b, ranks, offsets, scales)
    gu, r0, s0 = torch.cat([x, x.flip(1)], dim=1), ranks.slice(0), None
    if scales is not None:
        s0 = Scales(scales.a[:1], scales.b[:1])
    acted = batch.act_shrink(gu, a[:1], r0, s0)
    y0 = y[:, :b[0].size(1)].clone()
    if acted is None:
        act = reference.silu_and_mul(gu)
        after_act = batch.add_lora(y0, act, a[:1], b[:1], r0, [0], scales=s0)
    else:
        act, after_act = acted[0], batch.finish_prologue(y0, acted[1], b[:1], r0, [0], s0)
    return {"norm": normed, "after a norm": after_norm, "silu-and-mul": act, "after silu-and-mul": after_act}


def choose_impl(candidates: Sequence[str], in_features: int, out_sizes: list[int], r_max: int, num_slots: int,
                dtype: torch.dtype, device: torch.device, weight_dtype: torch.dtype | None = None
                ) -> tuple[type[LoRABatch], Choice]:
    """The first candidate whose add_lora matches the reference on small problems of a real layer's shapes
    (tokens over two slots and slot -1, ranks r_max and below, A as column ranges of one store and rank-major B as
    the wrappers store them, in the wrappers' storage dtype `weight_dtype` (default: dtype), fp8 with its scales):
    a decode-sized step of 8 tokens and one of 72, past the column kernels' 64, so both kinds of launch are
    checked, and the 8-token step after a norm and after silu-and-mul (the shrink joined to them)."""
    wd = weight_dtype or dtype
    g = torch.Generator().manual_seed(0)
    s = min(num_slots, 2)
    slots = [i % (s + 1) - 1 for i in range(72)]  # -1, 0, (1,) ...
    x = torch.randn(len(slots), in_features, generator=g).to(dtype).to(device)
    n = len(out_sizes)
    a_all = torch.randn(num_slots, r_max, n * in_features, generator=g) / in_features ** 0.5
    b_all = [torch.randn(num_slots, m, r_max, generator=g) for m in out_sizes]
    if wd == torch.float8_e4m3fn:  # A's scales as the wrappers hold them: [S, r_max, n], slice i's in column i
        qa, sa = reference.fp8_rows(a_all.reshape(-1, in_features))
        store, a_sc = qa.view(a_all.shape).to(device), sa.view(num_slots, r_max, n).to(device)
        qb = [reference.fp8_rows(t.reshape(-1, r_max)) for t in b_all]
        b = [q.view(t.shape).to(device) for (q, _), t in zip(qb, b_all)]
        scales: Scales | None = Scales([a_sc[:, :, i] for i in range(n)],
                                       [sc.view(t.shape[:2]).to(device) for (_, sc), t in zip(qb, b_all)])
    else:
        store = a_all.to(wd).to(device)
        b, scales = [t.to(wd).to(device) for t in b_all], None
    a = [store[:, :, i * in_features:(i + 1) * in_features] for i in range(n)]
    b = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in b]  # rank-major storage
    host = [[max(1, r_max // (1 + j + i)) for j in range(num_slots)] for i in range(n)]
    ranks = SlotRanks(host, torch.tensor(host, dtype=torch.int32, device=device))
    y = torch.randn(len(slots), sum(out_sizes), generator=g).to(dtype).to(device)
    offsets = [sum(out_sizes[:i]) for i in range(n)]

    def run(name: str) -> dict[str, torch.Tensor]:
        out = {}
        for t in (8, 72):
            batch = LORA_IMPLS[name].build(slots[:t], num_slots, device)  # type: ignore[index]
            out[f"{t} tokens"] = batch.add_lora(y[:t].clone(), x[:t], a, b, ranks, offsets, scales=scales)
            if t == 8:
                out.update(_after_ops(batch, x[:t], y[:t], a, b, ranks, offsets, scales))
        return out

    choice = choose("lora", candidates, run, CHECK_TOLERANCE[dtype])
    return LORA_IMPLS[choice.chosen], choice  # type: ignore[index]
