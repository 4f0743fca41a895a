"""Paged KV cache attention: pure-torch reference (the CPU path and the oracle).

Cache layout per layer: k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache.flat[slot_mapping[t]] = k[t]; v likewise. Every slot is valid: padding rows (graph replays)
    point at a scratch block instead, so there is no mask and no host sync here."""
    kf = k_cache.view(-1, k_cache.size(-2), k_cache.size(-1))
    vf = v_cache.view(-1, v_cache.size(-2), v_cache.size(-1))
    kf.index_copy_(0, slot_mapping, k.to(kf.dtype))
    vf.index_copy_(0, slot_mapping, v.to(vf.dtype))


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        cu_q: list[int], context_lens: list[int], scale: float) -> torch.Tensor:
    """out[t] = softmax(scale * q[t] K_s^T, causal) V_s for the sequence s owning row t.

    q [T, Hq, D]; sequence s has query rows cu_q[s]:cu_q[s+1], which are its LAST tokens: query i of
    a sequence with n queries and context c sits at position c - n + i and sees keys 0..c - n + i.
    """
    out = torch.empty_like(q)
    bs = k_cache.size(1)
    hq, hkv = q.size(1), k_cache.size(2)
    for s, ctx in enumerate(context_lens):
        a, b = cu_q[s], cu_q[s + 1]
        n = b - a
        if n == 0:
            continue
        nblk = (ctx + bs - 1) // bs
        blocks = block_tables[s, :nblk].long()
        keys = k_cache[blocks].reshape(-1, hkv, k_cache.size(-1))[:ctx]
        vals = v_cache[blocks].reshape(-1, hkv, v_cache.size(-1))[:ctx]
        qs = q[a:b].transpose(0, 1)  # [Hq, n, D]
        ks, vs = keys.transpose(0, 1), vals.transpose(0, 1)
        if hkv != hq:
            ks = ks.repeat_interleave(hq // hkv, dim=0)
            vs = vs.repeat_interleave(hq // hkv, dim=0)
        qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos
        o = F.scaled_dot_product_attention(qs.float(), ks.float(), vs.float(), attn_mask=mask, scale=scale)
        out[a:b] = o.transpose(0, 1).to(q.dtype)
    return out


@dataclass(frozen=True)
class BatchIndex:
    """Where a step's queries and keys are for paged_attention_batched: the same for every layer of a step
    (compute it once per step with batch_index). B sequences, each padded to Q query rows and L keys."""

    rows: torch.Tensor
    """[B * L] long: flat cache row (block * block_size + offset) of key j of sequence b at b * L + j; L is
    the longest context rounded up to whole blocks (padding rows point into real blocks: masked)."""
    visible: torch.Tensor
    """[B, 1, Q, L] bool: query i of sequence b (position ctx - n + i) sees key j iff j <= ctx - n + i, j < ctx."""
    q_rows: torch.Tensor | None
    """[B * Q] long: the query row of (b, i) (padding rows repeat a real one), None when every sequence
    has exactly one query (decode: q is [B, ...] already)."""
    back: torch.Tensor | None
    """[T] long: the padded row b * Q + i of each real query row t (None with q_rows)."""


def batch_index(block_tables: torch.Tensor, cu_q: list[int], context_lens: list[int], block_size: int) -> BatchIndex:
    """The gathers and the mask that paged_attention_batched reads (host lists in, a handful of small ops)."""
    dev = block_tables.device
    b = len(context_lens)
    nblk = (max(context_lens) + block_size - 1) // block_size
    rows = (block_tables[:b, :nblk].long().unsqueeze(-1) * block_size + torch.arange(block_size, device=dev)).view(-1)
    n = [cu_q[s + 1] - cu_q[s] for s in range(b)]
    q_max = max(n)
    ctx = torch.tensor(context_lens, device=dev)
    keys = torch.arange(nblk * block_size, device=dev)
    if q_max == 1 and min(n) == 1:
        return BatchIndex(rows, (keys.unsqueeze(0) < ctx.unsqueeze(1))[:, None, None, :], None, None)
    start = torch.tensor(cu_q[:-1], device=dev)
    lens = torch.tensor(n, device=dev)
    i = torch.arange(q_max, device=dev)
    q_rows = (start.unsqueeze(1) + torch.minimum(i, lens.unsqueeze(1) - 1)).view(-1)  # padding repeats the last
    last = (ctx - lens).unsqueeze(1) + i  # [B, Q]: the position of query i
    visible = (keys.view(1, 1, -1) <= last.unsqueeze(-1)) & (keys.view(1, 1, -1) < ctx.view(-1, 1, 1))
    seq_of = torch.repeat_interleave(torch.arange(b, device=dev), lens, output_size=cu_q[-1])
    back = seq_of * q_max + torch.arange(cu_q[-1], device=dev) - start[seq_of]
    return BatchIndex(rows, visible.unsqueeze(1), q_rows, back)


def batch_pays(cu_q: list[int], context_lens: list[int], block_size: int) -> bool:
    """Whether paged_attention_batched's padded work (every sequence padded to the most queries and the
    longest context) stays within 4x the real work, or is small anyway: then one call beats the loop's
    ~10 ops per sequence. Off for a long prompt batched with short ones (it would pay its square for all)."""
    b = len(context_lens)
    n = [cu_q[s + 1] - cu_q[s] for s in range(b)]
    if not n or min(n) < 1:  # a sequence without queries this step: the loop skips it
        return False
    lkeys = -(-max(context_lens) // block_size) * block_size
    padded = b * max(n) * lkeys
    return padded <= 4 * sum(q * c for q, c in zip(n, context_lens)) or padded <= 1 << 16


def paged_attention_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: BatchIndex,
                            scale: float) -> torch.Tensor:
    """paged_attention_ref in one attention call: every sequence's keys gathered from the cache (one
    index_select per cache) up to the longest context, its queries padded to the most queries of the
    step, and a mask for the causal limit and the context. Grouped-query heads need no copy of the keys:
    the Hq / Hkv query heads of one kv head are that head's query rows. The loop costs ~10 small ops per
    sequence per layer, most of a CPU step at a few dozen sequences. q [T, Hq, D] -> [T, Hq, D]."""
    hq, d = q.size(1), q.size(2)
    hkv = k_cache.size(2)
    b = index.visible.size(0)
    g = hq // hkv
    keys = k_cache.view(-1, hkv, d).index_select(0, index.rows).view(b, -1, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
    vals = v_cache.view(-1, hkv, d).index_select(0, index.rows).view(b, -1, hkv, d).transpose(1, 2)
    if index.q_rows is None:  # decode: one query per sequence; its heads of one kv head as query rows
        qg = q.reshape(b, hkv, g, d)
        o = F.scaled_dot_product_attention(qg.float(), keys.float(), vals.float(), attn_mask=index.visible,
                                           scale=scale)
        return o.reshape(b, hq, d).to(q.dtype)
    qm = index.visible.size(2)
    # [B, Q, Hq, D] -> [B, Hkv, G * Q, D]: query head h reads kv head h // G (as repeat_interleave would)
    qp = q.index_select(0, index.q_rows).view(b, qm, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * qm, d)
    mask = index.visible.expand(b, 1, qm, -1).repeat(1, 1, g, 1) if g > 1 else index.visible
    o = F.scaled_dot_product_attention(qp.float(), keys.float(), vals.float(), attn_mask=mask, scale=scale)
    o = o.view(b, hkv, g, qm, d).permute(0, 3, 1, 2, 4).reshape(b * qm, hq, d)  # [B * Q, Hq, D]
    return o.index_select(0, index.back).to(q.dtype)


def paged_decode_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: list[int], scale: float) -> torch.Tensor:
    """paged_attention_ref for a decode-only batch (one query per sequence, q [B, Hq, D]): paged_attention_batched."""
    index = batch_index(block_tables, list(range(len(context_lens) + 1)), context_lens, k_cache.size(1))
    return paged_attention_batched(q, k_cache, v_cache, index, scale)


ATTENTION_BACKENDS = ("reference", "triton")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_q_tensor: torch.Tensor, context_lens_tensor: torch.Tensor, cu_q_list: list[int],
                    context_lens_list: list[int], max_q_len: int, scale: float,
                    backend: str = "reference", index: BatchIndex | None = None) -> torch.Tensor:
    """out[t] = softmax(scale * q[t] K_s^T, causal) V_s, as paged_attention_ref, by `backend`.

    reference: paged_attention_ref (reads the host lists), or one call over the whole step
    (paged_attention_batched) where `index` is given (the step's batch_index; the caller asks batch_pays).
    triton: reads
    only the device tensors and max_q_len (no host sync; graph-capturable): the decode kernel (GQA, split
    keys) when every sequence has at most one query, else the decode kernel for the one-query sequences and the
    varlen prefill kernel for the others.
    """
    if backend == "reference":
        if index is not None:
            return paged_attention_batched(q, k_cache, v_cache, index, scale)
        if max_q_len <= 1 and len(cu_q_list) == len(context_lens_list) + 1 == q.size(0) + 1:
            return paged_decode_batched(q, k_cache, v_cache, block_tables, context_lens_list, scale)
        return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_q_list, context_lens_list, scale)
    if backend == "triton":
        from kernels import attention_triton as at

        if max_q_len <= 1:
            return at.paged_attention_decode(q, k_cache, v_cache, block_tables, cu_q_tensor, context_lens_tensor,
                                             scale)
        return at.paged_attention_mixed(q, k_cache, v_cache, block_tables, cu_q_tensor, context_lens_tensor,
                                        max_q_len, scale)
    raise ValueError(f"unknown attention backend {backend!r}; available: {', '.join(ATTENTION_BACKENDS)}")
