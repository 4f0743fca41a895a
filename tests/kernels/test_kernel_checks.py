"""kernels.checks: the start-up checks of attention (with the KV write), the fused ops and int4 GEMM.

A fast candidate passes its check when it is right; made to fail with the fault switch
(XPULORA_KERNEL_FAULT=OP=wrong|raise) it falls back to the reference with a warning that names it, and an
engine is then built with the reference. The CPU's native int4 op runs in-process; the Triton kernels run
under TRITON_INTERPRET=1 in a child process (it must be set before triton is imported).
"""

from __future__ import annotations

import logging

import pytest
import torch

from engine import EngineConfig, KernelConfig, LLMEngine, ModelConfig, ParallelConfig
from kernels.checks import CheckShapes, candidates_for, check_int4, check_ops
from kernels.int4 import Int4Layout, native_supported
from kernels.registry import FAULT_ENV
from tests.e2e.test_kernel_fallback import DEMO
from tests.interp import run_under_interpreter

TINY = CheckShapes(hidden=64, intermediate=96, num_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=16,
                   zero_centered=True, qk_norm=True, block_size=16, int4_group=32, int4_zero_offset=1)
needs_native_cpu = pytest.mark.skipif(not native_supported("native_cpu", Int4Layout(32, 1, 64, 96), torch.float32),
                                      reason="torch has no CPU int4pack op here")


def test_candidates_end_with_the_reference() -> None:
    assert candidates_for("reference") == ["reference"]
    assert candidates_for("triton") == ["triton", "reference"]
    assert candidates_for("auto:native_cuda") == ["auto:native_cuda", "triton", "reference"]


def test_reference_choices_cost_nothing_and_int4_needs_an_int4_model() -> None:
    got = check_ops([("attention", "reference"), ("fused", "reference"), ("int4", "reference")], TINY,
                    torch.float32, torch.device("cpu"))
    assert [(c.op, c.chosen, c.checked, c.rejected) for c in got] == [
        (op, "reference", False, ()) for op in ("attention", "fused", "int4")]
    no_int4 = CheckShapes(**{**TINY.__dict__, "int4_group": None})
    assert [c.op for c in check_ops([("fused", "reference"), ("int4", "native_cpu")], no_int4, torch.float32,
                                    torch.device("cpu"))] == ["fused"]


@needs_native_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_int4_passes_and_a_faulted_one_falls_back(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    c = check_int4("native_cpu", TINY, dtype, torch.device("cpu"))
    assert (c.chosen, c.checked, c.rejected) == ("native_cpu", True, ())
    for mode, why in (("wrong", "native: max abs error"), ("raise", "fault injected")):
        monkeypatch.setenv(FAULT_ENV, f"int4={mode}")
        with caplog.at_level(logging.WARNING, logger="kernels.registry"):
            c = check_int4("native_cpu", TINY, dtype, torch.device("cpu"))
        assert (c.chosen, c.checked) == ("reference", False) and c.rejected[0][0] == "native_cpu"
        assert why in c.rejected[0][1]
        assert "int4 implementation 'native_cpu' failed its start-up check" in caplog.text


@needs_native_cpu
def test_engine_is_built_with_what_the_int4_check_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(ModelConfig(str(DEMO / "model"), dtype="float32", max_model_len=64),
                                      parallel=ParallelConfig(device="cpu"), kernels=KernelConfig(int4="native_cpu")))

    def int4_backends(e: LLMEngine) -> set[str]:
        return {w.backend for m in e.runner.model.modules() for _, w in getattr(m, "int4_paths", [])}

    monkeypatch.delenv(FAULT_ENV, raising=False)
    with engine() as e:
        assert e.runner.kernels.int4 == "native_cpu" and int4_backends(e) == {"native_cpu"}
    monkeypatch.setenv(FAULT_ENV, "int4=wrong")
    with engine() as e:
        int4 = [c for c in e.runner.kernel_choices if c.op == "int4"]
        assert [(c.chosen, [n for n, _ in c.rejected]) for c in int4] == [("reference", ["native_cpu"])]
        assert e.runner.kernels.int4 == "reference" and int4_backends(e) == {"reference"}


CHILD = r"""
import logging, os
import torch
from kernels.checks import CheckShapes, check_ops
s = CheckShapes(64, 96, 4, 2, 32, 16, True, True, 16, 32, 1)
ops = [("attention", "triton"), ("fused", "triton"), ("int4", "triton")]
for dtype in (torch.float32, torch.bfloat16):
    got = check_ops(ops, s, dtype, torch.device("cpu"))
    assert [(c.op, c.chosen, c.checked, c.rejected) for c in got] == [(op, "triton", True, ()) for op, _ in ops], got

class Warnings(logging.Handler):
    lines = []
    def emit(self, record):
        self.lines.append(record.getMessage())

logging.getLogger("kernels.registry").addHandler(Warnings())
os.environ["XPULORA_KERNEL_FAULT"] = "attention=wrong,fused=raise,int4=wrong"
got = check_ops(ops, s, torch.float32, torch.device("cpu"))
assert [(c.op, c.chosen, [n for n, _ in c.rejected]) for c in got] == [(op, "reference", ["triton"]) for op, _ in ops]
for op, _ in ops:
    assert any(f"{op} implementation 'triton' failed its start-up check" in w for w in Warnings.lines), Warnings.lines
# Gated DeltaNet: fla-core cannot run on CPU tensors; its fallback is the Triton decode kernel, which passes here.
del os.environ["XPULORA_KERNEL_FAULT"]
g = CheckShapes(**{**s.__dict__, "gdn": (2, 4, 16, 8)})
[c] = check_ops([("gdn", "fla")], g, torch.float32, torch.device("cpu"))
assert (c.chosen, c.checked, [n for n, _ in c.rejected]) == ("triton", True, ["fla"]), c
print("ok")
"""


def test_triton_candidates_pass_and_faulted_ones_fall_back_under_the_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    run_under_interpreter(CHILD)


def test_fla_on_the_cpu_falls_back_to_the_reference_gdn(caplog: pytest.LogCaptureFixture) -> None:
    """fla-core's kernels cannot run on CPU tensors (nor import without it installed), nor, outside the
    interpreter, the Triton decode kernel tried next: real failures (the interpreter case: CHILD)."""
    with_gdn = CheckShapes(**{**TINY.__dict__, "gdn": (2, 4, 16, 8)})
    with caplog.at_level(logging.WARNING, logger="kernels.registry"):
        [c] = check_ops([("gdn", "fla")], with_gdn, torch.float32, torch.device("cpu"))
    assert (c.op, c.chosen, [n for n, _ in c.rejected]) == ("gdn", "reference", ["fla", "triton"])
    assert "gdn implementation 'fla' failed its start-up check" in caplog.text
    assert check_ops([("gdn", "fla")], TINY, torch.float32, torch.device("cpu")) == []  # no GDN layers


def test_a_slightly_wrong_fused_kernel_is_caught_by_its_own_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """No fault switch: a "fast" silu-and-mul 1% off (the other fused ops right) fails on its part alone."""
    pytest.importorskip("triton")  # kernels.fused_triton defines its kernels at import
    from kernels import fused, fused_triton
    from kernels import reference as ref

    monkeypatch.delenv(FAULT_ENV, raising=False)
    monkeypatch.setattr(fused_triton, "rms_norm_triton", ref.rms_norm)
    monkeypatch.setattr(fused_triton, "rope_write_kv_triton", lambda *a: fused.rope_write_kv(*a, "reference"))
    monkeypatch.setattr(fused_triton, "sigmoid_gate_triton", lambda o, g: fused.sigmoid_gate(o, g, "reference"))
    monkeypatch.setattr(fused_triton, "silu_and_mul_triton", lambda x: ref.silu_and_mul(x) * 1.01)
    [c] = check_ops([("fused", "triton")], TINY, torch.float32, torch.device("cpu"))
    assert c.chosen == "reference" and c.rejected[0][1].startswith("silu_and_mul: max abs error"), c
    monkeypatch.setattr(fused_triton, "silu_and_mul_triton", ref.silu_and_mul)
    [c] = check_ops([("fused", "triton")], TINY, torch.float32, torch.device("cpu"))
    assert (c.chosen, c.rejected) == ("triton", ()), c
