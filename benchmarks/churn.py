"""Adapter churn: load/unload cycles (the same name reloaded with other weights, and always-new names)
while background requests run, against the CPU demo server (loopback only, bounded in cycles and time).

Every cycle: load -> one request on the adapter, which must give the output of the weights just loaded
(never those of the name's previous load) -> on every 10th cycle a long streamed request on it that is
still running when the adapter is unloaded and must finish with the old weights -> unload -> a request on
the name, which must be 404. Background tasks meanwhile send requests to stable adapters and the base;
every one must succeed with its sequential output. The server's resident memory (RSS, from /proc through
psutil) and open file descriptors are sampled after a warm-up, along the way and at the end: they must
come back to the warm level (a leak check; on the CPU there is no separate device memory, and adapter
slots are allocated once at start, so a load cannot grow device memory).

    PYTHONPATH=. .venv/bin/python benchmarks/churn.py --cycles 1000 --json out/churn.json

Exit status 0 only if nothing failed and RSS came back within --rss-tolerance-mib of its warm level.
tests/e2e/test_reliability.py runs a bounded version (100 cycles).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tools.churn import run_churn
from tools.loadgen import start_demo_server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--background", type=int, default=2, help="concurrent background request loops")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one cycle may take")
    ap.add_argument("--rss-tolerance-mib", type=float, default=32.0)
    ap.add_argument("--json", help="write the report here too")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="xpulora-churn-"))
    srv = None
    try:
        srv, paths = start_demo_server(tmp, 6, 4)
        rep = run_churn(srv.url, srv.headers, paths, srv.proc.pid, a.cycles, a.background, a.timeout)
        out: dict[str, Any] = asdict(rep) | {"passed": rep.passed(a.rss_tolerance_mib),
                                              "rss_tolerance_mib": a.rss_tolerance_mib}
        print(json.dumps(out, indent=1))
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
        return 0 if out["passed"] else 1
    finally:
        if srv is not None:
            with contextlib.suppress(Exception):
                srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
