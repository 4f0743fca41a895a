"""What each process of a running server costs: resident memory of the API process and of the engine core, and
whether each has torch loaded, after a few requests (base model, and an adapter when the model has one), plus
the seconds from `python -m server` to /health answering.

    python benchmarks/api_footprint.py                         # the demo model and its adapters
    python benchmarks/api_footprint.py --model DIR --runs 3    # any model folder; 3 starts (one line each)

DESIGN.md §3: the API process (HTTP, tokenizing, detokenizing, SSE) imports neither torch nor the model code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.serverlib import ServerProcess


def _torch_loaded(p: psutil.Process) -> bool:
    return any("libtorch" in Path(m.path).name for m in p.memory_maps(grouped=True))


def one_start(model: str | None, log: Path) -> dict[str, object]:
    t0 = time.monotonic()
    srv = ServerProcess(model, ["--dtype", "float32"], log)
    try:
        srv.wait_ready(600)
        ready_s = time.monotonic() - t0
        models = httpx.get(srv.url + "/v1/models", headers=srv.headers, timeout=30).json()["data"]
        for m in models[:2]:  # the base model, and its first adapter if it has one
            r = httpx.post(srv.url + "/v1/completions", headers=srv.headers, timeout=120,
                           json={"model": m["id"], "prompt": "words: cat dog =>", "max_tokens": 8, "stream": True})
            r.raise_for_status()
        api = psutil.Process(srv.proc.pid)
        core = next(p for p in api.children() if "spawn_main" in " ".join(p.cmdline()))
        return {"ready_s": round(ready_s, 2), "api_rss_mb": round(api.memory_info().rss / 2**20, 1),
                "api_torch": _torch_loaded(api), "core_rss_mb": round(core.memory_info().rss / 2**20, 1),
                "core_torch": _torch_loaded(core)}
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the demo model and adapters)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--root", default="/tmp/xpulora-api-footprint", help="where the server logs go")
    a = ap.parse_args()
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(a.runs):
        print(json.dumps({"start": i, **one_start(a.model, root / f"server{i}.log")}), flush=True)


if __name__ == "__main__":
    main()
