"""End-to-end decode throughput on a Qwen3-8B-shaped random int4 checkpoint (AutoRound layout), with
0/1/8/32 distinct rank-16 adapters on all seven projections, against transformers + peft mixed-adapter
`generate` (bf16 dense model of the same shape, a faster peer than its int4 path) in the same run, and
against the bandwidth floor (bytes read per decode step / measured copy bandwidth). One JSON line per case.

    python benchmarks/bench_e2e.py --layers 36            # on a GPU
    python benchmarks/bench_e2e.py --quick                # tiny shapes on the CPU (smoke test)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import astuple

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import device_sync
from engine import (
    CacheConfig,
    EngineConfig,
    KernelConfig,
    LLMEngine,
    LoRAConfig,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
)
from engine.device import Device
from engine.layers.linear import LinearBase
from engine.layers.quant import Int4LinearMethod
from tools.random_int4 import QWEN3_8B, QWEN36_27B, Shape, write_random_int4

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def emit(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def int4_dispatch(model: torch.nn.Module) -> dict[str, str]:
    """Each int4 layer shape's kernels, "up to rows: backend (launch shape)" per bucket. Tuned tables differ between
    machines (timing noise picks among near-equal candidates), so a run's figures go with its table."""
    out: dict[str, str] = {}
    for mod in model.modules():
        if isinstance(mod, LinearBase) and isinstance(mod.method, Int4LinearMethod):
            lay = mod.int4_layout
            out.setdefault(f"K{lay.in_features} N{lay.out_features}", ", ".join(
                f"{'any' if rows is None else rows}: {'dequant' if w is None else w.backend}"
                f"{'' if w is None or w.config is None else astuple(w.config)}"
                for rows, w in mod.int4_paths))
    return out


def module_shapes(s: Shape) -> dict[str, tuple[int, int]]:
    qd, kd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {"self_attn.q_proj": (s.hidden, qd), "self_attn.k_proj": (s.hidden, kd), "self_attn.v_proj": (s.hidden, kd),
            "self_attn.o_proj": (qd, s.hidden), "mlp.gate_proj": (s.hidden, s.intermediate),
            "mlp.up_proj": (s.hidden, s.intermediate), "mlp.down_proj": (s.intermediate, s.hidden)}


def write_adapter(path: str, s: Shape, layers: int, r: int, seed: int, only: str = "") -> str:
    """A PEFT-format adapter with random non-zero A and B on every projection (those starting with `only`)
    of every layer (a hybrid's text model keeps its layers under model.language_model)."""
    g = torch.Generator().manual_seed(seed)
    t = {}
    pre = "model.language_model" if s.hybrid else "model"
    for i in range(layers):
        for mod, (k, n) in module_shapes(s).items():
            if not mod.startswith(only):
                continue
            key = f"base_model.model.{pre}.layers.{i}.{mod}"
            t[f"{key}.lora_A.weight"] = (torch.randn(r, k, generator=g) / k**0.5).to(torch.bfloat16)
            t[f"{key}.lora_B.weight"] = (torch.randn(n, r, generator=g) * 0.01).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        targets = [m.split(".")[-1] for m in module_shapes(s) if m.startswith(only)]
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": targets,
                   "bias": "none", "task_type": "CAUSAL_LM"}, f)
    return path


def adapter_bytes(s: Shape, layers: int, r: int, dtype: torch.dtype) -> int:
    """Bytes of one adapter's A and B in the device slots stored as `dtype` (fp8: one byte per weight plus a
    float32 scale per rank row of A and per output row of B); what a decode step reads per distinct adapter."""
    el, fp8 = torch.empty(0, dtype=dtype).element_size(), dtype == torch.float8_e4m3fn
    per = 0
    for k, n in module_shapes(s).values():
        per += r * (k + n) * el + ((r + n) * 4 if fp8 else 0)
    return per * layers


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    n = 1 << 30 if device.type != "cpu" else 1 << 26
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    device_sync(device)()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    device_sync(device)()
    return 2 * n * 10 / (time.perf_counter() - t0)


def engine_config(path: str, adapters: list[str], max_batch: int, device: str, lora_dtype: str = "auto",
                  int4: str = "auto") -> EngineConfig:
    """One engine per adapter count serves every batch size (graphs are captured up to max_batch), with
    max_loras = the number of adapters, as a deployment for that many would set it."""
    lora = LoRAConfig(enable_lora=True, max_loras=len(adapters), max_lora_rank=16,
                      lora_modules=tuple((f"a{i}", p) for i, p in enumerate(adapters)),
                      lora_dtype=lora_dtype) if adapters else LoRAConfig()  # type: ignore[arg-type]
    return EngineConfig(ModelConfig(path, dtype="bfloat16" if device != "cpu" else "float32", max_model_len=512),
                        cache=CacheConfig(num_blocks=None if device == "cpu" else 8192),
                        scheduler=SchedulerConfig(max_num_seqs=max_batch), lora=lora,
                        kernels=KernelConfig(int4=int4))  # type: ignore[arg-type]


def requests(batch: int, n_adapters: int) -> tuple[list[list[int]], list[str | None]]:
    """32-token random prompts, and the adapter of each (a0..a{n-1} in turn; None without adapters)."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 400, (32,), generator=g).tolist() for _ in range(batch)]
    return prompts, [f"a{i % n_adapters}" if n_adapters else None for i in range(batch)]


def ours(e: LLMEngine, batch: int, n_adapters: int, new_tokens: int) -> dict:
    prompts, names = requests(batch, n_adapters)
    return time_decode(e, prompts, new_tokens, names)


def time_decode(e: LLMEngine, prompts: list[list[int]], new_tokens: int,
                names: list[str | None] | None = None, params: list[SamplingParams] | None = None
                ) -> dict[str, float]:
    """Warm up, prefill every prompt (in as many steps as the step budget needs), then time the decode steps until
    all finish; params[i] is request i's sampling (default: greedy, ignore_eos, new_tokens)."""
    names = names or [None] * len(prompts)
    e.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), names[:1])
    params = params or [SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)] * len(prompts)
    for i, (p, n, sp) in enumerate(zip(prompts, names, params)):
        e.add_request(str(i), p, sp, n)
    # Prefill every request before the clock: prompts beyond one step's budget (64 x 32 tokens at a budget of 512)
    # take several steps, and those, or a decode step joined by a prompt chunk, would count as decode.
    e.step()
    while e.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in e.scheduler.running):
        e.step()  # a prompt still has chunks to run
    e.device.synchronize()
    # Steps and rows launched inside the window (the engine's counters), not loop turns: with async scheduling
    # the first turn reads back the prefill's token, computed before the clock, and the last turn only reads.
    steps0, rows0, mixed0 = e.steps.steps, e.steps.sequences, e.steps.mixed
    t0 = time.perf_counter()
    while e.has_unfinished():
        e.step()
    e.device.synchronize()
    dt = time.perf_counter() - t0
    steps, rows = e.steps.steps - steps0, e.steps.sequences - rows0
    return {"steps": steps, "ms_per_step": 1e3 * dt / steps, "tokens_per_s": rows / dt,
            "mixed_steps": e.steps.mixed - mixed0}


def synchronous(e: LLMEngine, run: Callable[[], dict]) -> dict:
    """run() with the engine's async scheduling off (between runs nothing is in flight, so it may switch)."""
    saved, e.async_scheduling = e.async_scheduling, False
    try:
        return run()
    finally:
        e.async_scheduling = saved


def peer(s: Shape, layers: int, adapters: list[str], batch: int, n_adapters: int, new_tokens: int,
         device: torch.device) -> dict:
    """transformers + peft, bf16 dense, mixed adapters in one batch via adapter_names."""
    from peft import PeftModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_hidden_layers=layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      head_dim=s.head_dim, max_position_embeddings=512)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16 if device.type != "cpu" else torch.float32).eval()
    if n_adapters:
        model = PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
        for i in range(1, n_adapters):
            model.load_adapter(adapters[i], adapter_name=f"a{i}")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 400, (batch, 32), generator=g).to(device)
    kw = {"adapter_names": [f"a{i % n_adapters}" for i in range(batch)]} if n_adapters else {}
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=2, do_sample=False, **({"adapter_names": ["a0"]} if n_adapters else {}))
        device_sync(device)()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw)
        device_sync(device)()
    dt = time.perf_counter() - t0
    del model
    release(device)
    return {"peer_tokens_per_s": batch * new_tokens / dt}


def release(device: torch.device | str) -> None:
    """Give the device memory of a closed engine (or the peer's model) back before the next one loads: an engine
    sizes its KV cache from the free memory. The caller first drops its last reference (`del e` after the `with`:
    the name would hold the engine until rebound, which happens only once the next engine is built; on an 80 GB
    card the fp8 engine after a bf16 one ran out of memory so, nineteenth session)."""
    gc.collect()
    dev = torch.device(device)
    Device(dev.type, dev.index or 0).empty_cache()  # type: ignore[arg-type]


def model_args(ap: argparse.ArgumentParser, batches: list[int], adapters: list[int], root: str) -> None:
    """The options every end-to-end script shares (this one and profile_step.py)."""
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--shape", choices=["8b", "27b"], default="8b",
                    help="Qwen3-8B-shaped dense or Qwen3.6-27B-shaped hybrid (every fourth layer full attention)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, CPU smoke test")
    ap.add_argument("--batches", type=int, nargs="*", default=batches)
    ap.add_argument("--adapters", type=int, nargs="*", default=adapters,
                    help="distinct rank-16 adapters on all seven projections")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--int4-kernel", default="auto", help="KernelConfig.int4 of our engines (auto, tuned, ...)")
    ap.add_argument("--root", default=root)
    ap.add_argument("--sync-too", action="store_true",
                    help="also time the engine with async scheduling off (same engine, side by side)")


def write_model(a: argparse.Namespace) -> tuple[torch.device, Shape, int, str, list[str]]:
    """(device, shape, layers, checkpoint path, adapter paths) for model_args' options; --quick shrinks
    everything to a CPU smoke run."""
    device = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    big = QWEN36_27B if a.shape == "27b" else QWEN3_8B
    s = Shape(256, 768, 2, 4, 2, 64, 1024, hybrid=big.hybrid) if a.quick else big
    layers = (4 if big.hybrid else 2) if a.quick else a.layers
    if a.quick:
        a.batches, a.adapters, a.new_tokens = [1, 4], [0] if big.hybrid else [0, 2], 4
    if big.hybrid and max(a.adapters) > 0:  # write_adapter targets the dense model's attention modules
        raise SystemExit("--shape 27b runs without adapters (--adapters 0)")
    path = write_random_int4(f"{a.root}/model", s, layers=layers, device=device)
    adapters = [write_adapter(f"{a.root}/lora{i}", s, layers, 16, i) for i in range(max(a.adapters))]
    return device, s, layers, path, adapters


def main() -> None:
    ap = argparse.ArgumentParser()
    model_args(ap, [1, 8, 32, 64], [0, 1, 8, 32], "/tmp/xpulora-e2e")
    ap.add_argument("--peer-cases", default="32:8,32:32,1:0", help="batch:adapters pairs run with the peer too")
    ap.add_argument("--lora-dtypes", nargs="+", default=["auto"], choices=["auto", "bfloat16", "float16", "fp8"],
                    help="adapter storage (--lora-dtype) of the cases with adapters, each its own engine")
    a = ap.parse_args()
    device, s, layers, path, adapters = write_model(a)
    if a.quick:
        a.peer_cases = "4:2"
    bw = copy_bandwidth(device)
    weight_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    emb_bytes = s.vocab * s.hidden * 2  # the embedding is looked up, not read whole
    peer_cases = {tuple(int(x) for x in c.split(":")) for c in a.peer_cases.split(",") if c}
    floor_ms = 1e3 * (weight_bytes - emb_bytes) / bw
    cases = [(b, n) for b in a.batches for n in a.adapters if n <= b]
    emit(case="plan", cases=cases)  # a run cut short by a time limit lacks some of these rows
    base_ms: dict[int, float] = {}  # batch -> ms per step without adapters (measured first)
    for n, ld in [(m, ld) for m in sorted({m for _, m in cases}) for ld in (a.lora_dtypes if m else ["auto"])]:
        rows = []
        cfg = engine_config(path, adapters[:n], max(b for b, m in cases if m == n), device.type, ld, a.int4_kernel)
        with LLMEngine(cfg) as e:
            emit(case="int4_dispatch", adapters=n, lora_dtype=ld, tables=int4_dispatch(e.runner.model))
            for b in [b for b, m in cases if m == n]:
                r = ours(e, b, n, a.new_tokens)
                row = {"case": "decode", "batch": b, "adapters": n, "layers": layers, **r,
                       "async_scheduling": e.async_scheduling, "int4": a.int4_kernel, "floor_ms_per_step": floor_ms,
                       "vs_floor": r["ms_per_step"] / floor_ms}
                if a.sync_too:
                    sync = synchronous(e, lambda b=b, n=n, e=e: ours(e, b, n, a.new_tokens))
                    row["sync_ms_per_step"] = sync["ms_per_step"]
                if n == 0:
                    base_ms[b] = r["ms_per_step"]
                else:  # what the adapters add to a step against what reading their bytes once takes
                    byte_ms = 1e3 * min(n, b) * adapter_bytes(s, layers, 16, e.runner.lora_dtype) / bw
                    row.update(lora_dtype=ld, adapter_byte_ms=byte_ms)
                    if b in base_ms:
                        added = r["ms_per_step"] - base_ms[b]
                        row.update(lora_added_ms=added, added_over_bytes=added / byte_ms)
                rows.append(row)
        del e
        release(device)
        for row in rows:  # the peer runs after our engine has freed the device
            b = row["batch"]
            if (b, n) in peer_cases and row.get("lora_dtype", "auto") == a.lora_dtypes[0]:
                row.update(peer(s, layers, adapters[:n], b, n, min(a.new_tokens, 32), device))
                row["speedup_vs_peer"] = row["tokens_per_s"] / row["peer_tokens_per_s"]
            emit(**row)
    emit(case="copy_bandwidth", bytes_per_s=bw, device=str(device))


if __name__ == "__main__":
    main()
