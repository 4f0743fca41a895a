"""The step's token -> adapter-slot mapping (a LoRABatch) and the calls into the batched LoRA kernels.

A token whose request has no adapter maps to slot -1 and gets no LoRA work; a step in which no token
has an adapter builds no batch at all, so the wrappers launch nothing. One implementation is picked
per engine (LORA_IMPLS, chosen and self-checked once by the model runner): the torch reference reads
the slots as a tensor and host rank lists; the Triton one groups the tokens by slot once per step
(engine/lora/token_groups.py) and launches kernels.lora_triton with the layer's device rank tensor.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from engine.lora.token_groups import check_slots, copy_into, group_tokens, to_device
from kernels import lora_prologue, lora_triton, reference
from kernels.lora_config import use_prologue
from kernels.lora_prologue import one_store
from kernels.lora_triton import TokenGroups

LoRAImplName = Literal["reference", "triton"]


@dataclass(frozen=True)
class SlotRanks:
    """A wrapped layer's true rank of every slot, per slice: host lists and the same on the device
    (updated in place by set_slot, so captured graphs see new adapters)."""

    host: list[list[int]]
    device: torch.Tensor
    """[n_slices, S] int32."""

    def slice(self, i: int) -> SlotRanks:
        return SlotRanks([self.host[i]], self.device[i:i + 1])


@dataclass(frozen=True)
class Scales:
    """fp8 LoRA weights' scales, per slice: a[s] [S, r_max] (one per rank row of A_s), b[s] [S, n_s] (one per
    output row of B_s); the weights stand for weight * scale."""

    a: list[torch.Tensor]
    b: list[torch.Tensor]


class LoRABatch(ABC):
    """One step's token -> slot mapping and the LoRA ops that read it (shapes checked here, once for all
    implementations)."""

    name: ClassVar[LoRAImplName]
    num_tokens: int
    num_slots: int

    @classmethod
    @abstractmethod
    def build(cls, slots: Sequence[int], num_slots: int, device: torch.device) -> LoRABatch: ...

    @abstractmethod
    def update(self, slots: Sequence[int]) -> None:
        """Rewrite the mapping in place for a new step of the same size (graph replay)."""

    @abstractmethod
    def _add(self, y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
             ranks: SlotRanks, offsets: list[int], add_inputs: bool, scales: Scales | None) -> None: ...

    @abstractmethod
    def _shrink(self, x: torch.Tensor, a: torch.Tensor, ranks: SlotRanks, a_scale: torch.Tensor | None
                ) -> torch.Tensor: ...

    @abstractmethod
    def _expand(self, y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, ranks: SlotRanks, offset: int,
                add_inputs: bool, b_scale: torch.Tensor | None) -> None: ...

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
                 ranks: SlotRanks, offsets: list[int], add_inputs: bool = True,
                 scales: Scales | None = None) -> torch.Tensor:
        """For each slice s: y[:, offsets[s]:+n_s] (+)= (x A_s[slot]^T)[:, :rank] B_s[slot][:, :rank]^T.

        x [T, in]; lora_a[s] [S, r_max, in]; lora_b[s] [S, n_s, r_max]; scales: fp8 A and B's (see Scales).
        Returns y (updated in place)."""
        if x.size(0) != y.size(0) or self.num_tokens != x.size(0):
            raise ValueError(f"add_lora: x {tuple(x.shape)}, y {tuple(y.shape)}, {self.num_tokens} slots disagree")
        if not (len(lora_a) == len(lora_b) == len(ranks.host) == len(offsets)):
            raise ValueError("add_lora: one A, B, ranks and offset per slice")
        for a, b in zip(lora_a, lora_b):
            if a.size(-1) != x.size(-1):
                raise ValueError(f"add_lora: A has {a.size(-1)} inputs, x has {x.size(-1)}")
            if a.size(1) != b.size(-1):
                raise ValueError(f"add_lora: A rank dim {a.size(1)} != B rank dim {b.size(-1)}")
        if (scales is not None) != (lora_a[0].dtype == torch.float8_e4m3fn):
            raise ValueError(f"add_lora: scales go with fp8 A and B (A is {lora_a[0].dtype})")
        self._add(y, x, lora_a, lora_b, ranks, offsets, add_inputs, scales)
        return y

    def norm_shrink(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    zero_centered: bool, lora_a: list[torch.Tensor], ranks: SlotRanks, scales: Scales | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(y, h, partials): the RMSNorm before a wrapped layer (kernels.fused.rms_norm's y and h) with the layer's
        shrink of y joined to it (kernels.lora_prologue), or None where this implementation or step joins nothing
        (the caller norms, then runs add_lora). finish_prologue expands the partials."""
        return None

    def act_shrink(self, x: torch.Tensor, lora_a: list[torch.Tensor], ranks: SlotRanks, scales: Scales | None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(y, partials): silu_and_mul(x) with the next layer's shrink of y joined to it, or None (as norm_shrink)."""
        return None

    def finish_prologue(self, y: torch.Tensor, partials: torch.Tensor, lora_b: list[torch.Tensor], ranks: SlotRanks,
                        offsets: list[int], scales: Scales | None) -> torch.Tensor:
        """add_lora's expand of a joined shrink's partials into the base output y (scales: fp8's, B's used).
        Returns y."""
        raise NotImplementedError(f"{type(self).__name__} joins no shrink to the op before a layer")

    def shrink(self, x: torch.Tensor, a: torch.Tensor, ranks: SlotRanks,
               a_scale: torch.Tensor | None = None) -> torch.Tensor:
        """buf[t, :r] = x[t] @ a[slot[t], :r].T (float32 [T, a.size(1)]); slot -1 rows are zero. One slice.
        a_scale [S, r_max]: a is fp8 with one scale per rank row."""
        if a.size(-1) != x.size(-1) or x.size(0) != self.num_tokens:
            raise ValueError(f"shrink: A has {a.size(-1)} inputs, x is {tuple(x.shape)} for {self.num_tokens} tokens")
        return self._shrink(x, a, ranks, a_scale)

    def expand(self, y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, ranks: SlotRanks, offset: int,
               add_inputs: bool = True, b_scale: torch.Tensor | None = None) -> torch.Tensor:
        """y[t, offset:offset+n] (+)= buf[t, :r] @ b[slot[t], :, :r].T (r = the slot's true rank <= r_max).

        buf must be exactly [T, r_max] with r_max = b.size(-1): a wider buffer means a shrink result was
        gathered where it should not have been (seed bug 2), and is refused rather than silently cut.
        """
        if buf.size(-1) != b.size(-1) or buf.size(0) != y.size(0):
            raise ValueError(f"expand: shrink result {tuple(buf.shape)} does not match LoRA B {tuple(b.shape)} "
                             f"(rank dim {b.size(-1)}) for {y.size(0)} tokens")
        self._expand(y, buf, b, ranks, offset, add_inputs, b_scale)
        return y


class ReferenceLoRABatch(LoRABatch):
    """The torch reference (kernels.reference), fp32 matmuls: the CPU path. Two formulations of add_lora, picked
    per slice by a cost model (`_dense_pays`):
    - grouped: per slot in use, its rows times its A and B (kernels.reference.lora_shrink / lora_expand):
      ~10 small ops per slot and slice, no wasted products;
    - dense: the rows that use adapters times every slot of the range in use at once, the padded buffers
      viewed as one [slots * r_max, in] A and one [slots * r_max, out] B (no copies), with a mask that keeps
      each row's own slot's first `rank` columns: y += ((x A^T) masked) B. Three ops per slice, but every
      row pays for every slot's r_max columns.
    Decode steps (few rows, several adapters) are op-bound on a CPU, prefill steps product-bound."""

    name = "reference"
    mode: ClassVar[Literal["auto", "dense", "grouped"]] = "auto"
    """auto: the cost model chooses per slice; dense / grouped force one (tests)."""

    def __init__(self, slots: torch.Tensor, num_slots: int, rows_of: reference.SlotRows | None = None) -> None:
        self.slots, self.num_tokens, self.num_slots = slots, slots.numel(), num_slots
        self.rows_of = rows_of if rows_of is not None else reference.slot_rows(slots)
        """Each slot's token rows, found once per step (from the host copy) for all the layers' calls."""
        self._dense_setup()

    def _dense_setup(self) -> None:
        rows = self.rows_of
        self._plans: dict[tuple[tuple[int, ...], int, int, int], torch.Tensor | None] = {}
        """Per slice layout (ranks of slots lo..hi, r_max, in, out): the dense form's mask, or None where the
        grouped form is cheaper. Decided once per step for all the layers of that layout."""
        self._masks: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
        """The masks by (ranks, r_max) alone: the slices of different widths (q, k, v, o, ...) share one."""
        self._lo = min((s for s, _ in rows), default=0)
        self._hi = max((s for s, _ in rows), default=-1)
        if rows and all(isinstance(r, slice) for _, r in rows):  # the adapter rows are one span (runner order)
            self._t0 = min(r.start for _, r in rows)  # type: ignore[union-attr]
            self._t1 = max(r.stop for _, r in rows)  # type: ignore[union-attr]
        else:
            self._t0, self._t1 = 0, self.num_tokens
        self._counts = [(s, r.stop - r.start if isinstance(r, slice) else r.numel()) for s, r in rows]

    @classmethod
    def build(cls, slots: Sequence[int], num_slots: int, device: torch.device) -> ReferenceLoRABatch:
        host = torch.tensor(list(slots), dtype=torch.long)
        check_slots(host, num_slots)
        return cls(to_device(host, torch.device(device)), num_slots, reference.slot_rows(host))

    def update(self, slots: Sequence[int]) -> None:
        host = torch.tensor(list(slots), dtype=torch.long)
        check_slots(host, self.num_slots)
        copy_into(self.slots, host)
        self.rows_of = reference.slot_rows(host)
        self._dense_setup()

    def _add(self, y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
             ranks: SlotRanks, offsets: list[int], add_inputs: bool, scales: Scales | None) -> None:
        xs: torch.Tensor | None = None  # the dense rows of x in fp32, made once for all slices
        for i, (a, b, r, off) in enumerate(zip(lora_a, lora_b, ranks.host, offsets)):
            # The dense form reads the buffers as they are: fp8 storage (scales) takes the grouped reference.
            mask = self._plan(a, b, r, ranks.device[i]) if add_inputs and scales is None else None
            if mask is not None:
                if xs is None:
                    xs = x[self._t0:self._t1].float()
                self._add_dense(y, xs, a, b, mask, off)
            else:
                sa, sb = (scales.a[i], scales.b[i]) if scales is not None else (None, None)
                buf = reference.lora_shrink(x, a, self.slots, r, self.rows_of, sa)
                reference.lora_expand(y, buf, b, self.slots, r, off, add_inputs, self.rows_of, sb)

    def _dense_pays(self, a: torch.Tensor, b: torch.Tensor, ranks: list[int]) -> bool:
        """Whether the dense form is cheaper for this slice: host time per slice (dense) or per slot and slice
        (grouped) plus the products at FLOPS (figures of the CPU this was tuned on, docs/PERFORMANCE.md)."""
        if self.mode != "auto" or not self._counts:
            return self.mode == "dense" and bool(self._counts)
        width = a.size(-1) + b.size(1)
        dense = DENSE_S + 2 * (self._t1 - self._t0) * (self._hi - self._lo + 1) * a.size(1) * width / FLOPS
        grouped = sum(SLOT_S + 2 * n * ranks[s] * width / FLOPS for s, n in self._counts)
        return dense < grouped

    def _plan(self, a: torch.Tensor, b: torch.Tensor, ranks: list[int], ranks_dev: torch.Tensor) -> torch.Tensor | None:
        own = tuple(ranks[self._lo:self._hi + 1])
        key = (own, a.size(1), a.size(-1), b.size(1))
        if key not in self._plans:
            mask = None
            if self._dense_pays(a, b, ranks):
                mkey = (own, a.size(1))
                mask = self._masks.get(mkey)
                if mask is None:
                    mask = self._masks[mkey] = self._mask(ranks_dev, a.size(1))
            self._plans[key] = mask
        return self._plans[key]

    def _add_dense(self, y: torch.Tensor, xs: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor,
                   offset: int) -> None:
        """y[t0:t1, offset:+n] += ((xs A^T) masked) B over the slots lo..hi, A and B the padded buffers viewed flat."""
        lo, hi, n = self._lo, self._hi, b.size(1)
        h = torch.mm(xs, _flat(a, lo, hi, True))  # torch.mm, not @: matmul's dispatch costs more than this tiny GEMM
        h.masked_fill_(mask, 0.0)
        out = y[self._t0:self._t1, offset:offset + n]
        if y.dtype == torch.float32:
            out.addmm_(h, _flat(b, lo, hi, False))
        else:
            out += torch.mm(h, _flat(b, lo, hi, False)).to(y.dtype)

    def _mask(self, ranks_dev: torch.Tensor, r_max: int) -> torch.Tensor:
        """M[t, (s - lo) * r_max + j] = False where row t uses slot s and j < rank(s), else True: the products
        to drop (a fill, not a multiply, so nothing of another slot reaches a row, not even a NaN). Built on
        the slots' device (no host copy); ranks_dev: every slot's ranks."""
        dev = self.slots.device
        col = torch.arange((self._hi - self._lo + 1) * r_max, device=dev)
        keep = (col % r_max) < ranks_dev[self._lo:self._hi + 1].repeat_interleave(r_max)
        own = self.slots[self._t0:self._t1].unsqueeze(1) == col // r_max + self._lo
        return ~(own & keep)

    def _shrink(self, x: torch.Tensor, a: torch.Tensor, ranks: SlotRanks, a_scale: torch.Tensor | None
                ) -> torch.Tensor:
        return reference.lora_shrink(x, a, self.slots, ranks.host[0], self.rows_of, a_scale)

    def _expand(self, y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, ranks: SlotRanks, offset: int,
                add_inputs: bool, b_scale: torch.Tensor | None) -> None:
        reference.lora_expand(y, buf, b, self.slots, ranks.host[0], offset, add_inputs, self.rows_of, b_scale)


_FLAT: dict[tuple[int, int, int], tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}


def _flat(t: torch.Tensor, lo: int, hi: int, a_side: bool) -> torch.Tensor:
    """Slots lo..hi of a stacked slot buffer as one fp32 matrix: A [S, r_max, in] -> [in, (hi-lo+1) * r_max]
    (transposed, for x @ it), B [S, n, r_max] (rank-major memory) -> [(hi-lo+1) * r_max, n]. Views of the
    buffer are kept per (buffer, range) across steps: the wrappers update their slots in place, which a
    view sees. A copy (another dtype, or a layout that cannot be viewed) is made afresh on every call."""
    key = (id(t), lo, hi)
    hit = _FLAT.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    part = t[lo:hi + 1]
    flat = part.reshape(-1, part.size(-1)).t() if a_side else part.transpose(1, 2).reshape(-1, part.size(1))
    flat = flat.float()
    if flat.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
        if len(_FLAT) > 4096:  # buffers of engines gone (tests build many): forget the dead ones
            for k in [k for k, (ref, _) in _FLAT.items() if ref() is None]:
                del _FLAT[k]
        _FLAT[key] = (weakref.ref(t), flat)
    return flat


# The reference batch's cost model (ReferenceLoRABatch._dense_pays), measured with one torch thread on the
# 2-core Xeon of docs/PERFORMANCE.md (benchmarks/bench_lora_cpu.py): the host time of one slice in the dense
# form and of one slot's share of a slice in the grouped form, and the fp32 matmul rate at these shapes.
DENSE_S = 15e-6
SLOT_S = 20e-6
FLOPS = 1.2e11


class TritonLoRABatch(LoRABatch):
    """kernels.lora_triton: all slices of a layer in one shrink and one expand launch."""

    name = "triton"

    def __init__(self, groups: TokenGroups) -> None:
        self.groups, self.num_tokens, self.num_slots = groups, groups.num_tokens, groups.num_slots

    @classmethod
    def build(cls, slots: Sequence[int], num_slots: int, device: torch.device) -> TritonLoRABatch:
        return cls(group_tokens(slots, num_slots, device=device))

    def update(self, slots: Sequence[int]) -> None:
        group_tokens(slots, self.num_slots, out=self.groups)

    def _add(self, y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
             ranks: SlotRanks, offsets: list[int], add_inputs: bool, scales: Scales | None) -> None:
        lora_triton.add_lora(y, x, lora_a, lora_b, self.groups, offsets, ranks.device, add_inputs,
                             scales.a if scales is not None else None, scales.b if scales is not None else None)

    def _joins(self, x: torch.Tensor, lora_a: list[torch.Tensor], scales: Scales | None) -> bool:
        """Whether this step's shrink joins the op before the layer (decode-sized steps; fp8 with its scales)."""
        return (use_prologue(self.num_tokens, lora_a[0].size(1))  # first: cheap
                and not lora_triton.nothing_to_do(self.groups)
                and (lora_a[0].dtype in (x.dtype, torch.float32) or scales is not None)
                and one_store(lora_a) is not None)

    def norm_shrink(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    zero_centered: bool, lora_a: list[torch.Tensor], ranks: SlotRanks, scales: Scales | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if not self._joins(x, lora_a, scales):
            return None
        return lora_prologue.norm_shrink(x, weight, eps, zero_centered, residual, lora_a, self.groups, ranks.device,
                                         scales.a if scales is not None else None)

    def act_shrink(self, x: torch.Tensor, lora_a: list[torch.Tensor], ranks: SlotRanks, scales: Scales | None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if len(lora_a) != 1 or not self._joins(x, lora_a, scales):
            return None
        return lora_prologue.act_shrink(x, lora_a[0], self.groups, ranks.device,
                                        scales.a[0] if scales is not None else None)

    def finish_prologue(self, y: torch.Tensor, partials: torch.Tensor, lora_b: list[torch.Tensor], ranks: SlotRanks,
                        offsets: list[int], scales: Scales | None) -> torch.Tensor:
        return lora_triton.expand_partials(y, partials, lora_b, self.groups, offsets, ranks.device,
                                           b_scales=scales.b if scales is not None else None)

    def _shrink(self, x: torch.Tensor, a: torch.Tensor, ranks: SlotRanks, a_scale: torch.Tensor | None
                ) -> torch.Tensor:
        return lora_triton.lora_shrink(x, [a], self.groups, ranks.device,
                                       a_scales=[a_scale] if a_scale is not None else None)[0]

    def _expand(self, y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, ranks: SlotRanks, offset: int,
                add_inputs: bool, b_scale: torch.Tensor | None) -> None:
        lora_triton.lora_expand(y, buf.float().unsqueeze(0), [b], self.groups, [offset], ranks.device, add_inputs,
                                [b_scale] if b_scale is not None else None)


LORA_IMPLS: dict[LoRAImplName, type[LoRABatch]] = {"reference": ReferenceLoRABatch, "triton": TritonLoRABatch}


def build_mapping(slots: Sequence[int], device: torch.device, impl: type[LoRABatch] = ReferenceLoRABatch,
                  num_slots: int | None = None) -> LoRABatch | None:
    """The step's batch for tokens using these slots; None when no token uses an adapter. num_slots:
    the engine's slot count (default: enough for the largest slot given)."""
    if all(s < 0 for s in slots):
        return None
    return impl.build(slots, num_slots if num_slots is not None else max(slots) + 1, device)
