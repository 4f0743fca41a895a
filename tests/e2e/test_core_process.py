"""The two-process server (API process + engine-core process) for real: a real `python -m server` on the
demo model, the real openai client. Either process dying takes the other down (no orphans, by pid), and
64 concurrent streams over 4 adapters, while other adapters are loaded and unloaded over HTTP, give
exactly the offline engine's greedy texts."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import httpx
import openai
import psutil

from engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from server.cli import demo_config
from tools.loadgen import demo_prompt
from tools.serverlib import API_KEY, ServerProcess

DEMO = Path(__file__).resolve().parents[2] / "demo"


def _core_tree(srv: ServerProcess) -> tuple[psutil.Process, list[psutil.Process]]:
    """The engine-core process (a spawned child of the server) and its tensor-parallel ranks."""
    kids = [p for p in psutil.Process(srv.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(kids) == 1, [p.cmdline() for p in kids]
    core = kids[0]
    return core, core.children(recursive=True)


def _maps_torch(pid: int) -> bool:
    """Whether the process has torch's shared library mapped (importing torch loads it; nothing unloads it)."""
    return any("libtorch" in Path(m.path).name for m in psutil.Process(pid).memory_maps(grouped=True))


def _start(tmp_path: Path, *flags: str) -> ServerProcess:
    srv = ServerProcess(None, ["--dtype", "float32", *flags], tmp_path / "server.log")
    srv.wait_ready()
    return srv


def test_engine_core_killed_makes_the_api_process_exit(tmp_path: Path) -> None:
    srv = _start(tmp_path)
    try:
        core, _ = _core_tree(srv)
        core.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        code = srv.proc.wait(timeout=10)
        elapsed = time.monotonic() - t0
        assert code != 0, srv.log_tail()
        assert elapsed < 1.0, f"the API process took {elapsed:.2f}s to exit"
        print(f"API process exited {elapsed:.2f}s after the core was killed")
        assert "engine-core process" in srv.log_tail()
    finally:
        srv.stop()


def test_api_process_killed_takes_the_core_and_tp_ranks_down(tmp_path: Path) -> None:
    srv = _start(tmp_path, "--tensor-parallel-size", "2")
    core, ranks = _core_tree(srv)
    assert len(ranks) >= 1  # rank 1 (and multiprocessing's resource tracker)
    tree = [core, *ranks]
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait(timeout=10)
    t0 = time.monotonic()
    gone, alive = psutil.wait_procs(tree, timeout=15)
    elapsed = time.monotonic() - t0
    for p in alive:
        p.kill()
    assert not alive, f"orphans left: {[p.pid for p in alive]}"
    assert elapsed < 3.0, f"the engine core and its ranks took {elapsed:.2f}s to exit"


def test_64_streams_over_4_adapters_during_churn_equal_offline(tmp_path: Path) -> None:
    rng = random.Random(7)
    models = ["reverse", "upper", "sort", "rev2"]
    plan = [(models[i % 4], demo_prompt(rng), 8 + i % 9) for i in range(64)]
    cfg = demo_config(EngineConfig(ModelConfig(str(DEMO / "model"), dtype="float32")))
    with LLMEngine(cfg) as llm:
        llm.load_lora_adapter("rev2", str(DEMO / "adapters" / "reverse"))
        want = [r.text for r in llm.generate([p for _, p, _ in plan],
                                             [SamplingParams(max_tokens=n, temperature=0.0) for *_, n in plan],
                                             [m for m, _, _ in plan])]
    srv = _start(tmp_path, "--max-loras", "4")
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        r = httpx.post(srv.url + "/v1/load_lora_adapter", headers=headers,
                       json={"lora_name": "rev2", "lora_path": "reverse"})
        assert r.status_code == 200, r.text

        async def stream(client: openai.AsyncOpenAI, model: str, prompt: str, n: int) -> str:
            text = ""
            async for ev in await client.completions.create(model=model, prompt=prompt, max_tokens=n,
                                                            temperature=0.0, stream=True):
                text += ev.choices[0].text if ev.choices else ""
            return text

        async def churn(stop: asyncio.Event) -> int:
            cycles = 0
            async with httpx.AsyncClient(base_url=srv.url, headers=headers, timeout=60) as c:
                while not stop.is_set():
                    name = f"churn{cycles % 3}"
                    r = await c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "sort"})
                    assert r.status_code == 200, r.text
                    r = await c.post("/v1/unload_lora_adapter", json={"lora_name": name})
                    assert r.status_code == 200, r.text
                    cycles += 1
            return cycles

        async def main() -> tuple[list[str], int]:
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300,
                                        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=80)))
            stop = asyncio.Event()
            churner = asyncio.create_task(churn(stop))
            got = await asyncio.gather(*(stream(client, m, p, n) for m, p, n in plan))
            stop.set()
            return got, await churner

        got, cycles = asyncio.run(main())
        assert cycles >= 1
        assert got == want
        # DESIGN.md §3: the API process (HTTP, tokenizing, detokenizing, adapter calls) never loads torch or
        # the model code; the engine core does.
        core, _ = _core_tree(srv)
        assert _maps_torch(core.pid)
        assert not _maps_torch(srv.proc.pid), "the API process loaded torch"
    finally:
        srv.stop()


def test_sigterm_exits_cleanly_and_leaks_no_semaphore(tmp_path: Path) -> None:
    """A drained SIGTERM: exit 0, and the multiprocessing resource tracker finds nothing left behind (tqdm's
    default lock in the engine core, which ends with os._exit, used to leave a named semaphore)."""
    srv = _start(tmp_path)
    try:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        base = httpx.get(srv.url + "/v1/models", headers=auth, timeout=10).json()["data"][0]["id"]
        r = httpx.post(srv.url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": base, "prompt": "abc", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        code = srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert code == 0, log[-2000:]
    assert "leaked" not in log, log[-2000:]
