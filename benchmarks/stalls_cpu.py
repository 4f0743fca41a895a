"""Two one-off host stalls that a burst's TTFT can hit, measured on this machine's CPU (issue 14):

    PYTHONPATH=. python benchmarks/stalls_cpu.py

- gc: a full garbage collection in an engine process on the demo model and in a process that imported the API
  server, before and after gc.freeze() (engine.gc_pauses.freeze_startup_heap), ms each;
- client: a fresh process's first round of 8 concurrent streamed HTTP requests against a local stub server,
  against its next rounds, then the rounds of a second client in the same process (new connections again, but
  httpx's lazy set-up done: what benchmarks/bench_serve.py now does before its clock).
One JSON line each.
"""

from __future__ import annotations

import asyncio
import gc
import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def full_gc_ms() -> float:
    t = time.perf_counter()
    gc.collect()
    return round(1e3 * (time.perf_counter() - t), 1)


def gc_case(what: str) -> dict:
    if what == "api":
        import server.app  # noqa: F401
    else:
        from benchmarks.bench_e2e import engine_config
        from engine import LLMEngine

        engine = LLMEngine(engine_config(str(REPO / "demo" / "model"), [], 8, "cpu"))
    objects = len(gc.get_objects())
    before = [full_gc_ms() for _ in range(3)]
    from engine.gc_pauses import freeze_startup_heap

    frozen = freeze_startup_heap()
    after = [full_gc_ms() for _ in range(3)]
    if what != "api":
        engine.shutdown()
    return {"stall": "gc", "process": what, "tracked_objects": objects, "full_gc_ms": before,
            "frozen": frozen, "full_gc_ms_after_freeze": after}


class _Stub(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and no Nagle delay, as uvicorn
    disable_nagle_algorithm = True
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = b"data: {}\n\n"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _StubServer(http.server.ThreadingHTTPServer):
    request_queue_size = 2048  # uvicorn's backlog; the stdlib's 5 drops simultaneous connects (1 s SYN retry)


def client_case() -> dict:
    import httpx

    srv = _StubServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    async def rounds() -> list[float]:
        out = []
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.server_address[1]}", timeout=60) as c:
            async def one() -> None:
                async with c.stream("POST", "/v1/completions", json={"prompt": "x"}) as r:
                    async for _ in r.aiter_lines():
                        pass
            for _ in range(4):
                t = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(8)))
                out.append(round(1e3 * (time.perf_counter() - t), 1))
        return out

    ms = asyncio.run(rounds())
    again = asyncio.run(rounds())  # a new client in the same process: new connections, nothing left to set up
    srv.shutdown()
    return {"stall": "client", "rounds_of_8_streams_ms": ms, "first_round_extra_ms": round(ms[0] - min(ms[1:]), 1),
            "second_client_rounds_ms": again}


def main() -> int:
    if len(sys.argv) > 1:  # one case in this (fresh) process
        case = sys.argv[1]
        print(json.dumps(client_case() if case == "client" else gc_case(case)), flush=True)
        return 0
    for case in ("engine", "api", "client", "client"):
        out = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, cwd=REPO,
                             env={"PYTHONPATH": str(REPO), **_env()})
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        print(lines[-1] if lines else json.dumps({"stall": case, "error": out.stderr[-500:]}), flush=True)
    return 0


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


if __name__ == "__main__":
    sys.exit(main())
