"""GPU check for tensor parallelism and the hybrid model (run on a 2-GPU machine):

1. TP=2 (NCCL) equals TP=1 on larger random int4 checkpoints in the AutoRound layout: a Qwen3-8B-shaped
   dense model and a Qwen3.6-27B-shaped hybrid (few layers), float32 (greedy ids and logits).
2. Decode tokens/s at batch 1 and 32, bf16, TP=1 and TP=2 for both shapes.
3. The cost of the collectives: all-reduce of [B, hidden] bf16 timed on NCCL, times the number per token.
One JSON line per result; exits 1 if an equality check fails (tools/checks.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import copy_bandwidth, time_decode
from engine import CacheConfig, EngineConfig, LLMEngine, ModelConfig, ParallelConfig, SamplingParams
from tools.checks import Checks, exit_with
from tools.random_int4 import QWEN3_8B, QWEN36_27B, write_random_int4

T0 = time.perf_counter()
CHECKS = Checks("gpu_tp_check")


def emit(**kw: object) -> None:
    print(json.dumps({**kw, "elapsed_s": round(time.perf_counter() - T0, 1)}), flush=True)


def engine(path: str, tp: int, dtype: str, max_num_seqs: int = 64, eager: bool = False,
           gdn: str = "auto", int4: str = "auto") -> LLMEngine:
    from engine import KernelConfig, SchedulerConfig

    return LLMEngine(EngineConfig(ModelConfig(path, dtype=dtype, max_model_len=1024),
                                  cache=CacheConfig(num_blocks=4096),
                                  parallel=ParallelConfig(tensor_parallel_size=tp),
                                  scheduler=SchedulerConfig(max_num_seqs=max_num_seqs), enforce_eager=eager,
                                  kernels=KernelConfig(gdn=gdn, int4=int4)))  # type: ignore[arg-type]


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 400), (length + i,), generator=g).tolist() for i in range(n)]


def equality(name: str, path: str) -> None:
    ps = prompts(8, 40, 400, 1)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    res = {}
    # fla-core computes in bf16 even for a float32 model: the comparison runs the float32 torch reference.
    for tp in (1, 2):  # (prompt_logits runs on rank 0 alone, so only generate is compared under TP)
        # Eager: capturing every graph size in float32 costs minutes of compilation; graphs are checked
        # against the reference separately (benchmarks/gpu_engine_check.py).
        with engine(path, tp, "float32", eager=True, gdn="reference") as e:
            res[tp] = [r.token_ids for r in e.generate(ps, greedy)]
    CHECKS.expect(f"{name} TP=2 vs TP=1 float32", res[1] == res[2],
                  prompts_equal=sum(a == b for a, b in zip(res[1], res[2])), of=len(ps),
                  elapsed_s=round(time.perf_counter() - T0, 1))


def decode_speed(name: str, path: str, tp: int, batches: list[int], floor_ms: float, int4: str) -> None:
    """floor_ms: one GPU's share of the weights (all but the embedding, split over tp) at its copy bandwidth."""
    with engine(path, tp, "bfloat16", max_num_seqs=max(batches), int4=int4) as e:
        emit(info=f"{name} engine ready", tp=tp, int4=int4)
        for batch in batches:
            r = time_decode(e, prompts(batch, 32, 400, 2), 64)
            emit(bench=f"{name} decode", tp=tp, batch=batch, **r, floor_ms_per_step=floor_ms / tp,
                 vs_floor=r["ms_per_step"] * tp / floor_ms)


def _allreduce_worker(rank: int, hidden: int, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    rows = []
    for b in (1, 8, 32, 64):
        x = torch.randn(b, hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        rows.append({"batch": b, "hidden": hidden, "us_per_allreduce": 1e6 * (time.perf_counter() - t0) / n})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def collectives(hidden: int, layers: int, name: str) -> None:
    import torch.multiprocessing as mp

    out = f"/tmp/ar-{hidden}.json"
    mp.start_processes(_allreduce_worker, args=(hidden, out), nprocs=2, start_method="spawn")
    with open(out) as f:
        rows = json.load(f)
    for r in rows:
        # Per token step: 2 all-reduces per layer (attention/mixer out + MLP down) + 1 for the vocab-parallel
        # embedding; the lm_head all-gather is of similar size per token and counted as one more.
        per_step = (2 * layers + 2) * r["us_per_allreduce"]
        emit(collective=f"{name} all-reduce [B, {hidden}] bf16", **r, allreduces_per_step=2 * layers + 2,
             us_per_decode_step_full_model=per_step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/xpulora-ckpt")
    ap.add_argument("--layers", type=int, default=4, help="layers of the checkpoints compared TP=2 vs TP=1")
    ap.add_argument("--speed-layers", type=int, default=0, help="layers for the decode speed (0: the full depth)")
    ap.add_argument("--speed-shapes", nargs="*", default=["27b", "8b"])
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--int4-kernel", default="auto", help="KernelConfig.int4 of the speed part's engines")
    ap.add_argument("--tp-sizes", type=int, nargs="+", default=[2, 1], help="tensor-parallel sizes of the speed part")
    a = ap.parse_args()
    dev = torch.device("cuda")
    dense = write_random_int4(f"{a.root}/qwen3-8b-shape", QWEN3_8B, layers=a.layers, device=dev)
    hybrid = write_random_int4(f"{a.root}/qwen36-27b-shape", QWEN36_27B, layers=a.layers, device=dev)
    emit(info="checkpoints", dense_layers=a.layers, hybrid_layers=a.layers, gpus=torch.cuda.device_count())
    if "collectives" not in a.skip:
        collectives(QWEN3_8B.hidden, QWEN3_8B.layers, "Qwen3-8B")
        collectives(QWEN36_27B.hidden, QWEN36_27B.layers, "Qwen3.6-27B")
    if "equal" not in a.skip:
        equality("Qwen3-8B-shaped int4", dense)
        equality("Qwen3.6-27B-shaped int4 hybrid", hybrid)
    if "speed" not in a.skip:
        for key in a.speed_shapes:
            shape, name = {"27b": (QWEN36_27B, "Qwen3.6-27B-shaped"), "8b": (QWEN3_8B, "Qwen3-8B-shaped")}[key]
            layers = a.speed_layers or shape.layers
            path = write_random_int4(f"{a.root}/{key}-{layers}", shape, layers=layers, device=dev)
            weights = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                          if f.endswith(".safetensors"))
            floor_ms = 1e3 * (weights - shape.vocab * shape.hidden * 2) / copy_bandwidth(dev)
            emit(info="checkpoint written", shape=name, layers=layers, weight_bytes=weights, floor_ms_tp1=floor_ms)
            for tp in a.tp_sizes:
                decode_speed(f"{name} ({layers} layers)", path, tp, [1, 32], floor_ms, a.int4_kernel)
            shutil.rmtree(path)
    if "equal" not in a.skip:
        exit_with(CHECKS)


if __name__ == "__main__":
    main()
