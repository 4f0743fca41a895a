"""The CUDA C int4 kernel (kernels.int4_cuda, backend cuda_mma): its repacked layout on any machine, the kernel
against kernels.reference on CUDA (every compiled launch shape, 1-64 rows and more, groups 64-256, GPTQ v1 / v2,
per-group zero points, bias, unaligned activations, graph replay, the same bits twice)."""

from __future__ import annotations

import pytest
import torch

from kernels import int4_cuda
from kernels.int4 import Int4Layout, int4_mm, native_supported, prepare_int4
from kernels.int4_cuda import CudaMmaConfig, cuda_config, repack_cuda, tuner_variants, unpack_cuda, variants
from kernels.reference import int4_matmul, pack_int4_cols, pack_int4_rows, unpack_int4_rows
from tests.kernels.triton_env import assert_close_rel

BF16_TOL = (1.6e-2, 1e-2)
"""As tests/kernels/test_int4.py: two bf16 ulps relative plus 1 % of the output scale."""
ON_CUDA = int4_cuda.available()


def _qweight(k: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, (k // 8, n), generator=g, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("k,n", [(64, 16), (256, 48), (1024, 160)])
def test_repack_round_trip(k: int, n: int) -> None:
    qw = _qweight(k, n, k + n)
    packed = repack_cuda(qw, chunk=32)  # several column chunks
    assert packed.shape == (n // 16, k // 64, 32, 4) and packed.dtype == torch.int32
    assert torch.equal(unpack_cuda(packed), qw)
    assert torch.equal(repack_cuda(qw), packed), "the column chunking does not change the layout"


def test_repack_puts_each_weight_where_the_docstring_says() -> None:
    """Word j of lane 4g + t of tile b, chunk c, nibble 4 (kk & 1) + 2 (kk >> 1) + h is W[64c + 16t + 4j + kk,
    16b + g + 8h]: checked for every position of a small layer, independently of unpack_cuda."""
    k, n = 128, 32
    qw = _qweight(k, n, 3)
    u = unpack_int4_rows(qw)
    packed = repack_cuda(qw).to(torch.int64) & 0xFFFFFFFF
    for b in range(n // 16):
        for c in range(k // 64):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for j in range(4):
                    word = int(packed[b, c, lane, j])
                    for kk in range(4):
                        for h in range(2):
                            p = 4 * (kk & 1) + 2 * (kk >> 1) + h
                            assert (word >> (4 * p)) & 0xF == int(u[64 * c + 16 * t + 4 * j + kk, 16 * b + g + 8 * h])


def test_launch_shapes_fit_the_rows_and_k() -> None:
    for m in (1, 8, 9, 16, 17, 32, 33, 64):
        for k in (4096, 5120, 12288, 17408):
            shapes = variants(m, k, 5120)
            assert shapes, (m, k)
            assert all(c.fits(m, k, 5120) and (k // 64) % (c.warps * c.unroll) == 0 for c in shapes)
            rule = cuda_config(m, k, 5120)
            assert rule is not None and rule in shapes and rule.tiles == 1
    assert any(c.tiles > 1 for c in variants(16, 4096, 4096)), "blocks of several feature tiles are candidates"
    for m in (1, 16, 32, 64):
        assert CudaMmaConfig(4, 1).fits(m, 256, 16), "the smallest K the backend takes has a launch shape at any M"
    assert all(c.tiles == 1 for c in variants(16, 4096, 48)), "48 features: only one tile per block divides them"
    for m in (1, 2, 8, 9, 16, 17, 32, 33, 64):
        for k, n in ((256, 16), (4096, 6144), (17408, 5120), (5120, 34816)):
            timed = tuner_variants(m, k, n)
            assert timed and all(c in variants(m, k, n) for c in timed), (m, k, n)
    assert variants(65, 4096, 64) == [] and cuda_config(65, 4096, 64) is None
    # K split over the grid: each split a whole number of rounds of its warps' chunks
    assert CudaMmaConfig(8, 1, 4, 4).fits(16, 4096, 6144) and not CudaMmaConfig(8, 1, 4, 4).fits(16, 1024, 6144)
    assert not CudaMmaConfig(4, 1, 1, 3).fits(64, 4096, 64), "64 chunks do not split in 3"
    assert not CudaMmaConfig(4, 1, 1, 0).fits(64, 4096, 64)
    assert any(c.splits > 1 and c.tiles == 4 for c in variants(16, 4096, 6144)), "swept by the bench and the tests"
    assert all(c.splits == 1 for c in tuner_variants(1, 4096, 4096)), "one row: the grid is full without splits"
    for mt, shapes in int4_cuda.TUNED.items():  # a typo or an uncompiled shape would drop out of the tuner silently
        assert all(CudaMmaConfig(*s).fits(8 * mt, 4096, 6144) for s in shapes), mt
    assert any(c.splits > 1 for c in tuner_variants(32, 12288, 4096)), "the one split shape that won is timed"
    assert not CudaMmaConfig(8, 2).fits(33, 4096, 64), "5 or more token tiles hold one chunk in flight per 8 rows"
    assert int4_cuda.supports_group(128) and int4_cuda.supports_group(64) and not int4_cuda.supports_group(192)
    assert not int4_cuda.supports_group(32)


def test_backend_refuses_what_it_cannot_run() -> None:
    lay = Int4Layout(128, 1, 256, 64)
    assert not native_supported("cuda_mma", lay, torch.float16)
    assert not native_supported("cuda_mma", Int4Layout(32, 1, 256, 64), torch.bfloat16)
    assert not native_supported("cuda_mma", Int4Layout(64, 1, 128, 64), torch.bfloat16), "K below one 4-warp block"
    if not ON_CUDA:
        assert not native_supported("cuda_mma", lay, torch.bfloat16)
        with pytest.raises(ValueError, match="does not support"):
            prepare_int4(_qweight(256, 64, 0), pack_int4_cols(torch.full((2, 64), 7)), torch.ones(2, 64).half(), lay,
                         "cuda_mma", dtype=torch.bfloat16)


def _case(m: int, k: int, n: int, gs: int, zo: int, sym: bool, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    qw = pack_int4_rows(torch.randint(0, 16, (k, n), generator=g))
    z = torch.full((k // gs, n), 7) if sym else torch.randint(0, 16 - zo, (k // gs, n), generator=g)
    qz = pack_int4_cols(z)
    sign = torch.where(torch.rand(k // gs, n, generator=g) < 0.5, -1.0, 1.0)
    sc = ((torch.rand(k // gs, n, generator=g) * 0.02 + 0.005) * sign).half()
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return qw, qz, sc, x, b, int4_matmul(x, qw, qz, sc, gs, zo, b)


CASES = [  # (M, K, N, group, zero_offset, symmetric, bias)
    (1, 4096, 96, 128, 1, True, False),
    (2, 1024, 48, 64, 0, False, True),
    (3, 256, 32, 64, 1, False, True),  # the smallest K: one round of 4 warps
    (5, 2048, 32, 256, 1, False, True),
    (8, 512, 16, 128, 0, True, False),
    (9, 1024, 64, 128, 1, False, False),
    (16, 4096, 32, 128, 1, True, True),
    (17, 1024, 48, 64, 1, False, False),
    (31, 2048, 16, 128, 0, False, True),
    (33, 1024, 32, 128, 1, True, False),
    (64, 4096, 48, 128, 1, False, True),
    (100, 1024, 32, 128, 1, False, True),  # above 64 rows: int4_mm runs 64 at a time
    (16, 2048, 256, 128, 1, False, True),  # 4-tile blocks, whole and with K split over the grid
    (32, 4096, 128, 128, 0, False, False),
]


def test_processes_compile_the_module_once_and_keep_it(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On a fresh machine every engine and test worker asks for the module at once: one compiles it under the cache
    folder's lock (two threads here: flock locks conflict between open files, in one process too), the other
    waits and loads the file it wrote; a later process loads it without compiling. The NVRTC call itself is
    replaced by a slow stand-in (the real one runs in the CUDA tests)."""
    import threading
    import time

    import engine.device as device

    compiled: list[str] = []

    def slow_compile(source: str, first: str, index: int) -> bytes:
        compiled.append(first)
        time.sleep(0.3)
        return b"binary of " + first.encode()

    monkeypatch.setenv("XPULORA_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(device, "compile_cuda", slow_compile)
    monkeypatch.setattr(device, "cuda_build_key", lambda index: "sm90|test")
    names = ["w4a16_a", "w4a16_b"]
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.append(int4_cuda._binary(0, names))) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert compiled == ["w4a16_a"] and got == [b"binary of w4a16_a"] * 2
    assert [p.name for p in tmp_path.glob("int4_cuda_*.bin")] != []
    assert int4_cuda._binary(0, names) == b"binary of w4a16_a" and len(compiled) == 1


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA C kernel runs on CUDA only")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "m{}-k{}-n{}-g{}-zo{}-{}-{}".format(
    c[0], c[1], c[2], c[3], c[4], "sym" if c[5] else "asym", "bias" if c[6] else "nobias"))
def test_every_launch_shape_matches_reference(case: tuple) -> None:
    from dataclasses import replace

    m, k, n, gs, zo, sym, has_bias = case
    qw, qz, sc, x, b, ref = _case(m, k, n, gs, zo, sym, has_bias, seed=m * 7 + k + n)
    dev = torch.device("cuda")
    lay = Int4Layout(gs, zo, k, n)
    assert native_supported("cuda_mma", lay, torch.bfloat16)
    w = prepare_int4(qw.to(dev), qz.to(dev), sc.to(dev), lay, "cuda_mma", dtype=torch.bfloat16)
    bd = None if b is None else b.to(dev)
    shapes = variants(m, k, n) if m <= 64 else [None]
    assert shapes
    for c in shapes:
        wc = replace(w, config=c)
        y = int4_mm(x.to(dev), wc, bd)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert_close_rel(y.cpu(), ref, BF16_TOL, f"cuda_mma {c} {case}")
        assert torch.equal(y, int4_mm(x.to(dev), wc, bd)), ("the same bits on every run", c)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA C kernel runs on CUDA only")
def test_unaligned_activations_and_graph_replay() -> None:
    from dataclasses import replace

    m, k, n, gs = 4, 1024, 64, 128
    qw, qz, sc, x, b, ref = _case(m, k, n, gs, 1, False, True, seed=11)
    dev = torch.device("cuda")
    w = prepare_int4(qw.to(dev), qz.to(dev), sc.to(dev), Int4Layout(gs, 1, k, n), "cuda_mma", dtype=torch.bfloat16)
    big = torch.zeros(m, k + 3, dtype=torch.bfloat16, device=dev)
    big[:, 3:] = x.to(dev)
    view = big[:, 3:]  # rows 6 bytes off a 16-byte boundary
    assert_close_rel(int4_mm(view, w, b.to(dev)).cpu(), ref, BF16_TOL, "unaligned view")
    xs = torch.zeros(m, k, dtype=torch.bfloat16, device=dev)
    bd = b.to(dev)
    graph = torch.cuda.CUDAGraph()
    int4_mm(xs, w, bd)  # warm up outside the capture
    with torch.cuda.graph(graph):
        out = int4_mm(xs, w, bd)
    xs.copy_(x.to(dev))
    graph.replay()
    assert_close_rel(out.cpu(), ref, BF16_TOL, "graph replay")
    # K split over the grid: its workspace comes from the graph's pool, its counters are back at zero each replay
    split = replace(w, config=CudaMmaConfig(4, 1, 1, 4))
    int4_mm(xs, split, bd)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_mm(xs, split, bd)
    for _ in range(3):
        graph.replay()
        assert_close_rel(out.cpu(), ref, BF16_TOL, "split graph replay")
    assert torch.equal(out, int4_mm(xs, split, bd)), "replayed and eager: the same bits"


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA C kernel runs on CUDA only")
def test_cuda_mm_rejects_what_it_cannot_run() -> None:
    from kernels.int4_cuda import cuda_mm

    k, n, gs = 512, 32, 128
    qw, qz, sc, x, _, _ = _case(1, k, n, gs, 1, True, False, seed=2)
    dev = torch.device("cuda")
    w = prepare_int4(qw.to(dev), qz.to(dev), sc.to(dev), Int4Layout(gs, 1, k, n), "cuda_mma", dtype=torch.bfloat16)
    assert w.scales_and_zeros is not None
    with pytest.raises(TypeError, match="bfloat16"):
        cuda_mm(x.to(dev).half(), w.weight, w.scales_and_zeros, gs, None)
    with pytest.raises(ValueError, match="at most 64 rows"):
        cuda_mm(torch.zeros(65, k, dtype=torch.bfloat16, device=dev), w.weight, w.scales_and_zeros, gs, None)
    with pytest.raises(ValueError, match="does not fit"):
        cuda_mm(x.to(dev), w.weight, w.scales_and_zeros, gs, None, CudaMmaConfig(16, 2))  # 8 chunks: 16 x 2 > 8
