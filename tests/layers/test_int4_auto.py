"""The GPU int4 dispatch (small M: memory-bound kernel; large M: fused dequantization + dense GEMM),
exercised on the CPU with native_cpu as the small-M kernel and Triton under the interpreter."""

from __future__ import annotations

from tests.interp import run_under_interpreter

CODE = r"""
import torch
from engine.layers.linear import RowParallelLinear
from engine.layers.quant import Int4LinearMethod, SMALL_M
from kernels.reference import pack_int4_cols, pack_int4_rows
g = torch.Generator().manual_seed(0)
layer = RowParallelLinear(256, 64, bias=True, method=Int4LinearMethod(128, 1, "auto:native_cpu"), prefix="l")
layer.qweight.data.copy_(pack_int4_rows(torch.randint(0, 16, (256, 64), generator=g)))
layer.qzeros.data.copy_(pack_int4_cols(torch.randint(0, 15, (2, 64), generator=g)))
layer.scales.data.copy_((torch.randn(2, 64, generator=g) * 0.05).half())
layer.bias.data.copy_(torch.randn(64, generator=g))
layer.process_after_loading()
assert [(n, w.backend) for n, w in layer.int4_paths] == [(SMALL_M["native"], "native_cpu"), (SMALL_M["triton"], "triton")]
w = layer.dense_weight().float()
# Every path: native up to SMALL_M["native"] rows, Triton up to SMALL_M["triton"], dequantize + GEMM above.
for m in (1, SMALL_M["native"], SMALL_M["native"] + 1, SMALL_M["triton"], SMALL_M["triton"] + 1):
    x = torch.randn(m, 256, generator=g)
    torch.testing.assert_close(layer(x), x @ w.t() + layer.bias, atol=1e-4, rtol=1e-4)
print("ok")
"""


def test_small_and_large_m_paths_equal_the_dense_formula() -> None:
    run_under_interpreter(CODE)


def test_without_triton_the_native_op_takes_every_size() -> None:
    """No Triton (an XPU box without triton-xpu): no fused dequantization either, so the native op must
    serve large M too instead of failing on the dequantization path."""
    import subprocess
    import sys

    code = "import sys; sys.modules['triton'] = None\n" + CODE.split("layer.process_after_loading()")[0] + r"""
layer.process_after_loading()
assert [(n, w.backend) for n, w in layer.int4_paths] == [(None, "native_cpu")]
w = layer.dense_weight().float()
for m in (1, 64, 300):
    x = torch.randn(m, 256, generator=g)
    torch.testing.assert_close(layer(x), x @ w.t() + layer.bias, atol=1e-4, rtol=1e-4)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# ----------------------------------------------------------------------------------------------------
# The tuned dispatch (kernels/int4_tune.py): measured per layer shape and bucket of rows, kept in a cache file


def test_device_resolves_auto_and_tuned() -> None:
    from engine.device import Device

    assert Device("cpu").int4_backend("auto") == "reference"  # no timing at start-up on the CPU unless asked
    assert Device("cpu").int4_backend("tuned") == "tuned:native_cpu,reference"
    assert Device("cuda").int4_backend("auto") == "tuned:native_cuda,cuda_mma,triton_gemv,triton_mma,triton,dequant"
    assert Device("xpu").int4_backend("auto") == "tuned:native_xpu,triton_gemv,triton_mma,triton,dequant"
    assert Device("cuda").int4_backend("tuned") == "tuned:native_cuda,cuda_mma,triton_gemv,triton_mma,triton,dequant"
    assert Device("xpu").int4_backend("tuned") == "tuned:native_xpu,triton_gemv,triton_mma,triton,dequant"
    assert Device("cuda").int4_backend("auto:native_cuda") == "auto:native_cuda"  # the fixed dispatch stays valid


def test_tuner_times_only_launches_that_match_the_reference(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """A candidate whose output is wrong (here native_cpu, scaled by 1.5 at 4 rows and more) is never timed
    there, so the table cannot pick it however fast it is; where it is right it stays a candidate."""
    import logging

    import torch

    import kernels.int4_tune as tu
    from engine.device import Device
    from kernels.int4 import Int4Layout

    real = tu.int4_mm
    monkeypatch.setattr(tu, "int4_mm", lambda x, w, bias=None: real(x, w, bias) * (
        1.5 if w.backend == "native_cpu" and x.size(0) >= 4 else 1.0))
    shape = tu.Shape(Int4Layout(32, 1, 64, 32), torch.float32, sym=False)
    with caplog.at_level(logging.WARNING, logger="kernels.int4_tune"):
        table = tu.measure(shape, ["native_cpu", "reference"], Device("cpu").time_calls, torch.device("cpu"))
    for m, times in table.timings:
        assert {n for n, _ in times} == ({"native_cpu", "reference"} if m < 4 else {"reference"}), (m, times)
    assert all(table.path_for(m).backend == "reference" for m in (4, 8, 1024))
    assert "differs from the reference" in caplog.text


def test_a_backend_that_cannot_prepare_is_no_candidate(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """A backend whose weights cannot be made on this machine (cuda_mma when its CUDA C does not compile with the
    GPU's NVRTC: here native_cpu's prepare raises) drops out of the tuning with a warning; the engine starts on
    the others instead of failing."""
    import logging

    import torch

    import kernels.int4_tune as tu
    from engine.device import Device
    from kernels.int4 import Int4Layout

    real = tu.prepare_int4

    def failing(*args, **kw):  # type: ignore[no-untyped-def]
        if args[4] == "native_cpu":
            raise RuntimeError("nvrtc: error: identifier is undefined")
        return real(*args, **kw)

    monkeypatch.setattr(tu, "prepare_int4", failing)
    shape = tu.Shape(Int4Layout(32, 1, 64, 32), torch.float32, sym=False)
    with caplog.at_level(logging.WARNING, logger="kernels.int4_tune"):
        table = tu.measure(shape, ["native_cpu", "reference"], Device("cpu").time_calls, torch.device("cpu"))
    assert all({n for n, _ in times} == {"reference"} for _, times in table.timings), table.timings
    assert "backend native_cpu could not prepare its weights" in caplog.text


def test_measured_table_picks_the_fastest_path_per_bucket(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With the CPU's candidates and its real timer: every bucket's path is the fastest of its recorded timings,
    neighbours with the same path are merged, the table ends with an open bucket, and it is written to the cache
    and read back by the next engine (another process would read the same file) without timing again."""
    import torch

    import kernels.int4_tune as tu
    import kernels.kernel_cache as kc
    from engine.device import Device
    from kernels.int4 import Int4Layout

    monkeypatch.setenv(kc.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(tu, "_TABLES", {})
    shape = tu.Shape(Int4Layout(32, 1, 64, 32), torch.float32, sym=False)
    dev = Device("cpu")
    table = tu.tune(shape, ["native_cpu", "reference"], dev.time_calls, torch.device("cpu"), dev.product_name())
    assert table.rows[-1][0] is None and [b for b, _ in table.rows[:-1]] == sorted(b for b, _ in table.rows[:-1])
    assert all(a[1] != b[1] for a, b in zip(table.rows, table.rows[1:], strict=False))  # merged
    assert [m for m, _ in table.timings] == [*tu.BUCKETS, tu.LARGE_M]
    for m, times in table.timings:
        assert {n for n, _ in times} == {"native_cpu", "reference"}
        assert table.path_for(m).name == min(times, key=lambda t: t[1])[0]
    assert (tmp_path / tu.CACHE_FILE).exists()

    monkeypatch.setattr(tu, "_TABLES", {})
    def no_timing(calls):  # type: ignore[no-untyped-def]
        raise AssertionError("a cached table must not be timed again")
    again = tu.tune(shape, ["native_cpu", "reference"], no_timing, torch.device("cpu"), dev.product_name())
    assert again.rows == table.rows
    # Other candidates (e.g. one failed its check) are another key: timed again.
    monkeypatch.setattr(tu, "_TABLES", {})
    other = tu.tune(shape, ["reference"], dev.time_calls, torch.device("cpu"), dev.product_name())
    assert [p.backend for _, p in other.rows] == ["reference"]


def test_cache_off_or_unusable_never_stops_the_engine(tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    import torch

    import kernels.int4_tune as tu
    import kernels.kernel_cache as kc
    from kernels.int4 import Int4Layout

    shape = tu.Shape(Int4Layout(32, 1, 64, 32), torch.float32, sym=True)
    timer = lambda calls: float(len(calls))
    monkeypatch.setenv(kc.CACHE_ENV, "off")
    monkeypatch.setattr(tu, "_TABLES", {})
    assert kc.cache_dir() is None
    tu.tune(shape, ["reference"], timer, torch.device("cpu"), "dev")
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(kc.CACHE_ENV, str(blocked))  # a file where the folder should be: cannot be written
    monkeypatch.setattr(tu, "_TABLES", {})
    tu.tune(shape, ["reference"], timer, torch.device("cpu"), "dev")
    assert "not written" in caplog.text
    good = tmp_path / "cache"
    good.mkdir()
    (good / tu.CACHE_FILE).write_text("{ half a file")  # unreadable: timed again, then rewritten
    monkeypatch.setenv(kc.CACHE_ENV, str(good))
    monkeypatch.setattr(tu, "_TABLES", {})
    tu.tune(shape, ["reference"], timer, torch.device("cpu"), "dev")
    assert len(__import__("json").loads((good / tu.CACHE_FILE).read_text())) == 1


TUNED = r"""
import json, os, sys, tempfile
import torch
import kernels.int4_tune as tu
import kernels.kernel_cache as kc
from engine.device import Device
from engine.layers.linear import RowParallelLinear
from engine.layers.quant import Int4LinearMethod
from kernels.int4 import Int4Layout
from kernels.reference import pack_int4_cols, pack_int4_rows
dev = torch.device(sys.argv[1])
dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16  # torch's CUDA int4 op takes bf16 only
tol = 1e-4 if dtype == torch.float32 else 2e-2
native = f"native_{dev.type}"
backends = [native, "triton_mma", "triton", "dequant"]
for sym in (False, True):
    cache = tempfile.mkdtemp()
    os.environ[kc.CACHE_ENV] = cache
    # A table as a tuner on some device might have written it: every kind of path, in several buckets.
    rows = [[1, native], [4, "triton_mma[16x16x32 s2 w4 st2]"], [16, "triton[16x32x32 s2 w4 st2]"],
            [64, "dequant"], [256, "triton_mma"], [None, "dequant"]]
    shape = tu.Shape(Int4Layout(128, 1, 256, 64), dtype, sym=sym)
    key = tu.cache_key(shape, backends, Device(dev.type, dev.index or 0).product_name())
    with open(os.path.join(cache, tu.CACHE_FILE), "w") as f:
        json.dump({key: rows}, f)
    g = torch.Generator().manual_seed(0)
    layer = RowParallelLinear(256, 64, bias=True, method=Int4LinearMethod(128, 1, "tuned:" + ",".join(backends)),
                              prefix="l").to(dev)
    layer.compute_dtype = dtype
    layer.qweight.data.copy_(pack_int4_rows(torch.randint(0, 16, (256, 64), generator=g)))
    z = torch.full((2, 64), 7) if sym else torch.randint(0, 15, (2, 64), generator=g)
    layer.qzeros.data.copy_(pack_int4_cols(z))
    layer.scales.data.copy_((torch.randn(2, 64, generator=g) * 0.05).half())
    layer.bias.data = torch.randn(64, generator=g).to(dtype).to(dev)
    layer.process_after_loading()
    got = [(n, None if w is None else (w.backend, w.config)) for n, w in layer.int4_paths]
    assert [(n, b and b[0]) for n, b in got] == [(1, native), (4, "triton_mma"), (16, "triton"), (64, None),
                                               (256, "triton_mma"), (None, None)], got
    assert got[1][1][1].split_k == 2 and got[4][1][1] is None  # the cached launch shape; the rule's
    mma = [w for _, w in layer.int4_paths if w is not None and w.backend == "triton_mma"]
    assert mma[0].weight is mma[1].weight  # one repacked copy for both launch shapes
    w = layer.dense_weight().float()
    for m in (1, 3, 4, 5, 16, 17, 64, 65, 256, 257):
        x = torch.randn(m, 256, generator=g).to(dtype).to(dev)
        want = x.float() @ w.t() + layer.bias.float()
        torch.testing.assert_close(layer(x).float(), want, atol=tol * float(want.abs().max()), rtol=tol)
print("ok")
"""


def test_tuned_layer_runs_every_path_of_its_table_under_the_interpreter() -> None:
    """A tuned layer built from a cached table: each bucket's kernel (native op, triton_mma with a cached launch
    shape and with its rule, the old Triton kernel, dequant + GEMM in two places) equals the dense formula."""
    run_under_interpreter(TUNED.replace("sys.argv[1]", '"cpu"'))


def _accelerator() -> str | None:
    import torch

    acc = getattr(torch, "accelerator", None)
    return str(acc.current_accelerator()) if acc is not None and acc.is_available() else None


def _on_accelerator(code: str) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    acc = _accelerator()
    if acc is None:
        pytest.skip("no accelerator")
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code, acc], cwd=repo, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_tuned_layer_runs_every_path_of_its_table_on_accelerator() -> None:
    _on_accelerator(TUNED)


MEASURED = r"""
import sys
import torch
from engine.device import Device
from kernels.int4 import Int4Layout, int4_mm, prepare_int4
from kernels.int4_tune import DEQUANT, Shape, _call, measure
from kernels.reference import dequant_int4
dev = torch.device(sys.argv[1])
d = Device(dev.type, dev.index or 0)
backends = d.int4_backend("tuned").split(":", 1)[1].split(",")
lay = Int4Layout(128, 1, 512, 256)
table = measure(Shape(lay, torch.bfloat16, sym=True), backends, d.time_calls, dev, buckets=(1, 16, 64, 1024))
print(table.describe())
assert table.rows[-1][0] is None
for m, times in table.timings:
    assert table.path_for(m).name == times[0][0] and all(t > 0 for _, t in times), (m, times)
g = torch.Generator().manual_seed(1)
qw = torch.randint(-2**31, 2**31 - 1, (64, 256), generator=g, dtype=torch.int32).to(dev)
qz = torch.full((4, 32), 0x77777777, dtype=torch.int32).to(dev)
sc = (torch.randn(4, 256, generator=g) * 0.01).half().to(dev)
ref_w = dequant_int4(qw, qz, sc, 128, 1, dtype=torch.float32)
for m, _ in table.timings:
    path = table.path_for(m)
    w = prepare_int4(qw, qz, sc, lay, "triton" if path.backend == DEQUANT else path.backend, dtype=torch.bfloat16)
    x = torch.randn(m, 512, generator=g).to(torch.bfloat16).to(dev)
    y = _call(path, x, w)().float()
    want = x.float() @ ref_w
    torch.testing.assert_close(y, want, atol=2e-2 * float(want.abs().max()), rtol=2e-2)
print("ok")
"""


def test_tuner_measures_with_device_graphs_and_its_choices_are_right_on_accelerator() -> None:
    """On a GPU: the tuner times every candidate with the device's graph-replay timer, each bucket's choice is the
    fastest it recorded, and each chosen path gives the reference's result."""
    _on_accelerator(MEASURED)


CHECK = r"""
import os
import torch
from kernels.checks import CheckShapes, check_int4
s = CheckShapes(64, 96, 4, 2, 32, 16, True, True, 16, 32, 1)
full = "tuned:native_cpu,triton_gemv,triton_mma,triton,dequant"
for dtype in (torch.float32, torch.bfloat16):
    c = check_int4(full, s, dtype, torch.device("cpu"))
    assert (c.chosen, c.checked, c.rejected) == (full, True, ()), c
os.environ["XPULORA_KERNEL_FAULT"] = "int4=wrong"
c = check_int4(full, s, torch.float32, torch.device("cpu"))
assert (c.chosen, c.checked) == ("reference", False) and [n for n, _ in c.rejected] == full[6:].split(","), c
print("ok")
"""


def test_tuned_candidates_are_each_checked_under_the_interpreter() -> None:
    """Every candidate of a tuned dispatch passes its own start-up check; faulted, none is kept (the reference)."""
    run_under_interpreter(CHECK)


def test_a_failing_candidate_is_left_out_of_the_tuned_dispatch(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch

    import kernels.checks as ch

    s = ch.CheckShapes(64, 96, 4, 2, 32, 16, True, True, 16, 32, 1)
    if not ch.native_supported("native_cpu", ch.Int4Layout(32, 1, 64, 96), torch.float32):
        import pytest

        pytest.skip("torch has no CPU int4pack op here")
    c = ch.check_int4("tuned:native_cpu,reference", s, torch.float32, torch.device("cpu"))
    assert (c.chosen, c.rejected) == ("tuned:native_cpu,reference", ())
    real = ch.int4_mm
    monkeypatch.setattr(ch, "int4_mm", lambda x, w, bias=None: real(x, w, bias) * (1.5 if w.backend == "native_cpu"
                                                                                     else 1.0))
    c = ch.check_int4("tuned:native_cpu,reference", s, torch.float32, torch.device("cpu"))
    assert (c.chosen, [n for n, _ in c.rejected]) == ("reference", ["native_cpu"])


def test_a_cached_table_must_fit_its_shape() -> None:
    """Path names survive the file; a launch shape that does not fit the layer (an edited or stale file) is refused,
    so the tuner times again instead of serving a launch that would fail."""
    import pytest
    import torch

    import kernels.int4_tune as tu
    from kernels.int4 import GemvConfig, Int4Layout, MmaConfig, TritonInt4Config

    shape = tu.Shape(Int4Layout(128, 1, 512, 64), torch.bfloat16, sym=True)
    rows = [[1, "triton_gemv[128x16 s2 w4 st1]"], [2, "triton_gemv[64x8 s4 w8 st1 noprefetch]"]]
    table = tu.table_from_json([*rows, [None, "dequant"]], shape)
    assert [(b, p.name) for b, p in table.rows[:2]] == [tuple(r) for r in rows]
    assert table.rows[1][1].config == GemvConfig(64, 8, 4, 8, 1, prefetch=False)
    rows = [[2, "triton_mma[64x16x128 s2 w4 st3 fold]"], [4, "triton_mma[64x16x128 s4 w4 st3]"],
            [64, "triton[16x64x64 s2 w4 st3]"], [None, "dequant"]]
    table = tu.table_from_json(rows, shape)
    assert [(b, p.name) for b, p in table.rows] == [tuple(r) for r in rows]
    assert table.rows[0][1].config == MmaConfig(64, 16, 128, 2, 4, 3, fold=True)
    table = tu.TunedTable(table.rows[1:])  # the checks below read the rows from 4 on
    assert table.rows[1][1].config == TritonInt4Config(16, 64, 64, 2, 4, 3)
    assert [table.path_for(m).backend for m in (1, 4, 5, 64, 65, 10**6)] == ["triton_mma"] * 2 + ["triton"] * 2 + [
        "dequant"] * 2
    from kernels.int4_cuda import CudaMmaConfig

    rows = [[1, "cuda_mma[w4 u2 n1]"], [16, "cuda_mma[w4 u1 n2 k2]"], [32, "cuda_mma[w4 u1 n1 k2]"],
            [None, "dequant"]]
    table = tu.table_from_json(rows, shape)
    assert [(b, p.name) for b, p in table.rows] == [tuple(r) for r in rows]
    assert [p.config for _, p in table.rows[:3]] == [CudaMmaConfig(4, 2, 1), CudaMmaConfig(4, 1, 2, 2),
                                                     CudaMmaConfig(4, 1, 1, 2)]
    for bad in ([[1, "cuda_mma[w4 u2 n1 k2]"], [None, "dequant"]],  # 8 chunks: 2 splits of 4 leave no 2-chunk round
                [[32, "cuda_mma[w4 u1 n2 k3]"], [None, "dequant"]],  # 8 chunks do not split in 3
                [[16, "cuda_mma[w4 u1 n1 s2]"], [None, "dequant"]],  # not a field of this kernel's paths
                [[None, "cuda_mma[w4 u1 n1]"]],  # a fixed launch shape cannot take every row count
                [[None, "triton_mma[64x16x128 s8 w4 st3]"]],  # K=512 does not split 8 ways into 128-deep tiles
                [[None, "triton_mma[64x16x48 s1 w4 st3]"]],  # 48 is not a multiple of the 32-deep block
                [[4, "dequant"]],  # no open bucket
                [[None, "triton_mma[64x16x128 s4 w4 st3 fast]"]],  # an unknown flag
                [[1, "triton_gemv[128x32 s1 w4 st1]"], [None, "dequant"]],  # 32 rows of 8 k straddle two groups
                [[1, "triton_gemv[128x16 s1 w4 st1 fold]"], [None, "dequant"]]):  # not a flag of this kernel
        with pytest.raises(ValueError):
            tu.table_from_json(bad, shape)
    # dequant in pieces (a cached `dequant[n1024]`) was measured slower and removed; no backend without launch
    # shapes takes one
    for name in ("dequant[n1024]", "native_cuda[x]"):
        with pytest.raises(ValueError, match="unknown path"):
            tu.table_from_json([[None, name]], shape)


RACE = r"""
import os, sys, time
import torch
import kernels.int4_tune as tu
from kernels.int4 import Int4Layout
me, other = sys.argv[1], sys.argv[2]
open(me, "w").close()
while not os.path.exists(other):  # both processes reach tune() within milliseconds of each other
    time.sleep(0.001)
measured = []
def timer(calls):
    measured.append(len(calls))
    time.sleep(0.05)  # 24 timings: the first process is still timing when the second asks for the table
    return 1.0 + 0.001 * len(measured)
shape = tu.Shape(Int4Layout(32, 1, 64, 32), torch.float32, sym=False)
table = tu.tune(shape, ["native_cpu", "reference"], timer, torch.device("cpu"), "dev")
print("measured" if measured else "read", table.describe())
"""


def test_processes_side_by_side_time_a_shape_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two engines starting together (test workers, engines beside each other on one GPU): one times the shape
    under the cache folder's lock, the other waits and reads the table it wrote, instead of timing the same
    shapes at the same time (each timing the other's contention)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "XPULORA_KERNEL_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    procs = [subprocess.Popen([sys.executable, "-c", RACE, me, other], cwd=repo, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for me, other in ((a, b), (b, a))]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    lines = sorted(o.strip().splitlines()[-1] for o, _ in outs)
    assert [ln.split()[0] for ln in lines] == ["measured", "read"], lines
    assert lines[0].split(" ", 1)[1] == lines[1].split(" ", 1)[1]  # the same table
