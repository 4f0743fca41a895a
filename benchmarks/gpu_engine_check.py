"""GPU correctness of the fast paths, end to end: the engine with its GPU kernels (Triton attention,
Triton LoRA, int4 dispatch) and decode graphs must give the same greedy tokens as the same engine with
the torch reference kernels, eagerly, in float32 — for mixed batches of base and adapter requests.
Then a Qwen3.5-shaped hybrid: decode graphs equal eager with the same Gated DeltaNet kernels (torch
reference, and fla-core, which computes in bf16 and is reported against the reference only as a count).
One JSON line per case."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import write_adapter
from engine import CacheConfig, EngineConfig, LLMEngine, LoRAConfig, ModelConfig, SamplingParams, SchedulerConfig
from tools.random_int4 import Shape, write_random_int4

REFERENCE = {"XPULORA_ATTENTION_BACKEND": "reference", "XPULORA_LORA_BACKEND": "reference",
             "XPULORA_INT4_BACKEND": "reference", "XPULORA_FUSED_BACKEND": "reference"}


def run(path: str, adapters: list[str], batch: list[tuple[list[int], str | None]], eager: bool, reference: bool,
        dtype: str, gdn: str | None = None) -> tuple[list[list[int]], float]:
    for k, v in REFERENCE.items():
        if reference:
            os.environ[k] = v
        else:
            os.environ.pop(k, None)
    if gdn:
        os.environ["XPULORA_GDN_BACKEND"] = gdn
    else:
        os.environ.pop("XPULORA_GDN_BACKEND", None)
    lora = LoRAConfig(enable_lora=True, max_loras=4, max_lora_rank=16,
                      lora_modules=tuple((f"a{i}", p) for i, p in enumerate(adapters)))
    cfg = EngineConfig(ModelConfig(path, dtype=dtype, max_model_len=512), cache=CacheConfig(num_blocks=2048),
                       scheduler=SchedulerConfig(max_num_seqs=64), lora=lora, enforce_eager=eager)
    with LLMEngine(cfg) as e:
        t0 = time.perf_counter()
        out = e.generate([p for p, _ in batch], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                         [n for _, n in batch])
        torch.cuda.synchronize()
        return [r.token_ids for r in out], time.perf_counter() - t0


def main() -> None:
    s = Shape(1024, 2048, 4, 8, 2, 128, 2048)
    path = write_random_int4("/tmp/gpu-check/model", s, device=torch.device("cuda"))
    adapters = [write_adapter(f"/tmp/gpu-check/lora{i}", s, s.layers, [4, 8, 16][i % 3], i) for i in range(6)]
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 17, 40):
        batch = [(torch.randint(0, 400, (8 + 5 * i,), generator=g).tolist(), None if i % 3 == 0 else f"a{i % 6}")
                 for i in range(n)]
        ref, _ = run(path, adapters, batch, eager=True, reference=True, dtype="float32")
        eager, _ = run(path, adapters, batch, eager=True, reference=False, dtype="float32")
        graphs, _ = run(path, adapters, batch, eager=False, reference=False, dtype="float32")
        print(json.dumps({"check": "gpu kernels and graphs vs torch reference, float32", "batch": n,
                          "eager_equal": eager == ref, "graphs_equal": graphs == ref,
                          "eager_matching_requests": sum(a == b for a, b in zip(eager, ref)),
                          "graph_matching_requests": sum(a == b for a, b in zip(graphs, ref))}), flush=True)
    hs = Shape(1024, 2048, 4, 8, 2, 128, 2048, hybrid=True, lin_k_heads=4, lin_v_heads=8, lin_dim=128)
    hpath = write_random_int4("/tmp/gpu-check/hybrid", hs, device=torch.device("cuda"))
    hadapters = [write_adapter(f"/tmp/gpu-check/hlora{i}", hs, hs.layers, [4, 8, 16][i % 3], i, only="mlp.")
                 for i in range(6)]
    for n in (3, 17):
        batch = [(torch.randint(0, 400, (8 + 5 * i,), generator=g).tolist(), None if i % 3 == 0 else f"a{i % 6}")
                 for i in range(n)]
        ref, _ = run(hpath, hadapters, batch, eager=True, reference=True, dtype="float32", gdn="reference")
        res = {(gdn, eager): run(hpath, hadapters, batch, eager=eager, reference=False, dtype="float32", gdn=gdn)[0]
               for gdn in ("reference", "fla") for eager in (True, False)}
        print(json.dumps({"check": "hybrid: gpu kernels and graphs vs eager, float32", "batch": n,
                          "refgdn_eager_equal_reference": res[("reference", True)] == ref,
                          "refgdn_graphs_equal_eager": res[("reference", False)] == res[("reference", True)],
                          "fla_graphs_equal_eager": res[("fla", False)] == res[("fla", True)],
                          "fla_matching_requests_vs_reference": sum(a == b for a, b in zip(res[("fla", True)], ref)),
                          "of": n}), flush=True)
    batch = [(torch.randint(0, 400, (16,), generator=g).tolist(), f"a{i % 4}") for i in range(32)]
    _, t_eager = run(path, adapters, batch, eager=True, reference=False, dtype="bfloat16")
    _, t_graph = run(path, adapters, batch, eager=False, reference=False, dtype="bfloat16")
    print(json.dumps({"bench": "32 requests x 16 tokens, 4 adapters, bf16", "eager_s": t_eager, "graphs_s": t_graph}))


if __name__ == "__main__":
    main()
