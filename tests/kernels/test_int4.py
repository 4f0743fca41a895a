"""int4 (AutoRound / GPTQ layout) kernels: packing, dequant, and every backend against the reference.

Run: .venv/bin/python -m pytest tests/kernels -q
The Triton kernel runs on the CPU under TRITON_INTERPRET=1, which must be set before triton is
imported, so those cases run in a child process (this file run as a script, see _main).
On a machine with an accelerator (CUDA / XPU) the native op of that device and the compiled Triton
kernel are checked too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.int4 import INT4_BACKENDS, Int4Layout, PreparedInt4, int4_mm, native_supported, prepare_int4
from kernels.reference import (
    dequant_int4,
    int4_matmul,
    pack_int4_cols,
    pack_int4_rows,
    unpack_int4_cols,
    unpack_int4_rows,
)
from tests.interp import run_under_interpreter
from tests.kernels.triton_env import assert_close_rel

REPO = Path(__file__).resolve().parents[2]


def _child_env() -> dict[str, str]:
    """This environment with the repo first on the child's path (the device's wheels stay on it)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

# Tolerances against kernels.reference.int4_matmul (fp32 dequant, fp32 accumulate, one final rounding),
# as (rtol, atol relative to max|ref|):
# - float32: backends differ only in summation order / fused multiply-add: ~1e-6 of the output scale.
# - bfloat16: the output itself is rounded to bf16 (8 mantissa bits: 2^-8 = 0.4% relative), and the
#   dense-reference / tinygemm backends also round W or (scale, zero) to bf16 once (another ~2^-9 per
#   weight). 1.6e-2 relative (two bf16 ulps) plus 1e-2 of the output scale for near-zero outputs.
# - float16: 11 mantissa bits, same reasoning: 2e-3.
# A wrong nibble, zero offset or scale sign moves outputs by ~10% of their scale, far above all of these
# (test_tolerance_detects_zero_offset_mixup checks that the bf16 tolerance still catches one).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (2e-3, 2e-3),
}


def _assert_matches(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert_close_rel(y, ref, TOLERANCES[dtype], what)


def _random_int4(k: int, n: int, g: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random checkpoint tensors: full-range int32 words (many negative) and ~half negative fp16 scales."""
    gen = torch.Generator().manual_seed(seed)

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31, shape, dtype=torch.int64, generator=gen)

    qweight = words(k // 8, n).to(torch.int32)
    qzeros = words(k // g, n // 8).to(torch.int32)
    mag = torch.rand(k // g, n, generator=gen) * 0.02 + 0.005
    sign = torch.where(torch.rand(k // g, n, generator=gen) < 0.5, -1.0, 1.0)
    return qweight, qzeros, (mag * sign).to(torch.float16)


def _cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = [
        dict(zero_offset=zo, m=m, g=g, dtype=dt, k=256, n=96)
        for zo in (1, 0)
        for m in (1, 5, 33)
        for g in (32, 128)
        for dt in (torch.float32, torch.bfloat16)
    ]
    # Edges: N not a multiple of any tile (and of 16, so native_cpu skips it), a 3-D activation.
    cases.append(dict(zero_offset=1, m=17, g=32, dtype=torch.float32, k=64, n=40))
    cases.append(dict(zero_offset=0, m=6, g=64, dtype=torch.bfloat16, k=128, n=64, lead=(2, 3)))
    return cases


def _case_id(c: dict[str, Any]) -> str:
    dt = str(c["dtype"]).removeprefix("torch.")
    return f"v{2 - c['zero_offset']}-m{c['m']}-g{c['g']}-k{c['k']}-n{c['n']}-{dt}"


def _check_case(backend: str, case: dict[str, Any], device: torch.device | str = "cpu") -> bool:
    """Assert int4_mm(backend) == reference for one case; False where the backend doesn't support it."""
    zo, m, g, dtype, k, n = (case[key] for key in ("zero_offset", "m", "g", "dtype", "k", "n"))
    layout = Int4Layout(group_size=g, zero_offset=zo, in_features=k, out_features=n)
    if not native_supported(backend, layout, dtype):  # type: ignore[arg-type]
        return False
    seed = 1000 * zo + 10 * m + g
    qweight, qzeros, scales = _random_int4(k, n, g, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    lead = case.get("lead", (m,))
    x = torch.randn(*lead, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if m in (5, 17) else None
    ref = int4_matmul(x, qweight, qzeros, scales, g, zo, bias)

    dev = torch.device(device)
    w = prepare_int4(qweight.to(dev), qzeros.to(dev), scales.to(dev), layout, backend, dtype=dtype)  # type: ignore[arg-type]
    y = int4_mm(x.to(device), w, None if bias is None else bias.to(device))
    assert y.shape == (*lead, n) and y.dtype == dtype, (y.shape, y.dtype)
    _assert_matches(y, ref, dtype, f"{backend} {_case_id(case)}")
    return True


# ----------------------------------------------------------------------------------------------------
# packing


def test_unpack_known_words_with_top_bit_set() -> None:
    # 0xFEDCBA98 has the top bit set: as int32 it is negative; nibble j (LSB first) is 8 + j.
    word = 0xFEDCBA98 - 2**32
    qweight = torch.tensor([[word, 0x76543210]], dtype=torch.int32)  # [K/8=1, N=2]
    u = unpack_int4_rows(qweight)
    assert u.shape == (8, 2)
    assert u[:, 0].tolist() == list(range(8, 16))
    assert u[:, 1].tolist() == list(range(8))
    qzeros = torch.tensor([[word]], dtype=torch.int32)  # [K/G=1, N/8=1]: n = j
    assert unpack_int4_cols(qzeros)[0].tolist() == list(range(8, 16))


@pytest.mark.parametrize("k,n,g", [(64, 16, 32), (256, 96, 128)])
def test_pack_unpack_round_trips(k: int, n: int, g: int) -> None:
    gen = torch.Generator().manual_seed(k + n)
    u = torch.randint(0, 16, (k, n), generator=gen)
    u[7::8] = 15  # top nibble of every word = 0xF: every packed word is negative
    qweight = pack_int4_rows(u)
    assert qweight.dtype == torch.int32 and qweight.shape == (k // 8, n)
    assert bool((qweight < 0).all())
    torch.testing.assert_close(unpack_int4_rows(qweight).long(), u, rtol=0, atol=0)

    z = torch.randint(0, 16, (k // g, n), generator=gen)
    qzeros = pack_int4_cols(z)
    assert qzeros.dtype == torch.int32 and qzeros.shape == (k // g, n // 8)
    torch.testing.assert_close(unpack_int4_cols(qzeros).long(), z, rtol=0, atol=0)

    # And from words: every int32 bit pattern survives unpack -> pack.
    words = torch.randint(-(2**31), 2**31, (k // 8, n), dtype=torch.int64, generator=gen).to(torch.int32)
    torch.testing.assert_close(pack_int4_rows(unpack_int4_rows(words)), words, rtol=0, atol=0)
    torch.testing.assert_close(pack_int4_cols(unpack_int4_cols(words)), words, rtol=0, atol=0)


def test_pack_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        pack_int4_rows(torch.full((8, 8), 16))


# ----------------------------------------------------------------------------------------------------
# dequant


@pytest.mark.parametrize("zero_offset", [1, 0])
def test_dequant_matches_loop_formula(zero_offset: int) -> None:
    k, n, g = 16, 8, 8
    qweight, qzeros, scales = _random_int4(k, n, g, seed=7 + zero_offset)
    w = dequant_int4(qweight, qzeros, scales, g, zero_offset, dtype=torch.float32)
    # Independent formula on Python ints, straight from the layout description.
    expected = torch.empty(k, n)
    for kk in range(k):
        for nn in range(n):
            u = ((int(qweight[kk // 8, nn]) & 0xFFFFFFFF) >> (4 * (kk % 8))) & 0xF
            z = ((int(qzeros[kk // g, nn // 8]) & 0xFFFFFFFF) >> (4 * (nn % 8))) & 0xF
            expected[kk, nn] = float(scales[kk // g, nn]) * (u - (z + zero_offset))
    assert bool((scales < 0).any()) and bool((scales > 0).any())
    torch.testing.assert_close(w, expected, rtol=1e-6, atol=1e-7)
    assert dequant_int4(qweight, qzeros, scales, g, zero_offset).dtype == torch.float16


def test_int4_matmul_is_x_at_dequant_plus_bias() -> None:
    qweight, qzeros, scales = _random_int4(64, 16, 32, seed=3)
    x = torch.randn(3, 64)
    bias = torch.randn(16)
    w = dequant_int4(qweight, qzeros, scales, 32, 1, dtype=torch.float32)
    torch.testing.assert_close(int4_matmul(x, qweight, qzeros, scales, 32, 1, bias), x @ w + bias)


def test_dequant_matches_auto_round_packers() -> None:
    """auto-round's own quantizer + packers (v1 "auto_round:auto_gptq", v2 "auto_round") vs our dequant."""
    int_dt = pytest.importorskip("auto_round.data_type.int")
    qlinear_v2 = pytest.importorskip("auto_round_extension.torch.qlinear_torch")
    qlinear_v1 = pytest.importorskip("auto_round_extension.torch.qlinear_torch_zp")
    torch.manual_seed(0)
    k, n, g = 256, 128, 128
    lin = torch.nn.Linear(k, n, bias=True)
    for quant in (int_dt.quant_tensor_sym, int_dt.quant_tensor_asym):
        qdq, scale, zp = quant(lin.weight.data, bits=4, group_size=g)  # qdq: [N, K] fake-quant weight
        scale = scale.reshape(n, k // g)
        zp = zp.reshape(n, k // g) if isinstance(zp, torch.Tensor) else zp
        if quant is int_dt.quant_tensor_sym:
            assert 0.2 < (scale < 0).float().mean().item() < 0.8  # sym scales carry the sign
        for cls, zero_offset in ((qlinear_v1.QuantLinear, 1), (qlinear_v2.QuantLinear, 0)):
            ql = cls(4, g, k, n, bias=True, weight_dtype=torch.float32)
            ql.device = torch.device("cpu")  # auto-round's exporter sets this before packing
            ql.pack(lin, scale, zp, None, device="cpu")
            w = dequant_int4(ql.qweight, ql.qzeros, ql.scales, g, zero_offset, dtype=torch.float32)
            # Same fp16 scales times the same integers: exact.
            torch.testing.assert_close(w.t(), qdq, rtol=0, atol=0)
            x = torch.randn(5, k).half()
            with torch.no_grad():
                y_ar = ql(x)  # auto-round's torch inference path, in fp16
            y = int4_matmul(x, ql.qweight, ql.qzeros, ql.scales, g, zero_offset, ql.bias)
            _assert_matches(y, y_ar, torch.float16, f"{cls.__module__} {quant.__name__}")


# ----------------------------------------------------------------------------------------------------
# backends on the CPU


@pytest.mark.parametrize("case", _cases(), ids=_case_id)
@pytest.mark.parametrize("backend", ["reference", "native_cpu"])
def test_cpu_backend_matches_reference(backend: str, case: dict[str, Any]) -> None:
    if not _check_case(backend, case):
        pytest.skip(f"{backend} does not support {_case_id(case)}")


def test_native_cpu_support_matrix() -> None:
    def lay(g: int, n: int) -> Int4Layout:
        return Int4Layout(group_size=g, zero_offset=1, in_features=256, out_features=n)

    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for g in (32, 64, 128, 256):
            assert native_supported("native_cpu", lay(g, 64), dt)
    assert not native_supported("native_cpu", lay(16, 64), torch.float32)  # the op rejects group 16
    assert not native_supported("native_cpu", lay(32, 40), torch.float32)  # the packer needs N % 16 == 0
    assert not native_supported("native_cpu", lay(32, 64), torch.int32)
    assert native_supported("reference", lay(16, 40), torch.bfloat16)


def test_tolerance_detects_zero_offset_mixup() -> None:
    """The bf16 tolerance must still see a v1/v2 mix-up (one zero step = ~15% of a weight's scale)."""
    k, n, g = 256, 96, 128
    qweight, qzeros, scales = _random_int4(k, n, g, seed=11)
    x = torch.randn(5, k).bfloat16()
    w = prepare_int4(qweight, qzeros, scales, Int4Layout(g, 0, k, n), "reference", dtype=torch.bfloat16)
    ref_v1 = int4_matmul(x, qweight, qzeros, scales, g, 1)
    with pytest.raises(AssertionError):
        _assert_matches(int4_mm(x, w), ref_v1, torch.bfloat16)


def test_prepare_validates() -> None:
    qweight, qzeros, scales = _random_int4(64, 16, 32, seed=5)
    with pytest.raises(ValueError, match="qweight"):
        prepare_int4(qweight[:4], qzeros, scales, Int4Layout(32, 1, 64, 16), "reference")
    with pytest.raises(ValueError):
        Int4Layout(group_size=48, zero_offset=1, in_features=64, out_features=16)  # K % G != 0
    with pytest.raises(ValueError):
        Int4Layout(group_size=32, zero_offset=2, in_features=64, out_features=16)
    qw40, qz40, s40 = _random_int4(64, 40, 32, seed=6)
    with pytest.raises(ValueError, match="native_cpu"):
        prepare_int4(qw40, qz40, s40, Int4Layout(32, 1, 64, 40), "native_cpu")  # N % 16 != 0
    w = prepare_int4(qweight, qzeros, scales, Int4Layout(32, 1, 64, 16), "reference")
    assert isinstance(w, PreparedInt4) and w.device == qweight.device and w.dtype == torch.float16
    with pytest.raises(ValueError, match="input features"):
        int4_mm(torch.randn(2, 32), w)
    assert int4_mm(torch.randn(0, 64).half(), w).shape == (0, 16)


def test_import_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, kernels.int4 as m, kernels.int4_triton as t\n"
        "assert t.triton is None\n"
        "lay = m.Int4Layout(32, 1, 64, 16)\n"
        "assert not m.native_supported('triton', lay, torch.float32)\n"
        "assert m.native_supported('reference', lay, torch.float32)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------------
# Triton under the CPU interpreter (child process: TRITON_INTERPRET=1 must precede `import triton`)


def test_triton_interpreter_matches_reference() -> None:
    pytest.importorskip("triton")
    if _accelerator() is not None:
        # The same cases run compiled on the accelerator (test_*_on_accelerator below); the interpreter is the
        # CPU-only stand-in, and a GPU image's numpy need not suit it (triton 3.6 + numpy 2.5 on the H200 did not).
        pytest.skip("the compiled Triton kernel runs these cases on the accelerator")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--triton-interpreter"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"checked {len(_cases())} cases" in proc.stdout, proc.stdout


def _main(argv: list[str]) -> int:
    if argv != ["--triton-interpreter"]:
        print("usage: test_int4.py --triton-interpreter  (with TRITON_INTERPRET=1)")
        return 2
    assert os.environ.get("TRITON_INTERPRET") == "1"
    checked = 0
    for case in _cases():
        if not _check_case("triton", case):
            print(f"triton unsupported for {_case_id(case)}")
            return 1
        checked += 1
    print(f"checked {checked} cases")
    return 0


# ----------------------------------------------------------------------------------------------------
# On an accelerator: its native op and the compiled Triton kernel (skipped on CPU-only machines)


def _accelerator() -> torch.device | None:
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    return acc.current_accelerator()


_ACC = _accelerator()
_ACC_BACKENDS = [f"native_{_ACC.type}", "triton", "triton_mma", "triton_gemv", "cuda_mma"] if _ACC is not None else ["triton"]
_ACC_CASES = _cases() + [dict(c, dtype=torch.float16) for c in _cases() if c["dtype"] == torch.bfloat16]


@pytest.mark.skipif(_ACC is None, reason="no accelerator")
@pytest.mark.parametrize("case", _ACC_CASES, ids=_case_id)
@pytest.mark.parametrize("backend", _ACC_BACKENDS)
def test_accelerator_backend_matches_reference(backend: str, case: dict[str, Any]) -> None:
    if backend not in INT4_BACKENDS:
        pytest.skip(f"no int4 backend for {backend}")
    assert _ACC is not None
    if not _check_case(backend, case, device=_ACC):
        pytest.skip(f"{backend} does not support {_case_id(case)}")


def test_dequant_triton_matches_reference_under_interpreter() -> None:
    """The fused dequantization (large-M path) equals kernels.reference.dequant_int4, negative scales, v1 and v2."""
    code = r"""
import torch
from kernels.int4 import dequant_triton
from kernels.reference import dequant_int4, pack_int4_cols, pack_int4_rows
g = torch.Generator().manual_seed(0)
for zo in (0, 1):
    for gs in (32, 128):
        k, n = 256, 48
        qw = pack_int4_rows(torch.randint(0, 16, (k, n), generator=g))
        qz = pack_int4_cols(torch.randint(0, 15, (k // gs, n), generator=g))
        sc = (torch.randn(k // gs, n, generator=g) * 0.05).half()
        ref = dequant_int4(qw, qz, sc, gs, zo, dtype=torch.float32)
        out = dequant_triton(qw, qz, sc, gs, zo, torch.float32)
        assert torch.equal(out, ref), (zo, gs, (out - ref).abs().max())
print("ok")
"""
    run_under_interpreter(code)


DEQUANT_MM = r"""
import sys
import torch
from kernels.int4 import dequant_mm
from kernels.reference import dequant_int4, pack_int4_cols, pack_int4_rows
dev = torch.device(sys.argv[1]) if len(sys.argv) > 1 else torch.device("cpu")
g = torch.Generator().manual_seed(0)
k, n, gs = 256, 200, 32
for zo in (0, 1):
    qw = pack_int4_rows(torch.randint(0, 16, (k, n), generator=g))
    qz = pack_int4_cols(torch.randint(0, 15, (k // gs, n), generator=g))
    sc = (torch.randn(k // gs, n, generator=g) * 0.05).half()
    b = torch.randn(n, generator=g)
    x = torch.randn(7, k, generator=g)
    ref = x @ dequant_int4(qw, qz, sc, gs, zo, dtype=torch.float32)
    for dtype in ((torch.float32, torch.bfloat16) if dev.type != "cpu" else (torch.float32,)):
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for bias in (None, b):
            y = dequant_mm(x.to(dtype).to(dev), qw.to(dev), qz.to(dev), sc.to(dev), gs, zo,
                           None if bias is None else bias.to(dtype).to(dev)).float().cpu()
            want = ref if bias is None else ref + b
            scale = float(want.abs().max())
            err = float((y - want).abs().max())
            assert y.shape == want.shape and err <= tol * scale, (zo, dtype, bias is None, err, scale)
try:
    dequant_mm(torch.randn(7, k - 8).to(dev), qw.to(dev), qz.to(dev), sc.to(dev), gs, 1)
    raise AssertionError("an x of the wrong width was accepted")
except ValueError:
    pass
print("ok")
"""


def test_dequant_mm_matches_reference_under_interpreter() -> None:
    """y = x @ W (+ bias) with W dequantized into a transient dense copy (the engine's large-M int4 path): equal to
    the dense formula; an x that does not fit K is refused."""
    run_under_interpreter(DEQUANT_MM)


@pytest.mark.skipif(_ACC is None, reason="no accelerator")
def test_dequant_mm_matches_reference_on_accelerator() -> None:
    proc = subprocess.run([sys.executable, "-c", DEQUANT_MM, str(_ACC)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=_child_env())
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_dequant_int8_matches_a_loop_over_bytes() -> None:
    """8-bit GPTQ layout: 4 codes per int32 word, LSB first, words read as uint32 (negative words too)."""
    from kernels.reference import dequant_int8

    g = torch.Generator().manual_seed(5)
    k, n, gs = 256, 8, 128
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 4, n), generator=g, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (k // gs, n // 4), generator=g, dtype=torch.int64).to(torch.int32)
    scales = (torch.randn(k // gs, n, generator=g) * 0.01).half()
    for zo in (0, 1):
        w = dequant_int8(qweight, qzeros, scales, gs, zo, dtype=torch.float32)
        for kk in (0, 3, 4, 129, 255):
            for nn in (0, 5, 7):
                word = int(qweight[kk // 4, nn]) & 0xFFFFFFFF
                u = (word >> (8 * (kk % 4))) & 0xFF
                zword = int(qzeros[kk // gs, nn // 4]) & 0xFFFFFFFF
                z = ((zword >> (8 * (nn % 4))) & 0xFF) + zo
                assert w[kk, nn].item() == pytest.approx(float(scales[kk // gs, nn]) * (u - z), rel=1e-6, abs=1e-6)


_SPLIT_K_CHECK = r"""
import sys
import torch
from kernels.int4 import Int4Layout, TritonInt4Config, triton_mm, prepare_int4, triton_config
from kernels.reference import int4_matmul, pack_int4_cols, pack_int4_rows
dev = torch.device(sys.argv[1])
g = torch.Generator().manual_seed(0)
k, n, gs = 512, 96, 128
checked = 0
for zo in (0, 1):
    qw = pack_int4_rows(torch.randint(0, 16, (k, n), generator=g))
    qz = pack_int4_cols(torch.randint(0, 15, (k // gs, n), generator=g))
    sc = (torch.randn(k // gs, n, generator=g) * 0.05).half()
    bias = torch.randn(n, generator=g)
    lay = Int4Layout(gs, zo, k, n)
    w = prepare_int4(qw.to(dev), qz.to(dev), sc.to(dev), lay, "triton", dtype=torch.float32)
    for m in (1, 5, 17, 40):
        x = torch.randn(m, k, generator=g)
        ref = int4_matmul(x, qw, qz, sc, gs, zo) + bias
        configs = [TritonInt4Config(bm, bn, bk, split, 4, 2) for bm in (16, 32) for bn in (32, 64)
                   for bk in (32, 128) for split in (1, 2, 4)] + [triton_config(m, k, n, gs)]
        for c in configs:
            y = triton_mm(x.to(dev), w, bias.to(dev), c).cpu()
            assert torch.allclose(y, ref, atol=1e-4, rtol=1e-4), (zo, m, c, (y - ref).abs().max())
            again = triton_mm(x.to(dev), w, bias.to(dev), c).cpu()
            assert torch.equal(y, again), ("split-K must be deterministic", c)
            checked += 1
from kernels.int4_triton import _counters
counters = _counters(torch.empty(0, device=dev).device)  # the key the kernel used (with a device index)
assert not counters.any(), "every launch leaves its split-K tile counters at zero"
print("ok", checked)
"""


def test_triton_split_k_configs_match_reference_under_interpreter() -> None:
    """Every launch shape of the W4A16 kernel (split-K partials summed in the kernel included) equals the
    reference, with bias, for v1 and v2 zeros and M from 1 to 40; split-K sums are the same bits on a second
    run, and the tile counters end at zero."""
    run_under_interpreter(_SPLIT_K_CHECK.replace("sys.argv[1]", "\"cpu\""), timeout=600)


@pytest.mark.skipif(_ACC is None, reason="no accelerator")
def test_triton_split_k_configs_match_reference_on_accelerator() -> None:
    assert _ACC is not None
    proc = subprocess.run([sys.executable, "-c", _SPLIT_K_CHECK, str(_ACC)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=_child_env())
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


# ----------------------------------------------------------------------------------------------------
# triton_mma: the repacked layout (kernels.int4_mma) and its kernel


def _nibble_formula(packed: torch.Tensor, k: int, n: int) -> int:
    """u(k, n) read from the repacked words straight from kernels.int4_mma's docstring (Python ints)."""
    nb, r8, g = n // 16, (n // 8) % 2, n % 8
    kb, rest = k // 32, k % 32
    p1, p0, c, h = rest // 16, (rest // 8) % 2, (rest // 2) % 4, rest % 2
    word = int(packed[nb, kb, r8, 4 * g + c]) & 0xFFFFFFFF
    return (word >> (4 * (p0 + 2 * p1 + 4 * h))) & 0xF


@pytest.mark.parametrize("k,n", [(32, 16), (128, 48), (256, 96)])
def test_mma_repack_round_trips_and_follows_the_documented_order(k: int, n: int) -> None:
    from kernels.int4_mma import repack_mma, unpack_mma

    gen = torch.Generator().manual_seed(k * n)
    qweight = torch.randint(-(2**31), 2**31, (k // 8, n), dtype=torch.int64, generator=gen).to(torch.int32)
    packed = repack_mma(qweight)
    assert packed.shape == (n // 16, k // 32, 2, 32) and packed.dtype == torch.int32
    torch.testing.assert_close(unpack_mma(packed), qweight, rtol=0, atol=0)
    torch.testing.assert_close(repack_mma(qweight, chunk=16), packed, rtol=0, atol=0)  # chunked = whole
    u = unpack_int4_rows(qweight)
    for kk, nn in [(0, 0), (1, 0), (2, 1), (9, 7), (17, 8), (31, 15), (k - 1, n - 1), (k // 2 + 3, n // 2 + 5)]:
        assert _nibble_formula(packed, kk, nn) == int(u[kk, nn]), (kk, nn)


def test_mma_fold_is_for_16_bit_activations_only() -> None:
    from kernels.int4_mma import MmaConfig, mma_mm

    packed, meta = torch.zeros(4, 8, 2, 32, dtype=torch.int32), torch.zeros(2, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="16-bit activations"):
        mma_mm(torch.zeros(1, 256), packed, meta, 128, None, MmaConfig(64, 16, 128, 1, fold=True))


def test_mma_repack_rejects_shapes_off_its_blocks() -> None:
    from kernels.int4_mma import repack_mma

    with pytest.raises(ValueError, match="N % 16"):
        repack_mma(torch.zeros(4, 24, dtype=torch.int32))  # K = 32, N = 24
    with pytest.raises(ValueError, match="K % 32"):
        repack_mma(torch.zeros(2, 16, dtype=torch.int32))  # K = 16
    assert not native_supported("triton_mma", Int4Layout(16, 1, 64, 32), torch.float32)  # group 16


def _mma_shard_cases() -> list[tuple[str, slice]]:
    return [("columns", slice(32, 80)), ("rows", slice(128, 256))]


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("zeros", ["sym", "asym"])
@pytest.mark.parametrize("cut,span", _mma_shard_cases(), ids=["column_parallel", "row_parallel"])
def test_mma_prepare_of_tp_shards_keeps_every_code_zero_and_scale(g: int, zeros: str, cut: str, span: slice) -> None:
    """Repacking happens after TP sharding (process_after_loading runs on each rank's shard): a column-parallel
    shard (an N slice) and a row-parallel one (a K slice, whole groups) unpack to exactly the shard's qweight,
    scales and zero points."""
    k, n = 256, 96
    qweight, qzeros, scales = _random_int4(k, n, g, seed=g)
    if zeros == "sym":
        qzeros = torch.full_like(qzeros, 0x77777777)  # every zero point 7 + 1
    if cut == "columns":  # what the loader keeps of a column-parallel layer: output features n0:n1
        sq, sz, ss = qweight[:, span], qzeros[:, span.start // 8:span.stop // 8], scales[:, span]
        lay = Int4Layout(g, 1, k, span.stop - span.start)
    else:  # row-parallel: input features k0:k1 (whole groups)
        sq, sz = qweight[span.start // 8:span.stop // 8], qzeros[span.start // g:span.stop // g]
        ss = scales[span.start // g:span.stop // g]
        lay = Int4Layout(g, 1, span.stop - span.start, n)
    from kernels.int4_mma import mma_meta, repack_mma, unpack_meta, unpack_mma

    # prepare_int4(..., "triton_mma") is repack_mma + mma_meta (it needs Triton to be allowed; these do not)
    torch.testing.assert_close(unpack_mma(repack_mma(sq.contiguous())), sq, rtol=0, atol=0)
    zq = unpack_int4_cols(sz.contiguous()) + 1
    meta = mma_meta(ss, zq)
    assert meta.dtype == torch.int32 and meta.shape == (lay.num_groups, lay.out_features)
    got_s, got_z = unpack_meta(meta)
    assert got_s.dtype == torch.float16 and torch.equal(got_s, ss)  # every bit of every scale (negative too)
    torch.testing.assert_close(got_z.long(), zq.long(), rtol=0, atol=0)
    if zeros == "sym":
        assert bool((got_z == 8).all())


def test_mma_meta_keeps_scales_only_when_fp16_holds_them() -> None:
    from kernels.int4_mma import mma_meta, unpack_meta

    zq = torch.full((2, 16), 16)  # the largest zero point (v1 stored 15, + 1)
    exact = (torch.randn(2, 16) * 0.01).half().float()  # fp32 scales that are fp16 values: kept exactly
    s, z = unpack_meta(mma_meta(exact, zq))
    assert torch.equal(s.float(), exact) and bool((z == 16).all())
    with pytest.raises(ValueError, match="fp16"):
        mma_meta(exact + 1e-7, zq)


_MMA_CHECK = r"""
import sys
import torch
from kernels.int4 import Int4Layout, MmaConfig, int4_mm, prepare_int4
from kernels.int4_mma import _counters
from kernels.reference import int4_matmul, pack_int4_cols
dev = torch.device(sys.argv[1])
g = torch.Generator().manual_seed(0)
tol = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}
# (M, K, N, group, dtype, zero points, bias, launch shape or None for the rule)
cases = [
    (1, 256, 96, 128, torch.float32, "asym", True, None),
    (3, 256, 96, 32, torch.bfloat16, "sym", False, None),
    (5, 128, 48, 64, torch.float16, "asym", True, MmaConfig(32, 16, 64, 2)),
    (16, 256, 64, 64, torch.bfloat16, "asym", False, MmaConfig(64, 16, 32, 4)),
    (17, 128, 80, 32, torch.float32, "sym", True, MmaConfig(16, 32, 32, 1)),
    (33, 256, 32, 128, torch.bfloat16, "asym", True, MmaConfig(32, 64, 128, 2)),
    (40, 64, 16, 32, torch.float16, "sym", False, MmaConfig(16, 16, 32, 2)),
    (70, 128, 48, 128, torch.float32, "asym", False, MmaConfig(32, 32, 64, 1)),
    (9, 256, 80, 64, torch.bfloat16, "asym", True, MmaConfig(64, 16, 64, 2)),  # a partial N tile
    (2, 512, 32, 128, torch.bfloat16, "sym", True, MmaConfig(16, 16, 128, 4)),
    (64, 256, 48, 32, torch.bfloat16, "sym", True, None),
    # the tuner's token tiles of 128 (mixed steps), each with a partial one: 64 x 128 (the H200's winners), 128 x 128
    (130, 256, 80, 128, torch.bfloat16, "asym", True, MmaConfig(64, 128, 128, 2)),
    (130, 256, 128, 64, torch.bfloat16, "asym", True, MmaConfig(128, 128, 64, 2, num_warps=8, num_stages=4)),
    # zero points off the accumulator (16-bit activations): sum_k (m + u) x - (m + zq) sum_k x
    (1, 256, 96, 128, torch.bfloat16, "asym", True, MmaConfig(32, 16, 128, 2, fold=True)),
    (5, 256, 64, 32, torch.float16, "asym", False, MmaConfig(64, 16, 32, 4, fold=True)),
    (16, 512, 80, 128, torch.bfloat16, "sym", True, MmaConfig(64, 16, 64, 2, fold=True)),  # partial N tile
    (40, 128, 48, 64, torch.bfloat16, "asym", False, MmaConfig(16, 64, 64, 1, num_stages=4, fold=True)),
]
checked = 0
for m, k, n, gs, dtype, zeros, has_bias, cfg in cases:
    for zo in (1, 0):
        qw = torch.randint(-2**31, 2**31, (k // 8, n), generator=g, dtype=torch.int64).to(torch.int32)
        z = torch.full((k // gs, n), 7) if zeros == "sym" else torch.randint(0, 16 - zo, (k // gs, n), generator=g)
        qz = pack_int4_cols(z)
        sc = (torch.randn(k // gs, n, generator=g) * 0.05).half()
        bias = torch.randn(n, generator=g).to(dtype) if has_bias else None
        x = torch.randn(m, k, generator=g).to(dtype)
        ref = int4_matmul(x, qw, qz, sc, gs, zo, bias)
        w = prepare_int4(qw.to(dev), qz.to(dev), sc.to(dev), Int4Layout(gs, zo, k, n), "triton_mma", dtype=dtype)
        assert w.scales_and_zeros.shape == (k // gs, n) and w.scales_and_zeros.dtype == torch.int32
        w = w if cfg is None else __import__("dataclasses").replace(w, config=cfg)
        y = int4_mm(x.to(dev), w, None if bias is None else bias.to(dev))
        assert y.shape == (m, n) and y.dtype == dtype
        rtol, atol = tol[dtype]
        scale = ref.float().abs().max().item()
        err = (y.float().cpu() - ref.float()).abs()
        assert bool((err <= atol * scale + rtol * ref.float().abs()).all()), (m, k, n, gs, dtype, zeros, zo, cfg,
                                                                             err.max().item())
        if cfg is not None and cfg.split_k > 1:
            again = int4_mm(x.to(dev), w, None if bias is None else bias.to(dev))
            assert torch.equal(y, again), ("split-K must be deterministic", cfg)
        checked += 1
assert not _counters(torch.empty(0, device=dev).device).any(), "every launch leaves its tile counters at zero"
print("ok", checked)
"""


def test_mma_kernel_matches_reference_under_interpreter() -> None:
    """The triton_mma kernel (bf16 / fp16 through their magic-number conversions, fp32 exact) against the
    reference: M 1..70, groups 32/64/128, v1 and v2 zeros, one-row (symmetric) and per-group zero points, bias,
    split-K launch shapes (the same bits on a second run), partial N and token tiles."""
    run_under_interpreter(_MMA_CHECK.replace("sys.argv[1]", "\"cpu\""), timeout=600)


@pytest.mark.skipif(_ACC is None, reason="no accelerator")
def test_mma_kernel_matches_reference_on_accelerator() -> None:
    assert _ACC is not None
    proc = subprocess.run([sys.executable, "-c", _MMA_CHECK, str(_ACC)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=_child_env())
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# ----------------------------------------------------------------------------------------------------
# triton_gemv: one row on CUDA cores (kernels.int4_gemv), more rows through the triton kernel

_GEMV_CHECK = r"""
import sys
import torch
from dataclasses import replace
from kernels.int4 import GemvConfig, Int4Layout, gemv_config, int4_mm, prepare_int4
from kernels.int4_triton import _counters
from kernels.reference import int4_matmul, pack_int4_cols
dev = torch.device(sys.argv[1])
g = torch.Generator().manual_seed(0)
tol = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}
# (M, K, N, group, dtype, zero points, bias, launch shape or None for the rule)
cases = [
    (1, 256, 96, 128, torch.float32, "asym", True, None),  # a partial N tile (128 per program)
    (1, 512, 256, 64, torch.bfloat16, "sym", False, None),
    (1, 256, 64, 32, torch.float16, "asym", True, GemvConfig(32, 4, 2)),
    (1, 512, 200, 128, torch.float32, "asym", False, GemvConfig(64, 16, 4, prefetch=False)),
    (1, 512, 48, 128, torch.bfloat16, "asym", True, GemvConfig(16, 8, 8, num_warps=2)),
    (1, 1024, 32, 128, torch.float32, "sym", True, GemvConfig(32, 16, 1)),  # one program streams all of K
    (1, 128, 16, 16, torch.float32, "asym", False, GemvConfig(16, 2, 4)),
    (3, 256, 96, 32, torch.float32, "asym", True, None),  # above one row: the triton kernel on the same tensors
    (17, 128, 48, 64, torch.bfloat16, "sym", False, None),
]
checked = 0
for m, k, n, gs, dtype, zeros, has_bias, cfg in cases:
    for zo in (1, 0):
        qw = torch.randint(-2**31, 2**31, (k // 8, n), generator=g, dtype=torch.int64).to(torch.int32)
        z = torch.full((k // gs, n), 7) if zeros == "sym" else torch.randint(0, 16 - zo, (k // gs, n), generator=g)
        qz = pack_int4_cols(z)
        sc = (torch.randn(k // gs, n, generator=g) * 0.05).half()
        bias = torch.randn(n, generator=g).to(dtype) if has_bias else None
        x = torch.randn(m, k, generator=g).to(dtype)
        ref = int4_matmul(x, qw, qz, sc, gs, zo, bias)
        qw_dev = qw.to(dev)
        w = prepare_int4(qw_dev, qz.to(dev), sc.to(dev), Int4Layout(gs, zo, k, n), "triton_gemv", dtype=dtype)
        assert w.weight.data_ptr() == qw_dev.data_ptr(), "the checkpoint's words, not a copy"
        w = w if cfg is None else replace(w, config=cfg)
        y = int4_mm(x.to(dev), w, None if bias is None else bias.to(dev))
        assert y.shape == (m, n) and y.dtype == dtype
        rtol, atol = tol[dtype]
        scale = ref.float().abs().max().item()
        err = (y.float().cpu() - ref.float()).abs()
        assert bool((err <= atol * scale + rtol * ref.float().abs()).all()), (m, k, n, gs, dtype, zeros, zo, cfg,
                                                                             err.max().item())
        used = cfg or (gemv_config(m, k, n, gs) if m == 1 else None)
        if used is not None and used.split_k > 1:
            again = int4_mm(x.to(dev), w, None if bias is None else bias.to(dev))
            assert torch.equal(y, again), ("split-K must be deterministic", used)
        checked += 1
assert not _counters(torch.empty(0, device=dev).device).any(), "every launch leaves its tile counters at zero"
print("ok", checked)
"""


def test_gemv_kernel_matches_reference_under_interpreter() -> None:
    """The one-row kernel (fp32 magic-number nibbles) against the reference: groups 16-128, v1 and v2 zeros,
    symmetric and per-group zero points, bias, partial N tiles, split-K (the same bits twice), with and without
    the register prefetch; more rows go through the triton kernel and still equal the reference."""
    run_under_interpreter(_GEMV_CHECK.replace("sys.argv[1]", "\"cpu\""), timeout=600)


@pytest.mark.skipif(_ACC is None, reason="no accelerator")
def test_gemv_kernel_matches_reference_on_accelerator() -> None:
    assert _ACC is not None
    proc = subprocess.run([sys.executable, "-c", _GEMV_CHECK, str(_ACC)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=_child_env())
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_gemv_rejects_what_it_cannot_run() -> None:
    from kernels.int4 import GemvConfig
    from kernels.int4_gemv import GEMV_MAX_ROWS

    assert not GemvConfig(128, 16, 1).fits(1, 256, 64, 64)  # 16 rows of 8 k straddle two groups of 64
    assert not GemvConfig(128, 8, 8).fits(1, 256, 64, 128)  # 8 splits of 64-k steps need K % 512 == 0
    assert GemvConfig(128, 8, 8).fits(1, 512, 64, 128)
    assert not GemvConfig(128, 8, 1).fits(GEMV_MAX_ROWS + 1, 512, 64, 128)
