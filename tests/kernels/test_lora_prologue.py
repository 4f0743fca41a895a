"""The LoRA shrink joined to the RMSNorm / silu-and-mul launch (kernels.lora_prologue) vs the separate ops.

Oracles:
- y and h against kernels.fused's Triton ops: h and silu-and-mul's y bit for bit; the norm's y within an ulp (its
  mean of squares sums in another order on a GPU: the float32 cases failed bit-equality on an H100);
- the torch reference within two bf16 ulps (test_fused's tolerance: the interpreter's float32 -> bf16 conversion
  rounds differently);
- the partials summed over their K chunks against kernels.reference.lora_shrink of that y (float32 products, the
  order differs: the tolerances of test_lora_triton);
- expanded, the layer's output against the reference's shrink + expand of the reference's y.
A's padding past each rank is garbage, so a missed rank mask shows. Compiled on an accelerator; on the CPU in a
child pytest under TRITON_INTERPRET=1 (test_kernels_under_interpreter).
"""

from __future__ import annotations

import pytest
import torch

from engine.lora.punica import group_tokens
from kernels import reference
from tests.kernels.test_lora_triton import TOLERANCES
from tests.kernels.triton_env import DEV, HAS_TRITON, assert_close_rel, needs_kernels, pytest_under_interpreter


def _layer(seed: int, n_slices: int, k: int, dtype: torch.dtype, num_tokens: int = 11, num_slots: int = 4,
           r_max: int = 16) -> dict:
    """One store of A [S, r_max, n*k] with garbage past each rank, ranks per slice, B per slice, slots with -1s."""
    g = torch.Generator().manual_seed(seed)
    pool = [16, 3, 0, 8, 1]
    ranks = [[min(r_max, pool[(i + s) % len(pool)]) for i in range(num_slots)] for s in range(n_slices)]
    store = torch.randn(num_slots, r_max, n_slices * k, generator=g).to(dtype)
    sizes = [24, 8, 16][:n_slices]
    b = [(torch.randn(num_slots, n, r_max, generator=g) / 4).to(dtype) for n in sizes]
    slots = [(i % (num_slots + 1)) - 1 for i in range(num_tokens)]
    slots = [slots[i] for i in torch.randperm(num_tokens, generator=g).tolist()]
    return dict(store=store, ranks=ranks, b=b, slots=slots, sizes=sizes, k=k, num_slots=num_slots)


def _slices(store: torch.Tensor, n: int, k: int) -> list[torch.Tensor]:
    return [store[:, :, i * k:(i + 1) * k] for i in range(n)]


def _check_partials(buf: torch.Tensor, y: torch.Tensor, p: dict, dtype: torch.dtype) -> None:
    """sum over K chunks == the reference shrink of y, where computed (adapter rows, columns below the rank)."""
    slots = torch.tensor(p["slots"])
    summed = buf.sum(0).cpu()
    for s, a in enumerate(_slices(p["store"], len(p["ranks"]), p["k"])):
        ref = reference.lora_shrink(y.cpu(), a, slots, p["ranks"][s])
        live = torch.zeros_like(ref, dtype=torch.bool)
        for t, slot in enumerate(p["slots"]):
            if slot >= 0:
                live[t, :p["ranks"][s][slot]] = True
        got = torch.where(live, summed[s], 0.0)
        assert_close_rel(got, ref, (1e-5, 1e-5) if dtype == torch.float32 else (1e-3, 1e-4), f"slice {s}")


def _expanded(y_base: torch.Tensor, buf: torch.Tensor, p: dict, dev: torch.device) -> torch.Tensor:
    from kernels.lora_triton import expand_partials

    info = group_tokens(p["slots"], p["num_slots"], device=dev)
    offsets = [sum(p["sizes"][:i]) for i in range(len(p["sizes"]))]
    return expand_partials(y_base.clone(), buf, [b.to(dev) for b in p["b"]], info, offsets,
                           torch.tensor(p["ranks"], dtype=torch.int32, device=dev))


def _reference_layer(y_base: torch.Tensor, x: torch.Tensor, p: dict) -> torch.Tensor:
    out, slots = y_base.clone(), torch.tensor(p["slots"])
    for s, (a, b) in enumerate(zip(_slices(p["store"], len(p["ranks"]), p["k"]), p["b"])):
        buf = reference.lora_shrink(x, a, slots, p["ranks"][s])
        reference.lora_expand(out, buf, b, slots, p["ranks"][s], sum(p["sizes"][:s]), True)
    return out


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_slices", [1, 2, 3])
@pytest.mark.parametrize(("residual", "zero_centered"), [(True, False), (False, False), (True, True)],
                         ids=["res", "nores", "res-zc"])
@pytest.mark.parametrize("split", [None, 3], ids=["default", "split3-uneven"])
def test_norm_shrink_matches_separate_ops(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, n_slices: int,
                                          residual: bool, zero_centered: bool, split: int | None) -> None:
    from kernels import lora_config
    from kernels.fused import rms_norm
    from kernels.lora_prologue import norm_shrink

    assert DEV is not None
    k = 80 if split else 96
    if split:  # 80 = 5 steps of 16: chunks of 2, 2 and 1 steps
        monkeypatch.setitem(lora_config.CONFIG_OVERRIDES, "prologue_block_k", 16)
        monkeypatch.setitem(lora_config.CONFIG_OVERRIDES, "prologue_split_k", split)
    p = _layer(7 + n_slices, n_slices, k, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(p["slots"]), k, generator=g).to(dtype)
    res = torch.randn(len(p["slots"]), k, generator=g).to(dtype) if residual else None
    w = (torch.rand(k, generator=g) + 0.5).to(dtype)
    info = group_tokens(p["slots"], p["num_slots"], device=DEV)
    ranks = torch.tensor(p["ranks"], dtype=torch.int32, device=DEV)
    xd, rd = x.to(DEV), None if res is None else res.to(DEV)
    y, h, buf = norm_shrink(xd, w.to(DEV), 1e-6, zero_centered, rd, _slices(p["store"].to(DEV), n_slices, k), info,
                            ranks)
    assert buf.shape[1:] == (n_slices, len(p["slots"]), 16) and (split is None or buf.size(0) == split)
    y_t, h_t = rms_norm(xd, w.to(DEV), 1e-6, zero_centered, rd, "triton")
    assert torch.equal(h, h_t), "h differs from the Triton RMSNorm's"
    # y: the mean of squares sums in another order (4 warps here, 1-8 there): an ulp of float32 or of bf16 apart
    assert_close_rel(y, y_t, (2e-6, 1e-6) if dtype == torch.float32 else (8e-3, 4e-3), "y vs the Triton RMSNorm")
    y_ref, h_ref = reference.rms_norm(x, w, 1e-6, zero_centered, res)
    assert_close_rel(h, h_ref, TOLERANCES[dtype], "h")
    assert_close_rel(y, y_ref, TOLERANCES[dtype], "y")
    _check_partials(buf, y, p, dtype)
    base = torch.randn(len(p["slots"]), sum(p["sizes"]) + 2, generator=g).to(dtype)
    out = _expanded(base.to(DEV), buf, p, DEV)
    assert_close_rel(out, _reference_layer(base, y_ref, p), TOLERANCES[dtype], "expanded")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("split", [None, 3], ids=["default", "split3-uneven"])
def test_act_shrink_matches_separate_ops(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                         split: int | None) -> None:
    from kernels import lora_config
    from kernels.fused import silu_and_mul
    from kernels.lora_prologue import act_shrink

    assert DEV is not None
    k = 80 if split else 128
    if split:
        monkeypatch.setitem(lora_config.CONFIG_OVERRIDES, "prologue_block_k", 16)
        monkeypatch.setitem(lora_config.CONFIG_OVERRIDES, "prologue_split_k", split)
    p = _layer(3, 1, k, dtype, num_tokens=13)
    x = torch.randn(13, 2 * k, generator=torch.Generator().manual_seed(2)).to(dtype) * 3
    info = group_tokens(p["slots"], p["num_slots"], device=DEV)
    ranks = torch.tensor(p["ranks"], dtype=torch.int32, device=DEV)
    y, buf = act_shrink(x.to(DEV), p["store"].to(DEV), info, ranks)
    assert torch.equal(y, silu_and_mul(x.to(DEV), "triton")), "y differs from the Triton silu-and-mul"
    y_ref = reference.silu_and_mul(x)
    assert_close_rel(y, y_ref, TOLERANCES[dtype], "y")
    _check_partials(buf, y, p, dtype)
    base = torch.randn(13, 26, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = _expanded(base.to(DEV), buf, p, DEV)
    assert_close_rel(out, _reference_layer(base, y_ref, p), TOLERANCES[dtype], "expanded")


def _fp8_store(p: dict, n_slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p's A store as fp8 e4m3 + its scales as the wrappers hold them ([S, r_max, n], slice i's in column i)."""
    q, sc = reference.fp8_rows(p["store"].float().reshape(-1, p["k"]))
    return q.view(p["store"].shape), sc.view(p["num_slots"], p["store"].size(1), n_slices)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_slices", [1, 3])
def test_fp8_a_matches_the_dequantizing_reference(dtype: torch.dtype, n_slices: int) -> None:
    """fp8 A (e4m3 bytes decoded in the kernel, each rank row's partial times its scale): the partials of the norm
    and of silu-and-mul = the reference's shrink with the same fp8 A and scales of the kernels' own y; a missing
    scale, or scales that are not a fixed distance apart, are refused."""
    from kernels.lora_prologue import act_shrink, norm_shrink

    assert DEV is not None
    k = 96
    p = _layer(21 + n_slices, n_slices, k, dtype)
    q, sc = _fp8_store(p, n_slices)
    g = torch.Generator().manual_seed(4)
    t = len(p["slots"])
    x = torch.randn(t, k, generator=g).to(dtype)
    w = (torch.rand(k, generator=g) + 0.5).to(dtype)
    info = group_tokens(p["slots"], p["num_slots"], device=DEV)
    ranks = torch.tensor(p["ranks"], dtype=torch.int32, device=DEV)
    qd, scd = q.to(DEV), sc.to(DEV)
    a, a_scales = _slices(qd, n_slices, k), [scd[:, :, i] for i in range(n_slices)]
    slots = torch.tensor(p["slots"])

    def check(buf: torch.Tensor, y: torch.Tensor, n: int, what: str) -> None:
        summed = buf.sum(0).cpu()
        for s in range(n):
            ref = reference.lora_shrink(y.cpu(), q[:, :, s * k:(s + 1) * k], slots, p["ranks"][s], a_scale=sc[:, :, s])
            live = torch.zeros_like(ref, dtype=torch.bool)
            for i, slot in enumerate(p["slots"]):
                if slot >= 0:
                    live[i, :p["ranks"][s][slot]] = True
            assert live.any()
            got = torch.where(live, summed[s], 0.0)
            assert_close_rel(got, ref, (1e-5, 1e-5) if dtype == torch.float32 else (1e-3, 1e-4), f"{what} {s}")

    y, _, buf = norm_shrink(x.to(DEV), w.to(DEV), 1e-6, False, None, a, info, ranks, a_scales)
    check(buf, y, n_slices, "norm_shrink slice")
    gu = torch.randn(t, 2 * k, generator=g).to(dtype)
    y1, buf1 = act_shrink(gu.to(DEV), a[0], info, ranks[:1], a_scales[0])
    check(buf1, y1, 1, "act_shrink")
    with pytest.raises(ValueError, match="need their scales"):
        norm_shrink(x.to(DEV), w.to(DEV), 1e-6, False, None, a, info, ranks)
    if n_slices > 1:
        scattered = [scd[:, :, 0], scd[:, :, 2], scd[:, :, 1]]
        with pytest.raises(ValueError, match="fixed distance apart"):
            norm_shrink(x.to(DEV), w.to(DEV), 1e-6, False, None, a, info, ranks, scattered)


@needs_kernels
def test_prologue_rejects_what_it_cannot_read() -> None:
    from kernels.lora_prologue import act_shrink, norm_shrink

    assert DEV is not None
    p = _layer(1, 2, 32, torch.float32, num_tokens=5)
    info = group_tokens(p["slots"], p["num_slots"], device=DEV)
    ranks = torch.tensor(p["ranks"], dtype=torch.int32, device=DEV)
    x, w = torch.randn(5, 32, device=DEV), torch.ones(32, device=DEV)
    store = p["store"].to(DEV)
    apart = [store[:, :, :32], store[:, :, :32]]  # not consecutive column ranges
    with pytest.raises(ValueError, match="consecutive column ranges"):
        norm_shrink(x, w, 1e-6, False, None, apart, info, ranks)
    with pytest.raises(ValueError, match="info is for 5 tokens"):
        norm_shrink(x[:4], w, 1e-6, False, None, _slices(store, 2, 32), info, ranks)
    with pytest.raises(ValueError, match="ranks must be"):
        norm_shrink(x, w, 1e-6, False, None, _slices(store, 2, 32), info, ranks[:1])
    wide = torch.zeros(p["num_slots"], 128, 32, device=DEV)
    with pytest.raises(ValueError, match="r_max <= 64"):
        act_shrink(torch.randn(5, 64, device=DEV), wide, info, ranks[:1])
    with pytest.raises(ValueError, match=r"\[T, 2d\]"):
        act_shrink(torch.randn(5, 63, device=DEV), store[:, :, :32], info, ranks[:1])


@needs_kernels
@pytest.mark.parametrize(("broken", "part"), [("norm_shrink", "norm"), ("act_shrink", "silu-and-mul")])
@pytest.mark.parametrize("weight_dtype", [None, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_start_up_check_sees_a_wrong_joined_output(monkeypatch: pytest.MonkeyPatch, broken: str, part: str,
                                                   weight_dtype: torch.dtype | None) -> None:
    """With the joined form on, the engine's LoRA check (engine.lora.impl_check) compares the op's own output too:
    a joined kernel whose partials are right but whose y (what the base GEMM reads) is off sends LoRA to the
    reference. fp8 storage runs the joined form too (counted, so that it cannot pass by not joining)."""
    from engine.lora.impl_check import choose_impl
    from kernels import lora_config, lora_prologue

    assert DEV is not None
    monkeypatch.setitem(lora_config.CONFIG_OVERRIDES, "prologue", 32)
    real, calls = getattr(lora_prologue, broken), []

    def counted(*args: object) -> tuple[torch.Tensor, ...]:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(lora_prologue, broken, counted)
    choice = choose_impl(["triton", "reference"], 64, [32, 16], 16, 4, torch.float32, DEV, weight_dtype)[1]
    assert choice.chosen == "triton" and len(calls) == 1, (choice, calls)

    def wrong_y(*args: object) -> tuple[torch.Tensor, ...]:
        out = real(*args)
        return (out[0] * 1.5, *out[1:])

    monkeypatch.setattr(lora_prologue, broken, wrong_y)
    choice = choose_impl(["triton", "reference"], 64, [32, 16], 16, 4, torch.float32, DEV, weight_dtype)[1]
    assert choice.chosen == "reference" and choice.rejected[0][0] == "triton", choice
    assert choice.rejected[0][1].startswith(f"{part}:"), choice.rejected


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_prologue_takes_small_steps_only_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import lora_config
    from kernels.lora_config import use_prologue

    monkeypatch.delitem(lora_config.CONFIG_OVERRIDES, "prologue", raising=False)  # the default: up to 32 tokens
    assert use_prologue(1, 16) and use_prologue(32, 64)
    assert not use_prologue(33, 16) and not use_prologue(8, 128)
    assert not use_prologue(0, 16)
    monkeypatch.setitem(lora_config.CONFIG_OVERRIDES, "prologue", 0)  # off
    assert not use_prologue(8, 16)
    monkeypatch.setitem(lora_config.CONFIG_OVERRIDES, "prologue", 8)
    assert use_prologue(8, 16) and not use_prologue(9, 16)


def test_kernels_under_interpreter() -> None:
    pytest_under_interpreter(__file__, "not interpreter")
