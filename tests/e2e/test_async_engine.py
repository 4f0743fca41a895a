"""The engine client and the app in-process (the core loop on a thread, same messages as the engine-core
process): cancel/close aborts and frees KV blocks, shutdown aborts what is in flight and stops the core,
a failed step makes /health 503, and autoload stays off with lora_autoload=False."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI

from engine import (
    EngineClient,
    EngineConfig,
    LLMEngine,
    LoRAConfig,
    ModelConfig,
    OverloadedError,
    SamplingParams,
    SchedulerConfig,
)
from server.app import create_app
from tools.tinymodels import make_peft_adapter

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_factory, tmp_path_factory) -> LLMEngine:
    root = tmp_path_factory.mktemp("async-root")
    make_peft_adapter(model_factory("qwen3", None, False), str(root / "auto"), r=8, targets=["q_proj"], seed=1)
    cfg = EngineConfig(ModelConfig(model_factory("qwen3", "auto_round", False), dtype="float32", max_model_len=512),
                       scheduler=SchedulerConfig(max_num_seqs=4),
                       lora=LoRAConfig(enable_lora=True, lora_roots=(str(root),), lora_autoload=False))
    return LLMEngine(cfg)


async def _until(cond, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_close_cancel_and_shutdown_abort(llm: LLMEngine) -> None:
    total = llm.blocks.num_blocks

    async def main() -> None:
        ae = EngineClient.in_thread(llm)
        await ae.start()
        gen = ae.generate("r1", "hello world", LONG)
        await gen.__anext__()
        assert llm.blocks.num_free < total
        await gen.aclose()  # the consumer stops reading: aborted, blocks freed
        await _until(lambda: llm.blocks.num_free == total and not llm.requests)

        async def consume() -> None:
            async for _ in ae.generate("r2", "the quick brown fox", LONG):
                pass

        task = asyncio.create_task(consume())
        await _until(lambda: "r2" in llm.requests and llm.blocks.num_free < total)
        task.cancel()  # a disconnected client's handler is cancelled
        await asyncio.gather(task, return_exceptions=True)
        await _until(lambda: llm.blocks.num_free == total and not llm.requests)

        stream = await ae.add_request("r3", "hello", LONG)
        await stream.__anext__()
        shutdown = asyncio.create_task(ae.shutdown(grace_s=0.0))
        outs = [o async for o in stream]
        await shutdown
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert not ae.healthy and llm.blocks.num_free == total and not llm.requests
        with pytest.raises(OverloadedError, match="shutting down"):
            await ae.add_request("r4", "hello", LONG)

    asyncio.run(main())


@asynccontextmanager
async def _app(llm: LLMEngine) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    app = create_app(llm.config, engine=llm)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://a") as client:
        yield app, client


def test_no_autoload_when_disabled(llm: LLMEngine) -> None:
    async def main() -> None:
        async with _app(llm) as (_, client):
            body = {"model": "auto", "prompt": "hello", "max_tokens": 2}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 404 and "'auto' does not exist" in r.json()["error"]["message"]
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": "auto", "lora_path": "auto"})
            assert r.status_code == 200, r.text  # relative to the lora root
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "auto"})).status_code == 200

    asyncio.run(main())


def test_engine_failure_makes_health_503(llm: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        async with _app(llm) as (app, client):
            base = llm.served_model_name
            body = {"model": base, "prompt": "hello", "max_tokens": 2}
            assert (await client.get("/health")).status_code == 200
            assert (await client.post("/v1/completions", json=body)).status_code == 200

            def boom() -> list:
                raise RuntimeError("device lost")

            monkeypatch.setattr(llm, "core_step", boom)
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
            r = await client.get("/health")
            assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
            assert (await client.post("/v1/completions", json=body)).status_code == 503
            assert f'xpulora:engine_healthy{{model_name="{base}"}} 0.0' in (await client.get("/metrics")).text
        monkeypatch.undo()
        for rid in list(llm.requests):  # leave the shared engine clean
            llm.abort(rid)

    asyncio.run(main())


def test_metrics_registry_is_private(llm: LLMEngine) -> None:
    from prometheus_client import REGISTRY

    from server.metrics import Metrics

    async def main() -> None:
        clients = [EngineClient.in_thread(llm), EngineClient.in_thread(llm)]
        for c in clients:
            await c.start()
        a, b = Metrics(clients[0]), Metrics(clients[1])  # two in one process: no duplicate error
        assert b"xpulora:kv_cache_usage_perc" in a.render() and b"xpulora:lora_requests_info" in b.render()
        assert not any(n.startswith("xpulora:") for n in REGISTRY._names_to_collectors)
        for c in clients:
            await c.shutdown(0)

    asyncio.run(main())
