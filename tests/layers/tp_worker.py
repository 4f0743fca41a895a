"""Body of the 2-rank gloo layer tests (spawned; module-level so it can be pickled)."""

from __future__ import annotations

import json
import traceback
import zlib
from collections.abc import Callable

import torch

import engine.lora.layers as lora_layers
from engine.distributed import destroy_tp, init_tp
from engine.forward_context import ForwardContext, forward_context
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.quant import Int4LinearMethod, UnquantizedLinearMethod
from engine.lora.adapter import LoRAModule
from engine.lora.layers import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA
from engine.lora.punica import build_mapping
from kernels.reference import pack_int4_cols, pack_int4_rows
from tests.helpers import as_tp_rank

H, G = 256, 128
# kind -> (checkpoint parts: (name, shard id, in, out), builder)
KINDS: dict[str, tuple[list[tuple[str, object, int, int]], Callable]] = {
    "qkv": ([("q_proj", "q", H, 256), ("k_proj", "k", H, 128), ("v_proj", "v", H, 128)],
            lambda m: QKVParallelLinear(H, 64, 4, 2, bias=True, method=m, prefix="qkv_proj")),
    "qkv_rep": ([("q_proj", "q", H, 256), ("k_proj", "k", H, 64), ("v_proj", "v", H, 64)],  # 1 kv head < tp
                lambda m: QKVParallelLinear(H, 64, 4, 1, bias=False, method=m, prefix="qkv_proj")),
    "gate_up": ([("gate_proj", 0, H, 768), ("up_proj", 1, H, 768)],
                lambda m: MergedColumnParallelLinear(H, [768, 768], method=m, prefix="gate_up_proj")),
    "down": ([("down_proj", None, 768, H)], lambda m: RowParallelLinear(768, H, bias=True, method=m, prefix="down_proj")),
    "o": ([("o_proj", None, 256, H)], lambda m: RowParallelLinear(256, H, bias=False, method=m, prefix="o_proj")),
}


def _ckpt(parts, quant: bool, g: torch.Generator) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, _, k, n in parts:
        if quant:
            t = {"qweight": pack_int4_rows(torch.randint(0, 16, (k, n), generator=g)),
                 "qzeros": pack_int4_cols(torch.randint(0, 15, (k // G, n), generator=g)),
                 "scales": (torch.randn(k // G, n, generator=g) * 0.02).half()}
        else:
            t = {"weight": torch.randn(n, k, generator=g) * 0.05}
        t["bias"] = torch.randn(n, generator=g) * 0.05
        out[name] = t
    return out


def _build(kind: str, quant: bool, ckpt, adapters, mode: str | None):
    parts, make = KINDS[kind]
    layer = make(Int4LinearMethod(G, 1) if quant else UnquantizedLinearMethod())
    params = dict(layer.named_parameters())
    for name, sid, _, _ in parts:
        for leaf, t in ckpt[name].items():
            if leaf in params:
                p = params[leaf]
                p.weight_loader(p, t, sid) if sid is not None else p.weight_loader(p, t)
    layer.process_after_loading()
    if mode is None:
        return layer
    cls = RowParallelLinearWithLoRA if isinstance(layer, RowParallelLinear) else ColumnParallelLinearWithLoRA
    w = cls(layer, [p[0] for p in parts], len(adapters), 64, torch.float32, fully_sharded=mode == "full")
    for slot, mods in enumerate(adapters):
        w.set_slot(slot, mods)
    return w


def _case(kind: str, quant: bool, mode: str | None, rank: int, size: int) -> float:
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind}{quant}".encode()))  # same on every rank
    parts = KINDS[kind][0]
    ckpt = _ckpt(parts, quant, g)
    adapters = [{name: LoRAModule(torch.randn(r, k, generator=g) * 0.1, torch.randn(n, r, generator=g) * 0.1, r)
                 for name, _, k, n in parts} for r in (8, 16, 64, 1)]
    x = torch.randn(24, parts[0][2], generator=g)
    slots = torch.tensor([-1, 0, 1, 2, 3, -1] * 4)[torch.randperm(24, generator=g)].tolist()
    ctx = ForwardContext(attn=None, lora=build_mapping(slots, x.device))
    with as_tp_rank(0, 1), forward_context(ctx):  # the tp=1 reference: built and run with no collective
        ref = _build(kind, quant, ckpt, adapters, mode)
        y1 = ref(x)
    tp = _build(kind, quant, ckpt, adapters, mode)
    base = tp.base if mode else tp
    if isinstance(base, RowParallelLinear):  # a row layer sees its shard of the input features
        k = base.in_features
        x = x[:, rank * k:(rank + 1) * k]
    with forward_context(ctx):
        y = tp(x)
    if not isinstance(base, RowParallelLinear):  # column outputs stay sharded: gather them
        y = _gather_column(base, y, size)
    return float((y - y1).abs().max())


def _gather_column(layer, y: torch.Tensor, size: int) -> torch.Tensor:
    """Reassemble a (merged) column layer's full output from every rank's shard, slice by slice."""
    parts = [torch.empty_like(y) for _ in range(size)]
    torch.distributed.all_gather(parts, y.contiguous())
    sizes = getattr(layer, "local_sizes", [y.size(1)])
    pieces = []
    for i, n in enumerate(sizes):
        off = sum(sizes[:i])
        srcs = range(size)
        if isinstance(layer, QKVParallelLinear) and i > 0:
            srcs = range(0, size, layer.kv_replicas)
        pieces += [parts[r][:, off:off + n] for r in srcs]
    return torch.cat(pieces, dim=1)


def _vocab_case(rank: int, size: int) -> float:
    g = torch.Generator().manual_seed(7)
    vocab = 500  # not a multiple of 64 x tp: exercises the padded shard and masked pad logits
    w = torch.randn(vocab, H, generator=g)
    ids = torch.randint(0, vocab, (17,), generator=g)
    with as_tp_rank(0, 1):
        e1, h1 = VocabParallelEmbedding(vocab, H), ParallelLMHead(vocab, H)
        for m in (e1, h1):
            m.weight.weight_loader(m.weight, w)
        r1 = (e1(ids), h1(e1(ids)))
    e2, h2 = VocabParallelEmbedding(vocab, H), ParallelLMHead(vocab, H)
    for m in (e2, h2):
        m.weight.weight_loader(m.weight, w)
    r2 = (e2(ids), h2(e2(ids)))
    assert r2[1].shape == (17, vocab)
    return max(float((a - b).abs().max()) for a, b in zip(r1, r2))


def run(rank: int, size: int, init_method: str, out_path: str, cases: list[tuple[str, bool, str | None]],
        buggy_gather: bool) -> None:
    torch.set_num_threads(1)
    init_tp(rank, size, "gloo", init_method, timeout_s=60)
    if buggy_gather:  # the seed's bug: gather the shrink output whatever the mode
        lora_layers.shrink_needs_gather = lambda fully_sharded, tp_size: tp_size > 1
    results: dict[str, object] = {}
    try:
        for kind, quant, mode in cases:
            key = f"{kind}-{'int4' if quant else 'fp32'}-{mode}"
            try:
                results[key] = _case(kind, quant, mode, rank, size)
            except Exception as e:
                results[key] = f"error: {e}"
        if not buggy_gather:
            results["vocab"] = _vocab_case(rank, size)
    except Exception:
        results["fatal"] = traceback.format_exc()
    finally:
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(results, f)
        destroy_tp()
