"""Pure-torch reference kernels: the oracles every fast backend is tested against, and the CPU fallback.

int4 layout (AutoRound / GPTQ, no g_idx), for a Linear with in=K, out=N, group G:
  qweight int32 [K/8, N]   word [r, n] holds u(k=8r+j, n) in bits 4j..4j+3 (LSB first)
  qzeros  int32 [K/G, N/8] word [g, c] holds z(g, n=8c+j)  in bits 4j..4j+3
  scales  fp    [K/G, N]   may be negative
  W[k, n] = scales[k//G, n] * (u(k, n) - (z(k//G, n) + zero_offset))
zero_offset is 1 for GPTQ-v1 checkpoints ("auto_round:auto_gptq": stored zero = zp - 1) and 0 for v2.
"""

import torch

__all__ = [
    "dequant_int4",
    "int4_matmul",
    "pack_int4_cols",
    "pack_int4_rows",
    "qk_norm_rope",
    "rms_norm",
    "rope_neox",
    "rope_tables",
    "silu_and_mul",
    "unpack_int4_cols",
    "unpack_int4_rows",
]

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)  # nibble j sits at bits 4j..4j+3


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """out[..., j] = (uint32(words[...]) >> bits*j) & (2^bits - 1)  (int16, last dim 32 / bits)."""
    if words.dtype != torch.int32:
        raise TypeError(f"packed int{bits} tensors must be int32, got {words.dtype}")
    # Widen to int64 and mask so negative int32 words (top bit set) read as uint32.
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=w.device)
    return ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.int16)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    return _fields(words, 4)


def _pack8(u: torch.Tensor) -> torch.Tensor:
    """words[...] = sum_j u[..., j] << 4j, returned as int32 (two's complement of the uint32)."""
    if u.shape[-1] != 8:
        raise ValueError("internal: expected a last dim of 8 nibbles")
    v = u.to(torch.int64)
    if bool(((v < 0) | (v > 15)).any()):
        raise ValueError("int4 values must be in 0..15")
    w = (v << _SHIFTS.to(v.device)).sum(dim=-1)
    # Map 0..2^32-1 to int32's range (a checkpoint stores uint32 bit patterns in int32).
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def unpack_int4_rows(qweight: torch.Tensor) -> torch.Tensor:
    """u[k, n] = (uint32(qweight[k // 8, n]) >> 4*(k % 8)) & 0xF;  [K/8, N] int32 -> [K, N] int16."""
    kw, n = qweight.shape
    return _nibbles(qweight).permute(0, 2, 1).reshape(kw * 8, n)


def unpack_int4_cols(qzeros: torch.Tensor) -> torch.Tensor:
    """z[g, n] = (uint32(qzeros[g, n // 8]) >> 4*(n % 8)) & 0xF;  [K/G, N/8] int32 -> [K/G, N] int16."""
    g, nw = qzeros.shape
    return _nibbles(qzeros).reshape(g, nw * 8)


def pack_int4_rows(u: torch.Tensor) -> torch.Tensor:
    """qweight[r, n] = sum_j u[8r + j, n] << 4j  (as int32);  [K, N] ints 0..15 -> [K/8, N]."""
    k, n = u.shape
    if k % 8:
        raise ValueError(f"K={k} must be a multiple of 8")
    return _pack8(u.reshape(k // 8, 8, n).permute(0, 2, 1))


def pack_int4_cols(z: torch.Tensor) -> torch.Tensor:
    """qzeros[g, c] = sum_j z[g, 8c + j] << 4j  (as int32);  [K/G, N] ints 0..15 -> [K/G, N/8]."""
    g, n = z.shape
    if n % 8:
        raise ValueError(f"N={n} must be a multiple of 8")
    return _pack8(z.reshape(g, n // 8, 8))


def dequant_int4(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    zero_offset: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """W[k, n] = scales[k // G, n] * (u(k, n) - (z(k // G, n) + zero_offset))  in fp32, returned as dtype."""
    return _dequant(unpack_int4_rows(qweight), unpack_int4_cols(qzeros), scales, group_size, zero_offset, dtype)


def _dequant(u: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, group_size: int, zero_offset: int,
             dtype: torch.dtype | None) -> torch.Tensor:
    """The GPTQ formula on unpacked codes u [K, N] and zeros z [K/G, N], whatever their bit width."""
    k, n = u.shape
    if k % group_size or scales.shape != (k // group_size, n) or z.shape != scales.shape:
        raise ValueError(
            f"inconsistent quantized shapes: codes {tuple(u.shape)}, zeros {tuple(z.shape)}, "
            f"scales {tuple(scales.shape)}, group_size {group_size}"
        )
    zq = z.to(torch.float32) + float(zero_offset)
    w = scales.to(torch.float32).repeat_interleave(group_size, dim=0) * (
        u.to(torch.float32) - zq.repeat_interleave(group_size, dim=0)
    )
    return w.to(dtype or scales.dtype)


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    zero_offset: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[..., n] = sum_k fp32(x[..., k]) * W[k, n] + bias[n]  (fp32 accumulate), returned in x.dtype."""
    w = dequant_int4(qweight, qzeros, scales, group_size, zero_offset, dtype=torch.float32)
    y = x.to(torch.float32) @ w
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


# -- 8-bit (GPTQ layout, 4 values per int32) ----------------------------------------------------------
def unpack_int8_rows(qweight: torch.Tensor) -> torch.Tensor:
    """u[k, n] = (uint32(qweight[k // 4, n]) >> 8*(k % 4)) & 0xFF;  [K/4, N] int32 -> [K, N] int16."""
    kw, n = qweight.shape
    return _fields(qweight, 8).permute(0, 2, 1).reshape(kw * 4, n)


def unpack_int8_cols(qzeros: torch.Tensor) -> torch.Tensor:
    """z[g, n] = (uint32(qzeros[g, n // 4]) >> 8*(n % 4)) & 0xFF;  [K/G, N/4] int32 -> [K/G, N] int16."""
    g, nw = qzeros.shape
    return _fields(qzeros, 8).reshape(g, nw * 4)


def dequant_int8(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 zero_offset: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """W[k, n] = scales[k//G, n] * (u(k, n) - (z(k//G, n) + zero_offset)), 8-bit codes; [K, N]."""
    return _dequant(unpack_int8_rows(qweight), unpack_int8_cols(qzeros), scales, group_size, zero_offset, dtype)


# -- LoRA (punica-style batched shrink / expand) --------------------------------------------------------
SlotRows = list[tuple[int, torch.Tensor | slice]]
"""(slot, the rows of the tokens using it) for every adapter slot some token uses (slot -1 left out)."""


def slot_rows(token_slots: torch.Tensor) -> SlotRows:
    """The token rows of each slot in use: computed once per step by a caller that makes many LoRA calls on
    the same tokens (the CPU engine: 2 per wrapped layer), instead of a unique() and nonzero() per call.
    Where every slot's tokens are contiguous (the model runner orders a step's rows by slot) the rows are
    slices: views instead of gathers, and in-place adds instead of scatters."""
    host = token_slots.cpu()
    values, counts = torch.unique_consecutive(host, return_counts=True)
    if values.numel() == torch.unique(values).numel():
        ends = torch.cumsum(counts, 0).tolist()
        return [(v, slice(e - c, e)) for v, c, e in zip(values.tolist(), counts.tolist(), ends) if v >= 0]
    return [(slot, (token_slots == slot).nonzero(as_tuple=True)[0])
            for slot in torch.unique(host).tolist() if slot >= 0]


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, ranks: list[int],
                rows_of: SlotRows | None = None, a_scale: torch.Tensor | None = None) -> torch.Tensor:
    """buf[t, :r] = x[t] @ a[slot[t], :r].T with r = ranks[slot[t]]; rows with slot -1 (and columns past r) are 0.

    x [T, in], a [S, r_max, in], token_slots [T] (int, -1 = no adapter) -> buf [T, r_max] float32.
    rows_of: slot_rows(token_slots), when the caller has it. a_scale [S, r_max]: a is fp8 (or any
    quantized storage) and a[s, r] stands for a[s, r] * a_scale[s, r] (dequantized here, in float32).
    """
    buf = torch.zeros(x.size(0), a.size(1), dtype=torch.float32, device=x.device)
    for slot, rows in rows_of if rows_of is not None else slot_rows(token_slots):
        r = ranks[slot]
        if r == 0:
            continue
        w = a[slot, :r].float()
        if a_scale is not None:
            w = w * a_scale[slot, :r, None]
        buf[rows, :r] = x[rows].float() @ w.t()
    return buf


def lora_expand(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, ranks: list[int],
                offset: int, add_inputs: bool, rows_of: SlotRows | None = None,
                b_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y[t, offset:offset+n] (+)= buf[t, :r] @ b[slot[t], :, :r].T, r = ranks[slot[t]]; rows with slot -1 untouched.

    y [T, N], buf [T, w] (w >= r: only the first r columns are read), b [S, n, r_max]. With add_inputs the
    product is added to y, otherwise it replaces that slice of y. Returns y (updated in place).
    rows_of: slot_rows(token_slots), when the caller has it. b_scale [S, n]: b[s, n] stands for
    b[s, n] * b_scale[s, n] (one scale per output row, dequantized here in float32).
    """
    n = b.size(1)
    if offset < 0 or offset + n > y.size(1):
        raise ValueError(f"lora_expand: slice [{offset}, {offset + n}) outside y of width {y.size(1)}")
    for slot, rows in rows_of if rows_of is not None else slot_rows(token_slots):
        r = ranks[slot]
        w = b[slot, :, :r].float()
        if b_scale is not None:
            w = w * b_scale[slot, :, None]
        out = buf[rows, :r] @ w.t()  # rank 0: [m, 0] @ [0, n] is zeros
        if add_inputs:
            y[rows, offset:offset + n] += out.to(y.dtype)
        else:
            y[rows, offset:offset + n] = out.to(y.dtype)
    return y


FP8_MAX = 448.0
"""Largest finite float8 e4m3fn value."""


def fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [n, m] -> (q [n, m] float8_e4m3fn, scale [n] float32) with q[i] * scale[i] ~ t[i]: one scale per row,
    amax / 448 (rows of zeros get scale 1 and stay zero), round to nearest."""
    t = t.float()
    amax = t.abs().amax(dim=1) if t.size(1) else torch.zeros(t.size(0))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (t / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


# -- norms, rotary embedding, gated activation ----------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (in x's dtype; h = x without one); y = h * rsqrt(mean(h^2) + eps) * w over the last
    dim in float32, with w = 1 + weight if zero_centered else weight. Returns (y in x's dtype, h)."""
    h = x if residual is None else x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if zero_centered else weight.float()
    return (hf * w).to(x.dtype), h


def rope_neox(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x [T, H, D] rotated on its first rotary_dim dims in halves (neox): with [c, s] = cos_sin[positions[t]]
    (each rotary_dim / 2 wide), out = [x1 c - x2 s, x2 c + x1 s, x[rotary_dim:]], in float32, x's dtype out."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    xr, xpass = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    x1, x2 = xr.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([out, xpass], dim=-1) if xpass.numel() else out


def rope_tables(cos_sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, s), each [T, 1, rotary_dim] float32, with [cos, sin] = cos_sin[positions[t]]: c = [cos, cos] and
    s = [-sin, sin], so that rope_neox's rotated part is x_r * c + [x2, x1] * s (qk_norm_rope reads them)."""
    cos, sin = cos_sin[positions].float().unsqueeze(1).chunk(2, dim=-1)
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], rotary_dim: int,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope_neox(rms_norm(q, q_weight)), rope_neox(rms_norm(k, k_weight))) per head, both in one pass over
    their heads laid side by side (the norms only where the weights are given). q [T, Hq, D], k [T, Hkv, D];
    tables = rope_tables(cos_sin, positions). Returns views of one [T, Hq + Hkv, D] tensor in q's dtype."""
    hq, d = q.size(1), q.size(-1)
    x = torch.cat([q, k], dim=1).float()
    if q_weight is not None and k_weight is not None:
        w = torch.cat([q_weight.float().expand(hq, d), k_weight.float().expand(k.size(1), d)])
        x = torch.nn.functional.rms_norm(x, (d,), eps=eps) * (w + 1.0 if zero_centered else w)
    c, s = tables
    half = rotary_dim // 2
    rot = x[..., :rotary_dim] * c + torch.cat([x[..., half:rotary_dim], x[..., :half]], dim=-1) * s
    out = (rot if rotary_dim == d else torch.cat([rot, x[..., rotary_dim:]], dim=-1)).to(q.dtype)
    return out[:, :hq], out[:, hq:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """y = silu(x[..., :d]) * x[..., d:] (each product rounded to x's dtype as torch does)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
