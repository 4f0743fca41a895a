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
class DecodeIndex:
    """Where a decode-only batch's keys are: what paged_decode_batched gathers, the same for every layer of a
    step (compute it once per step with decode_index)."""

    rows: torch.Tensor
    """[B * L] long: flat cache row (block * block_size + offset) of key j of sequence b at b * L + j, where
    L is the longest context rounded up to whole blocks (padding rows point into real blocks: masked)."""
    valid: torch.Tensor
    """[B, 1, 1, L] bool: key j < sequence b's context length."""


def decode_index(block_tables: torch.Tensor, context_lens: list[int], block_size: int) -> DecodeIndex:
    """rows[b * L + j] = block_tables[b, j // block_size] * block_size + j % block_size; valid[b, j] = j < ctx[b]."""
    nblk = (max(context_lens) + block_size - 1) // block_size
    dev = block_tables.device
    offs = torch.arange(block_size, device=dev)
    rows = (block_tables[:, :nblk].long().unsqueeze(-1) * block_size + offs).view(-1)
    ctx = torch.tensor(context_lens, device=dev)
    valid = torch.arange(nblk * block_size, device=dev).unsqueeze(0) < ctx.unsqueeze(1)
    return DecodeIndex(rows, valid[:, None, None, :])


def paged_decode_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: list[int], scale: float, index: DecodeIndex | None = None) -> torch.Tensor:
    """paged_attention_ref for a decode-only batch (one query per sequence, q [B, Hq, D]) in one attention call:
    every sequence's keys are gathered (one index_select per cache) up to the longest context and the keys
    past a sequence's own context are masked. Grouped-query heads need no copy of the keys: the Hq / Hkv
    query heads of one kv head are that head's query rows (q viewed [B, Hkv, Hq / Hkv, D]). The reference
    loop costs ~10 small ops per sequence per layer, which is most of a CPU decode step at a few dozen
    sequences. index: decode_index(block_tables, context_lens, block size), when the caller has it."""
    b, hq, d = q.shape
    bs, hkv = k_cache.size(1), k_cache.size(2)
    ix = index if index is not None else decode_index(block_tables, context_lens, bs)
    keys = k_cache.view(-1, hkv, d).index_select(0, ix.rows).view(b, -1, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
    vals = v_cache.view(-1, hkv, d).index_select(0, ix.rows).view(b, -1, hkv, d).transpose(1, 2)
    qg = q.reshape(b, hkv, hq // hkv, d)  # query head h reads kv head h // (Hq / Hkv), as repeat_interleave
    o = F.scaled_dot_product_attention(qg.float(), keys.float(), vals.float(), attn_mask=ix.valid, scale=scale)
    return o.reshape(b, hq, d).to(q.dtype)


ATTENTION_BACKENDS = ("reference", "triton")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_q_tensor: torch.Tensor, context_lens_tensor: torch.Tensor, cu_q_list: list[int],
                    context_lens_list: list[int], max_q_len: int, scale: float,
                    backend: str = "reference", decode: DecodeIndex | None = None) -> torch.Tensor:
    """out[t] = softmax(scale * q[t] K_s^T, causal) V_s, as paged_attention_ref, by `backend`.

    reference: paged_attention_ref (reads the host lists; decode-only batches in one call, over `decode` when
    given: the step's decode_index). triton: reads
    only the device tensors and max_q_len (no host sync; graph-capturable): the decode kernel (GQA, split
    keys) when every sequence has at most one query, else the varlen prefill kernel.
    """
    if backend == "reference":
        if max_q_len <= 1 and len(cu_q_list) == len(context_lens_list) + 1 == q.size(0) + 1:
            return paged_decode_batched(q, k_cache, v_cache, block_tables, context_lens_list, scale, decode)
        return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_q_list, context_lens_list, scale)
    if backend == "triton":
        from kernels import attention_triton as at

        if max_q_len <= 1:
            return at.paged_attention_decode(q, k_cache, v_cache, block_tables, cu_q_tensor, context_lens_tensor,
                                             scale)
        return at.paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_q_tensor, context_lens_tensor,
                                          max_q_len, scale)
    raise ValueError(f"unknown attention backend {backend!r}; available: {', '.join(ATTENTION_BACKENDS)}")
