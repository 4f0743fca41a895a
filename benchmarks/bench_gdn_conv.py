"""Gated DeltaNet conv of a mixed step: the one-pass varlen conv against a Python loop over sequences
(kernels.gdn.causal_conv1d per sequence). One JSON line per case; CPU by default.

    python benchmarks/bench_gdn_conv.py [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import device_sync, time_us
from kernels.gdn import causal_conv1d, causal_conv1d_varlen

CASES = {"32 decode + 1 prefill of 128": [1] * 32 + [128], "32 decode": [1] * 32, "1 prefill of 512": [512]}


def run_case(name: str, lens: list[int], dev: torch.device, c: int, g: torch.Generator, k: int = 4) -> dict:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    states = torch.randn(len(lens), c, k - 1, generator=g).to(dev)
    w, x = torch.randn(c, k, generator=g).to(dev), torch.randn(cu[-1], c, generator=g).to(dev)
    slots = list(range(len(lens)))
    index = torch.tensor(slots, device=dev)

    def loop() -> None:
        for i, s in enumerate(slots):
            _, states[s] = causal_conv1d(x[cu[i]:cu[i + 1]], states[s], w)

    def varlen() -> None:
        causal_conv1d_varlen(x, states, index, w, cu)

    sync = device_sync(dev)
    t_loop, t_var = time_us(loop, sync, 0.3), time_us(varlen, sync, 0.3)
    return {"case": name, "device": str(dev), "channels": c, "loop_us": round(t_loop, 1),
            "varlen_us": round(t_var, 1), "speedup": round(t_loop / t_var, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--channels", type=int, default=4096)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    for name, lens in CASES.items():
        print(json.dumps(run_case(name, lens, torch.device(a.device), a.channels, g)), flush=True)


if __name__ == "__main__":
    main()
