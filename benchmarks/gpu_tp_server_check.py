"""Tensor parallelism through the server (issue 21): TP=2 equals TP=1, greedy, float32, for a Qwen3-8B-shaped
dense and a Qwen3.6-27B-shaped hybrid random int4 checkpoint (few layers), with two random rank-8 adapters
(every projection of the dense model; the hybrid's MLP projections), in both LoRA modes (default, and
--fully-sharded-loras). Each (checkpoint, mode, TP) is a real `python -m server` (API process + engine core +
TP ranks); the same requests (token-id prompts over the base and both adapters) go to each over HTTP, with
return_tokens_as_token_ids so that the token ids are compared, not their text. One JSON line per comparison;
exit 1 on any difference (tools/checks.py).

    python3 benchmarks/gpu_tp_server_check.py                      # 2 GPUs, NCCL
    python3 benchmarks/gpu_tp_server_check.py --device cpu --quick # tiny shapes, gloo (smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import write_adapter
from tools.checks import Checks, exit_with
from tools.random_int4 import QWEN3_8B, QWEN36_27B, Shape, write_random_int4
from tools.serverlib import ServerProcess

T0 = time.perf_counter()
CHECKS = Checks("gpu_tp_server_check")
TINY = Shape(256, 512, 4, 4, 2, 64, 1024)
TINY_HYBRID = Shape(256, 512, 4, 4, 2, 64, 1024, hybrid=True, lin_k_heads=2, lin_v_heads=4, lin_dim=64)


def emit(**kw: object) -> None:
    print(json.dumps({**kw, "elapsed_s": round(time.perf_counter() - T0, 1)}), flush=True)


def requests(n: int, vocab: int, new_tokens: int) -> list[dict]:
    """n token-id prompts of 8-40 tokens, each on the base (None) and on adapters a0 and a1: 3n requests."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        length = int(torch.randint(8, 41, (1,), generator=g))
        prompt = torch.randint(0, min(vocab, 400), (length,), generator=g).tolist()
        out += [{"prompt": prompt, "model": m, "max_tokens": new_tokens} for m in (None, "a0", "a1")]
    return out


def run(path: str, adapters: list[str], device: str, tp: int, sharded: bool, reqs: list[dict], log: Path
        ) -> list[list[int]]:
    flags = ["--device", device, "--dtype", "float32", "--tensor-parallel-size", str(tp), "--max-model-len", "512",
             "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
             "--lora-modules", *(f"a{i}={p}" for i, p in enumerate(adapters))]
    if sharded:
        flags.append("--fully-sharded-loras")
    srv = ServerProcess(path, flags, log)
    try:
        srv.wait_ready(timeout=900)
        base = httpx.get(srv.url + "/v1/models", headers=srv.headers, timeout=30).json()["data"][0]["id"]
        ids = []
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=600) as client:
            for r in reqs:  # one at a time: each request's batch is itself on both sides
                body = {"model": r["model"] or base, "prompt": r["prompt"], "max_tokens": r["max_tokens"],
                        "temperature": 0.0, "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
                resp = client.post("/v1/completions", json=body)
                resp.raise_for_status()
                tokens = resp.json()["choices"][0]["logprobs"]["tokens"]
                ids.append([int(t.removeprefix("token_id:")) for t in tokens])
        return ids
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "xpu", "cpu"])
    ap.add_argument("--root", default="/tmp/xpulora-tp-server")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4, help="each sent to the base and both adapters")
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test with gloo)")
    ap.add_argument("--shapes", nargs="+", default=["8b", "27b"], choices=["8b", "27b"])
    a = ap.parse_args()
    dev = torch.device(a.device if a.device != "cpu" else "cpu")
    shapes = {"8b": (TINY if a.quick else QWEN3_8B, "Qwen3-8B-shaped int4"),
              "27b": (TINY_HYBRID if a.quick else QWEN36_27B, "Qwen3.6-27B-shaped int4 hybrid")}
    for key in a.shapes:
        shape, name = shapes[key]
        path = write_random_int4(f"{a.root}/{key}", shape, layers=a.layers, device=dev)
        only = "mlp." if shape.hybrid else ""
        adapters = [write_adapter(f"{a.root}/{key}-lora{i}", shape, a.layers, 8, 10 + i, only=only) for i in range(2)]
        reqs = requests(a.prompts, shape.vocab, a.new_tokens)
        for sharded in (False, True):
            mode = "fully-sharded" if sharded else "default"
            got = {tp: run(path, adapters, a.device, tp, sharded, reqs, Path(a.root) / f"{key}-{mode}-tp{tp}.log")
                   for tp in (1, 2)}
            same = sum(x == y for x, y in zip(got[1], got[2]))
            # The comparison means something only if the adapters change what the base model says.
            changed = sum(got[1][i] != got[1][i + 1] and got[1][i] != got[1][i + 2] for i in range(0, len(reqs), 3))
            CHECKS.expect(f"{name}, LoRA {mode}: both adapters change every prompt's output (TP=1)",
                          changed == len(reqs) // 3, prompts_changed=changed, of=len(reqs) // 3)
            CHECKS.expect(f"{name}, LoRA {mode}: TP=2 == TP=1 through the server, float32", same == len(reqs),
                          requests_equal=same, of=len(reqs), adapters=2, elapsed_s=round(time.perf_counter() - T0, 1))
    exit_with(CHECKS)


if __name__ == "__main__":
    main()
