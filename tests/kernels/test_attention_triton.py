"""Triton paged attention (kernels.attention_triton, kernels.attention.paged_attention backend "triton")
against kernels.attention.paged_attention_ref.

Run: .venv/bin/python -m pytest tests/kernels/test_attention_triton.py -q
Compiled Triton needs an accelerator; on a CPU-only machine the kernel cases run in a child pytest with
TRITON_INTERPRET=1, started by test_kernels_under_interpreter. Everything skips cleanly without triton.

Tolerances against the reference (fp32 SDPA over the upcast cache, one rounding of the output), as
(rtol, atol relative to max|ref|):
- float32: fp32 scores, fp32 online softmax (exp2 with log2(e) folded into the scale), fp32 P @ V;
  only the order of sums and exp rounding differ: ~1e-6 of the output scale, checked at 2e-5.
- bfloat16: q.k products are exact in fp32, softmax in fp32; on a GPU P is rounded to bf16 (2^-9
  relative) for the tensor-core P @ V, and the output is rounded to bf16 (2^-8) as in the reference,
  possibly one ulp apart: two bf16 ulps relative (1.6e-2) plus 1e-2 of the output scale.
Reading a wrong block, a key past the context or past the causal limit moves outputs by O(1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.attention import (
    ATTENTION_BACKENDS,
    batch_index,
    batch_pays,
    paged_attention,
    paged_attention_batched,
    paged_attention_ref,
)
from tests.kernels.triton_env import DEV, INTERPRETING, assert_close_rel, needs_kernels, pytest_under_interpreter

REPO = Path(__file__).resolve().parents[2]

TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1.6e-2, 1e-2)}
BLOCK_SIZE = 16



def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert_close_rel(out, ref, TOLERANCES[dtype], what)


def _batch(seed: int, q_lens: list[int], contexts: list[int], hq: int, hkv: int, d: int,
           dtype: torch.dtype) -> dict:
    """Random paged cache (every slot filled, so reading past a context shows), shuffled physical blocks,
    block tables padded with block 0 (real data: garbage to this sequence)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(c + BLOCK_SIZE - 1) // BLOCK_SIZE for c in contexts]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_per_seq) + 1
    table = torch.zeros(len(contexts), width, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        table[s, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hq, d, generator=g).to(dtype)
    return dict(q=q, k=k_cache, v=v_cache, bt=table, cu=cu, ctx=contexts, max_q=max(q_lens), scale=d ** -0.5)


def _run(b: dict, dev: torch.device, backend: str = "triton") -> torch.Tensor:
    return paged_attention(b["q"].to(dev), b["k"].to(dev), b["v"].to(dev), b["bt"].to(dev),
                           torch.tensor(b["cu"], dtype=torch.int32, device=dev),
                           torch.tensor(b["ctx"], dtype=torch.int32, device=dev), b["cu"], b["ctx"], b["max_q"],
                           b["scale"], backend)


def _ref(b: dict) -> torch.Tensor:
    return paged_attention_ref(b["q"], b["k"], b["v"], b["bt"], b["cu"], b["ctx"], b["scale"])


HEADS = [(8, 2), (4, 4)]  # GQA 4:1 and 1:1 (q heads, kv heads)
DTYPES = [torch.float32, torch.bfloat16]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=["gqa4", "mha"])
def test_decode_matches_reference(heads: tuple[int, int], d: int, dtype: torch.dtype) -> None:
    from kernels.attention_triton import decode_num_splits, paged_attention_decode

    assert DEV is not None
    hq, hkv = heads
    # Contexts not multiples of the block size, one of exactly one block, one sequence with no query.
    b = _batch(d + hq, [1, 1, 0, 1, 1], [37, 5, 9, 16, 70], hq, hkv, d, dtype)
    ref = _ref(b)
    out = _run(b, DEV)
    _assert_close(out, ref, dtype, "decode")
    args = (b["q"].to(DEV), b["k"].to(DEV), b["v"].to(DEV), b["bt"].to(DEV),
            torch.tensor(b["cu"], dtype=torch.int32, device=DEV), torch.tensor(b["ctx"], dtype=torch.int32, device=DEV),
            b["scale"])
    # The other path than the dispatcher's default: split keys merged by the second kernel (with empty
    # splits for the short contexts), or a single pass.
    splits = 1 if decode_num_splits(5, hkv, b["bt"].size(1) * BLOCK_SIZE) > 1 else 3
    o = paged_attention_decode(*args, num_splits=splits)
    _assert_close(o, ref, dtype, f"decode splits={splits}")
    if heads == (8, 2) and d == 128:
        assert torch.equal(o, paged_attention_decode(*args, num_splits=splits)), "deterministic"


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=["gqa4", "mha"])
def test_prefill_matches_reference(heads: tuple[int, int], d: int, dtype: torch.dtype) -> None:
    assert DEV is not None
    hq, hkv = heads
    # A chunk after cached tokens (n < c), a whole prompt (n == c), a decode row, a sequence with no
    # query, and a run longer than one query block.
    b = _batch(d * hq, [7, 21, 1, 0, 3], [30, 21, 45, 12, 3], hq, hkv, d, dtype)
    ref = _ref(b)
    _assert_close(_run(b, DEV), ref, dtype, "prefill")
    if not INTERPRETING:  # the interpreter's default tiles are 16 already: several query blocks per sequence
        from kernels.attention_triton import paged_attention_prefill

        o = paged_attention_prefill(b["q"].to(DEV), b["k"].to(DEV), b["v"].to(DEV), b["bt"].to(DEV),
                                    torch.tensor(b["cu"], dtype=torch.int32, device=DEV),
                                    torch.tensor(b["ctx"], dtype=torch.int32, device=DEV), b["max_q"], b["scale"],
                                    block_m=16, block_n=16)
        _assert_close(o, ref, dtype, "prefill, 16-row tiles")


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_mixed_step_splits_rows_between_the_kernels(dtype: torch.dtype) -> None:
    """A mixed step (the dispatcher's path when max_q_len > 1): the decode kernel writes exactly the rows of
    the one-query sequences and the prefill kernel exactly the others; together they equal the reference."""
    from kernels.attention_triton import paged_attention_decode, paged_attention_mixed, paged_attention_prefill

    assert DEV is not None
    q_lens = [1, 5, 1, 0, 1, 18, 1]
    b = _batch(77, q_lens, [37, 12, 5, 9, 70, 18, 16], 8, 2, 64, dtype)
    ref = _ref(b)
    args = (b["q"].to(DEV), b["k"].to(DEV), b["v"].to(DEV), b["bt"].to(DEV),
            torch.tensor(b["cu"], dtype=torch.int32, device=DEV), torch.tensor(b["ctx"], dtype=torch.int32, device=DEV))
    _assert_close(paged_attention_mixed(*args, b["max_q"], b["scale"]), ref, dtype, "mixed")
    single = torch.tensor([n == 1 for n in q_lens for _ in range(n)])
    nan = torch.full(b["q"].shape, float("nan"), dtype=dtype, device=DEV)
    dec = paged_attention_decode(*args, b["scale"], out=nan.clone(), single_only=True).cpu()
    pre = paged_attention_prefill(*args, b["max_q"], b["scale"], out=nan.clone(), skip_single=True).cpu()
    assert dec[~single].isnan().all() and pre[single].isnan().all(), "a kernel wrote the other's rows"
    _assert_close(dec[single], ref[single], dtype, "decode kernel, one-query rows")
    _assert_close(pre[~single], ref[~single], dtype, "prefill kernel, longer runs")


def test_dispatch_reference_and_unknown_backend() -> None:
    b = _batch(0, [2, 1], [18, 4], 4, 2, 64, torch.float32)
    assert torch.equal(_run(b, torch.device("cpu"), "reference"), _ref(b))
    assert ATTENTION_BACKENDS == ("reference", "triton")
    with pytest.raises(ValueError, match="unknown attention backend"):
        _run(b, torch.device("cpu"), "flash")


@needs_kernels
def test_shape_checks() -> None:
    from kernels.attention_triton import paged_attention_decode, paged_attention_prefill

    assert DEV is not None
    b = _batch(1, [1, 1], [18, 4], 4, 2, 64, torch.float32)
    q, k, v, bt = b["q"].to(DEV), b["k"].to(DEV), b["v"].to(DEV), b["bt"].to(DEV)
    cu = torch.tensor(b["cu"], dtype=torch.int32, device=DEV)
    ctx = torch.tensor(b["ctx"], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="q heads"):
        paged_attention_decode(q[:, :3], k, v, bt, cu, ctx, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_prefill(q[..., :32], k, v, bt, cu, ctx, 1, 1.0)
    with pytest.raises(ValueError, match="cu_q"):
        paged_attention_decode(q, k, v, bt, cu[:2], ctx, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_decode(q, k, v, bt.float(), cu, ctx, 1.0)


@pytest.mark.skipif(DEV is None or DEV.type != "cuda", reason="graph capture is checked on CUDA")
def test_cuda_graph_capture_decode() -> None:
    """Decode reads only device metadata: capture once, replay after new contexts are written in place."""
    from kernels.attention_triton import paged_attention_decode

    assert DEV is not None
    b = _batch(9, [1, 1, 1], [37, 5, 60], 8, 2, 128, torch.bfloat16)
    q, k, v, bt = b["q"].to(DEV), b["k"].to(DEV), b["v"].to(DEV), b["bt"].to(DEV)
    cu = torch.tensor(b["cu"], dtype=torch.int32, device=DEV)
    ctx = torch.tensor(b["ctx"], dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    paged_attention_decode(q, k, v, bt, cu, ctx, b["scale"], num_splits=2, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_decode(q, k, v, bt, cu, ctx, b["scale"], num_splits=2, out=out)
    new_ctx = [40, 7, 58]
    ctx.copy_(torch.tensor(new_ctx, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(out, _ref(dict(b, ctx=new_ctx)), torch.bfloat16, "graph replay")


def test_kernels_under_interpreter() -> None:
    pytest_under_interpreter(__file__, "not interpreter and not cuda_graph")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=["gqa4", "mha"])
def test_reference_backend_batched_decode(heads: tuple[int, int], dtype: torch.dtype) -> None:
    """The reference backend's one-call decode path (kernels.attention.paged_decode_batched) against the
    per-sequence loop: contexts of one block, partial blocks and several blocks, padded tables whose
    padding points at real (wrong) data."""
    hq, hkv = heads
    b = _batch(hq, [1, 1, 1, 1], [37, 5, 16, 70], hq, hkv, 64, dtype)
    out = _run(b, torch.device("cpu"), "reference")
    _assert_close(out, _ref(b), dtype, "batched decode")
    one = _batch(3, [1], [9], hq, hkv, 64, dtype)  # a single sequence
    _assert_close(_run(one, torch.device("cpu"), "reference"), _ref(one), dtype, "batched decode, B=1")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [*HEADS, (4, 2)], ids=["gqa4", "mha", "gqa2"])
@pytest.mark.parametrize("q_lens,contexts", [
    ([5, 1, 12, 3], [5, 40, 12, 33]),  # fresh prompts, a decode, prompt chunks after cached context
    ([9], [9]),  # one prompt
    ([3, 16, 1, 1], [20, 16, 1, 17]),  # a 1-token context and a context of exactly one block
], ids=["mixed", "one", "edges"])
def test_reference_backend_one_call_for_a_mixed_step(heads: tuple[int, int], dtype: torch.dtype, q_lens: list[int],
                                                     contexts: list[int]) -> None:
    """The reference backend's one-call path over any step (kernels.attention.paged_attention_batched: queries
    padded per sequence, keys gathered up to the longest context, a causal + context mask) against the
    per-sequence loop, through paged_attention with the step's index as the attention layers pass it."""
    hq, hkv = heads
    b = _batch(5, q_lens, contexts, hq, hkv, 64, dtype)
    assert batch_pays(b["cu"], b["ctx"], BLOCK_SIZE)
    index = batch_index(b["bt"], b["cu"], b["ctx"], BLOCK_SIZE)
    got = paged_attention(b["q"], b["k"], b["v"], b["bt"], torch.tensor(b["cu"], dtype=torch.int32),
                          torch.tensor(b["ctx"], dtype=torch.int32), b["cu"], b["ctx"], b["max_q"], b["scale"],
                          "reference", index)
    _assert_close(got, _ref(b), dtype, "one-call step")
    _assert_close(paged_attention_batched(b["q"], b["k"], b["v"], index, b["scale"]), _ref(b), dtype, "direct")


def test_one_call_is_refused_when_padding_would_dominate() -> None:
    """A 2000-token prompt next to 16 decodes: padding every sequence to 2000 queries would cost ~17x the
    real work, so the layers keep the per-sequence loop; a step of similar prompts takes the one call."""
    cu, ctx = [0, 2000, *range(2001, 2017)], [2000] + [300] * 16
    assert not batch_pays(cu, ctx, BLOCK_SIZE)
    assert batch_pays([0, 30, 61, 90], [30, 31, 29], BLOCK_SIZE)
