"""Compile the int4 W4A16 Triton kernels offline for an NVIDIA target (no GPU needed) and count what shows
shared-memory round trips, conversions and register use, per launch variant.

    python tools/int4_ir.py                    # sm_90 (H200), the variants below, one JSON line each
    python tools/int4_ir.py --arch 80 --dump /tmp/ir   # also write each variant's TTGIR / PTX / SASS

Counts: TTGIR `local_alloc` (a tensor staged in shared memory: for the weights this is the round trip the mma
kernel avoids), `local_load`, `convert_layout`, async copies; PTX/SASS shared loads/stores, ldmatrix, MMA
instructions, int->float conversions (I2F: the old kernel's bottleneck), and ptxas registers and spills.
Needs triton's bundled ptxas / cuobjdump (the CUDA wheel of triton); the numbers describe the installed triton,
which should be the device's version (triton 3.6 on the H200 image).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import int4_mma, int4_triton

TTGIR = ["local_alloc", "local_load", "convert_layout", "async_copy_global_to_local", "warp_group_dot ", "tt.dot "]
SASS = ["HGMMA", "HMMA", "LDS", "STS", "LDSM", "LDGSTS", "LDG", "I2F", "F2FP", "PRMT", "LOP3", "SHF", "HADD2",
        "FFMA", "SHFL"]


def compile_variant(fn, sig: dict[str, str], const: dict, div16: list[str], num_warps: int, num_stages: int,
                    arch: int, dump: str | None) -> dict:
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div16}
    sig = {**sig, **dict.fromkeys(const, "constexpr")}
    ck = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                        options=dict(num_warps=num_warps, num_stages=num_stages))
    ir, ptx = ck.asm["ttgir"], ck.asm["ptx"]
    res: dict = {"shared_bytes": ck.metadata.shared}
    res.update({p.strip(): ir.count(p) for p in TTGIR})
    with tempfile.TemporaryDirectory() as d:
        src, obj = os.path.join(d, "k.ptx"), os.path.join(d, "k.o")
        Path(src).write_text(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        ptxas = triton.knobs.nvidia.ptxas.path
        info = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", src, "-o", obj], capture_output=True, text=True).stderr
        newer = os.path.join(os.path.dirname(ptxas), "ptxas-blackwell")
        if "Unsupported .version" in info and os.path.exists(newer):  # triton >= 3.7 bundles the newer one apart
            info = subprocess.run([newer, "-v", f"--gpu-name={gpu}", src, "-o", obj], capture_output=True,
                                  text=True).stderr
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.search(r"(\d+) bytes spill stores", info)
        res["registers"] = int(regs.group(1)) if regs else None
        res["spill_bytes"] = int(spill.group(1)) if spill else None
        sass = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", obj], capture_output=True, text=True).stdout
    res.update({f"sass_{op}": len(re.findall(r"\b" + op + r"[.\s]", sass)) for op in SASS})
    res["sass_instructions"] = len(re.findall(r"/\*[0-9a-f]{4}\*/", sass))
    if dump:
        named = ("BN", "BT", "BK", "SPLIT_K", "BLOCK_M", "BLOCK_N", "WTYPE", "FOLD")
        tag = "_".join(f"{k}{v}" for k, v in const.items() if k in named)
        base = os.path.join(dump, f"{fn.__name__}_{tag}_w{num_warps}s{num_stages}")
        for ext, text in (("ttgir", ir), ("ptx", ptx), ("sass", sass)):
            Path(f"{base}.{ext}").write_text(text)
    return res


MMA_SIG = {"x_ptr": "*bf16", "w_ptr": "*i32", "m_ptr": "*i32", "b_ptr": "*bf16", "out_ptr": "*bf16",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_wb": "i32",
           "stride_mg": "i32", "WORDS_PER_SPLIT": "i32", "K_PER_SPLIT": "i32"}
MMA_DIV = [*(a for a in MMA_SIG if a.endswith("_ptr")), "N", "stride_xm", "stride_wb", "stride_mg",
           "WORDS_PER_SPLIT", "K_PER_SPLIT"]
OLD_SIG = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "qz_ptr": "*i32", "b_ptr": "*bf16",
           "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K_PER_SPLIT": "i32",
           "stride_xm": "i32", "stride_qk": "i32", "stride_sg": "i32", "stride_zg": "i32"}
OLD_DIV = [*(a for a in OLD_SIG if a.endswith("_ptr")), "N", "K_PER_SPLIT", "stride_xm", "stride_qk", "stride_sg",
           "stride_zg"]


def variants() -> list[tuple[str, object, dict, dict, list[str], int, int]]:
    out = []
    old = dict(GROUP_SIZE=128, ZERO_OFFSET=1, HAS_BIAS=False, SPLIT_K=4, FP32_DOT=False, BLOCK_M=16, BLOCK_N=64,
               BLOCK_K=128)
    out.append(("old triton M<=16", int4_triton._w4a16_dot_kernel, OLD_SIG, old, OLD_DIV, 4, 3))
    for bn, bt, bk, warps, stages, wtype in ((64, 16, 128, 4, 3, 0), (64, 16, 128, 4, 3, 1), (128, 16, 128, 4, 3, 0),
                                             (64, 16, 128, 4, 1, 0), (64, 16, 128, 4, 4, 0), (64, 8, 128, 4, 3, 0),
                                             (64, 32, 128, 4, 3, 0), (64, 64, 128, 4, 3, 0), (128, 64, 128, 8, 3, 0),
                                             (256, 16, 128, 8, 3, 0), (64, 16, 64, 4, 3, 0)):
        for fold in (False, True):
            c = dict(GROUP=128, HAS_BIAS=False, SPLIT_K=4, WTYPE=wtype, F32_DOT=False, FOLD=fold, BN=bn, BT=bt, BK=bk)
            dt = "bf16" if wtype == 0 else "fp16"
            sig = {**MMA_SIG, "x_ptr": f"*{dt}", "b_ptr": f"*{dt}", "out_ptr": f"*{dt}"}
            out.append((f"mma BN{bn} BT{bt} BK{bk} w{warps} s{stages} {dt}{' fold' if fold else ''}",
                        int4_mma._w4a16_mma_kernel, sig, c, MMA_DIV, warps, stages))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dump", default=None, help="folder for each variant's TTGIR / PTX / SASS")
    args = p.parse_args(argv)
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    print(json.dumps({"triton": triton.__version__, "arch": args.arch}))
    for name, fn, sig, const, div, warps, stages in variants():
        try:
            res = compile_variant(fn, sig, const, div, warps, stages, args.arch, args.dump)
        except Exception as e:  # a variant that does not compile is reported, the others still run
            res = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps({"variant": name, **res}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
