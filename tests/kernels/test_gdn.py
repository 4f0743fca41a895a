"""Gated DeltaNet references: the chunked form equals the token recurrence, which equals transformers'
own torch implementation (an independent oracle); the conv matches F.conv1d."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gdn import (
    causal_conv1d,
    causal_conv1d_decode,
    causal_conv1d_varlen,
    delta_rule_chunked,
    delta_rule_decode,
    delta_rule_recurrent,
    delta_rule_varlen,
)


def _inputs(n: int, h: int = 3, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(n, h, dk, generator=g), dim=-1) / dk**0.5
    k = F.normalize(torch.randn(n, h, dk, generator=g), dim=-1)
    v = torch.randn(n, h, dv, generator=g)
    gate = -F.softplus(torch.randn(n, h, generator=g)) * 0.5
    beta = torch.rand(n, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g) * 0.1
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize(("n", "chunk"), [(1, 64), (7, 4), (64, 16), (130, 64)])
def test_chunked_equals_recurrent(n: int, chunk: int) -> None:
    q, k, v, g, b, s0 = _inputs(n)
    o1, s1 = delta_rule_recurrent(q, k, v, g, b, s0)
    o2, s2 = delta_rule_chunked(q, k, v, g, b, s0, chunk=chunk)
    torch.testing.assert_close(o2, o1, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s2, s1, atol=2e-5, rtol=1e-4)


def test_recurrent_equals_transformers_torch_path() -> None:
    import inspect

    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    # The torch function itself: with fla-core installed, transformers' decorated name routes to fla.
    torch_recurrent_gated_delta_rule = inspect.unwrap(torch_recurrent_gated_delta_rule)
    q, k, v, g, b, s0 = _inputs(9, seed=3)
    ours, s = delta_rule_recurrent(q, k, v, g, b, s0)
    # transformers takes unnormalised q/k (it normalises and scales inside) in [B, T, H, D] layout.
    theirs, ts = torch_recurrent_gated_delta_rule(q[None] * 16**0.5, k[None], v[None], g[None], b[None],
                                                  initial_state=s0[None], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s, ts[0], atol=1e-5, rtol=1e-4)


def test_split_prompt_carries_state() -> None:
    q, k, v, g, b, s0 = _inputs(20, seed=5)
    full, s_full = delta_rule_chunked(q, k, v, g, b, s0, chunk=8)
    o1, s_mid = delta_rule_chunked(q[:11], k[:11], v[:11], g[:11], b[:11], s0, chunk=8)
    o2, s_end = delta_rule_recurrent(q[11:], k[11:], v[11:], g[11:], b[11:], s_mid)
    torch.testing.assert_close(torch.cat([o1, o2]), full, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s_end, s_full, atol=2e-5, rtol=1e-4)


def test_causal_conv_matches_conv1d_and_streams() -> None:
    g = torch.Generator().manual_seed(1)
    c, kk, n = 6, 4, 10
    x = torch.randn(n, c, generator=g)
    w = torch.randn(c, kk, generator=g)
    ref = F.silu(F.conv1d(x.t()[None], w[:, None, :], padding=kk - 1, groups=c)[0, :, :n]).t()
    y, state = causal_conv1d(x, torch.zeros(c, kk - 1), w)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, x[-(kk - 1):].t())
    y1, st = causal_conv1d(x[:4], torch.zeros(c, kk - 1), w)
    y2, _ = causal_conv1d(x[4:5], st, w)
    y3, _ = causal_conv1d(x[5:], _, w)
    torch.testing.assert_close(torch.cat([y1, y2, y3]), ref, atol=1e-5, rtol=1e-5)


def test_conv_decode_equals_per_sequence_conv() -> None:
    """The batched one-token conv (graph path) equals the per-sequence conv on shuffled state slots."""
    g = torch.Generator().manual_seed(2)
    c, kk, slots = 5, 4, 7
    states = torch.randn(slots, c, kk - 1, generator=g)
    w = torch.randn(c, kk, generator=g)
    index = [4, 0, 6]
    x = torch.randn(len(index), c, generator=g)
    expect = [causal_conv1d(x[i:i + 1], states[s], w) for i, s in enumerate(index)]
    untouched = states[[1, 2, 3, 5]].clone()
    y = causal_conv1d_decode(x, states, torch.tensor(index), w)
    torch.testing.assert_close(y, torch.cat([e[0] for e in expect]), atol=1e-6, rtol=1e-6)
    for (_, st), s in zip(expect, index):
        torch.testing.assert_close(states[s], st)
    torch.testing.assert_close(states[[1, 2, 3, 5]], untouched)


@pytest.mark.parametrize("ratio", [1, 3])
def test_delta_rule_decode_equals_varlen(ratio: int) -> None:
    """One token per sequence, slots as a device tensor, equals the list-driven varlen recurrence."""
    g = torch.Generator().manual_seed(4)
    b, hk, dk, dv, slots = 4, 2, 16, 8, 6
    hv = hk * ratio
    q, k = torch.randn(b, hk, dk, generator=g), torch.randn(b, hk, dk, generator=g)
    v = torch.randn(b, hv, dv, generator=g)
    gate, beta = -F.softplus(torch.randn(b, hv, generator=g)), torch.rand(b, hv, generator=g)
    states = torch.randn(slots, hv, dk, dv, generator=g) * 0.1
    index = [5, 1, 0, 3]
    ref_states = states.clone()
    ref = delta_rule_varlen(q, k, v, gate, beta, ref_states, index, list(range(b + 1)))
    out = delta_rule_decode(q, k, v, gate, beta, states, torch.tensor(index))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)


def test_conv_varlen_equals_per_sequence_conv() -> None:
    """The one-pass conv of a mixed step (prefill chunks, decode rows, an empty entry) equals the
    per-sequence conv, and writes each sequence's next state into its own slot only."""
    g = torch.Generator().manual_seed(6)
    c, kk, slots = 5, 4, 8
    states = torch.randn(slots, c, kk - 1, generator=g)
    w = torch.randn(c, kk, generator=g)
    index, lens = [6, 2, 0, 5, 3], [7, 1, 0, 2, 12]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = torch.randn(cu[-1], c, generator=g)
    expect = [causal_conv1d(x[cu[i]:cu[i + 1]], states[s], w) if lens[i] else (x[:0], states[s].clone())
              for i, s in enumerate(index)]  # an empty entry keeps its state
    untouched = states[[1, 4, 7]].clone()
    y = causal_conv1d_varlen(x, states, torch.tensor(index), w, cu)
    torch.testing.assert_close(y, torch.cat([e[0] for e in expect]), atol=1e-6, rtol=1e-6)
    for (_, st), s in zip(expect, index):
        torch.testing.assert_close(states[s], st)
    torch.testing.assert_close(states[[1, 4, 7]], untouched)
