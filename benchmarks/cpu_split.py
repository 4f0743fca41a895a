"""Where the CPU goes when xpulora serves the bench_vs_vllm workload (tiny int4 Qwen3, four rank-8 adapters, 16
streams of 32 tokens): CPU microseconds per delivered token of each process of the server (the API process,
the engine core) and of this client, over --rounds rounds after two warm-up rounds. On a 2-core machine the
three share the cores, so their sum per token bounds the tokens/s any ratio against a peer can reach.

    python benchmarks/cpu_split.py adapters 20 [extra xpulora serve flags]
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_vs_vllm import build, plan, server_flags, start
from tools.loadgen import run_load


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    out = [pid]
    for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split():
        out += tree(int(c))
    return out


def main() -> None:
    case, rounds, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    root = Path(os.environ.get("XPULORA_BENCH_ROOT", "/tmp/bvv-main"))
    model, adapters = build(root)
    srv = start("xpulora", model, server_flags(adapters, 16) + extra, "", root / "cpu_split.log", 600, None)
    try:
        for r in range(2):
            asyncio.run(run_load(srv.url, srv.headers, plan(case, 16, 32, 100 + r), 16, 300))
        pids = tree(srv.proc.pid)
        names = {p: Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:60] for p in pids}
        c0, me0, t0, tok = {p: cpu_s(p) for p in pids}, time.process_time(), time.perf_counter(), 0
        for r in range(rounds):
            res, _ = asyncio.run(run_load(srv.url, srv.headers, plan(case, 16, 32, r), 16, 300))
            tok += sum(x.completion_tokens or 0 for x in res)
        dt = time.perf_counter() - t0
        per = {names[p]: round(1e6 * (cpu_s(p) - c0[p]) / tok, 1) for p in pids if cpu_s(p) > c0[p]}
        print(json.dumps({"case": case, "tokens_per_s": round(tok / dt, 1), "wall_s": round(dt, 2),
                          "cpu_us_per_token": per,
                          "client_us_per_token": round(1e6 * (time.process_time() - me0) / tok, 1)}), flush=True)
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
