"""Tensor parallelism through the server: API process -> engine-core process -> two TP ranks (gloo on the
CPU; the same code runs NCCL or xccl on GPUs). A concurrent mixed batch of base and adapter requests served at
TP=2 gets the offline TP=1 engine's greedy texts, with LoRA in both modes (A/B replicated, or fully sharded),
on a dense Qwen3 int4 checkpoint and on a Qwen3.5 hybrid int4 one (Gated DeltaNet + gated attention)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from engine import SamplingParams
from tests.helpers import ALL7, make_lora_engine, prompts
from tools.serverlib import API_KEY, ServerProcess
from tools.tinymodels import make_peft_adapter, make_qwen35_model, quantize

MAX_TOKENS = 8
HYBRID_TARGETS = ["q_proj", "v_proj", "o_proj", "in_proj_qkv", "out_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def cases(model_factory, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("tp-server")
    dense_bf16 = model_factory("qwen3", None, False)
    hybrid_bf16 = make_qwen35_model(str(root / "hybrid-bf16"), vision=True, seed=11)
    return {
        "dense": {"model": model_factory("qwen3", "auto_round", False), "adapters": {
            "r8": make_peft_adapter(dense_bf16, str(root / "r8"), r=8, targets=ALL7, seed=1, b_std=0.1),
            "r16": make_peft_adapter(dense_bf16, str(root / "r16"), r=16, targets=ALL7, seed=2, b_std=0.1)}},
        "hybrid": {"model": quantize(hybrid_bf16, str(root / "hybrid-int4")), "adapters": {
            "h8": make_peft_adapter(hybrid_bf16, str(root / "h8"), r=8, targets=HYBRID_TARGETS, seed=3, b_std=0.1)}},
    }


def _batch(adapters: list[str]) -> tuple[list[str], list[str | None]]:
    ps = prompts(6, seed=5, min_words=3, max_words=12)
    return ps, [None if i % 3 == 0 else adapters[i % len(adapters)] for i in range(len(ps))]


async def _serve(srv: ServerProcess, ps: list[str], names: list[str | None]) -> list[str]:
    client = AsyncOpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    base = (await client.models.list()).data[0].id
    outs = await asyncio.gather(*(client.completions.create(
        model=n or base, prompt=p, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        for p, n in zip(ps, names)))
    return [o.choices[0].text for o in outs]


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["default", "fully-sharded"])
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_tp2_server_equals_the_tp1_engine(cases: dict[str, dict], kind: str, fully_sharded: bool,
                                          tmp_path: Path) -> None:
    case = cases[kind]
    ps, names = _batch(sorted(case["adapters"]))
    flags = ["--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2", "--max-model-len", "256",
             "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
             "--lora-modules", *(f"{n}={p}" for n, p in case["adapters"].items())]
    srv = ServerProcess(case["model"], flags + (["--fully-sharded-loras"] if fully_sharded else []),
                        tmp_path / "server.log")
    try:
        with make_lora_engine(case["model"], case["adapters"], max_loras=2, max_lora_rank=16) as ref:
            sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            want = [r.text for r in ref.generate(ps, sp, names)]
            base = [r.text for r in ref.generate(ps, sp)]
        srv.wait_ready()
        assert asyncio.run(_serve(srv, ps, names)) == want
    finally:
        srv.stop()
    # The adapters matter: every adapter request differs from the same prompt on the base model.
    assert all(w != b for w, b, n in zip(want, base, names) if n is not None)
