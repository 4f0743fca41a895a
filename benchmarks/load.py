"""Load generator: many concurrent streaming and non-streaming requests (completions and chat) over many
adapters, then the same requests one at a time; reports throughput, TTFT and latency percentiles, error
counts, lost and truncated responses, and every output that differs from its sequential run.

Bounded in count (--requests) and time (--timeout); loopback only. With no --url it starts the CPU demo
server itself (`python -m server` on the demo model) with --demo-adapters copies of the three demo
adapters (each with its own perturbed B, so every adapter's outputs differ) and --max-loras slots:

    PYTHONPATH=. .venv/bin/python benchmarks/load.py --requests 200 --concurrency 200 --demo-adapters 20 \\
        --max-loras 4 --json out/load.json

Against a running server (model names are the adapters to spread the load over, plus the base):

    PYTHONPATH=. .venv/bin/python benchmarks/load.py --url http://127.0.0.1:8000 --models reverse,upper,sort

Exit status 0 only if nothing failed: no error, nothing lost or truncated, every output equal to its
sequential run. tests/e2e/test_reliability.py runs a bounded version of the same (50 requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from tools.loadgen import build_plan, run_load, run_sequential, start_demo_server, summarize


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", help="a running server (loopback); default: start the CPU demo server")
    ap.add_argument("--api-key", default=None, help="Bearer key of --url")
    ap.add_argument("--models", help="comma-separated adapter names of --url")
    ap.add_argument("--base", default=None, help="the base model's name (default: the first of /v1/models)")
    ap.add_argument("--demo-adapters", type=int, default=20, help="adapters of the started demo server")
    ap.add_argument("--max-loras", type=int, default=4, help="device slots of the started demo server")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=200, help="requests in flight at once")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds each request (and each phase) may take")
    ap.add_argument("--no-sequential", action="store_true", help="skip the sequential reference run")
    ap.add_argument("--json", help="write the report here too")
    a = ap.parse_args(argv)

    srv, tmp = None, None
    try:
        if a.url:
            url, headers = a.url.rstrip("/"), ({"Authorization": f"Bearer {a.api_key}"} if a.api_key else {})
            models = a.models.split(",") if a.models else []
        else:
            tmp = Path(tempfile.mkdtemp(prefix="xpulora-load-"))
            t0 = time.perf_counter()
            srv, paths = start_demo_server(tmp, a.demo_adapters, a.max_loras)
            url, headers, models = srv.url, srv.headers, list(paths)
            print(f"demo server up in {time.perf_counter() - t0:.1f} s with {len(models)} adapters, "
                  f"--max-loras {a.max_loras}", flush=True)
        base = a.base or httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        specs = build_plan(a.requests, models or [base], base, a.seed, a.max_tokens)
        results, wall = asyncio.run(run_load(url, headers, specs, a.concurrency, a.timeout))
        refs = None if a.no_sequential else asyncio.run(run_sequential(url, headers, specs, a.timeout))
        rep = summarize(results, wall, refs)
        out = asdict(rep) | {"concurrency": a.concurrency, "max_tokens": a.max_tokens, "passed": rep.passed}
        if srv is not None:
            m = srv.metrics()
            out["server"] = {k: m.get(k) for k in ("xpulora:lora_slot_evictions_total", "xpulora:num_preemptions_total",
                                                    "xpulora:lora_adapters_loaded")}
        print(json.dumps(out, indent=1))
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
        return 0 if rep.passed else 1
    finally:
        if srv is not None:
            srv.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
