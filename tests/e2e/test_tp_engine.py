"""Whole-model tensor parallelism on 2 gloo processes: TP=2 equals TP=1 with LoRA in both modes, a
killed worker fails the engine quickly and leaves no process, and bad TP sizes fail at load."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from engine import SamplingParams
from engine.layers.linear import RowParallelLinear
from engine.layers.quant import Int4LinearMethod
from engine.worker import EngineDeadError
from tests.helpers import ALL7, as_tp_rank, make_lora_engine, prompts
from tools.tinymodels import make_peft_adapter

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(model_factory, tmp_path_factory) -> dict:
    bf16 = model_factory("qwen3", None, False)
    root = tmp_path_factory.mktemp("tp-adapters")
    adapters = {
        "r8": make_peft_adapter(bf16, str(root / "r8"), r=8, targets=["q_proj", "v_proj", "down_proj"], seed=1, b_std=0.1),
        "r16": make_peft_adapter(bf16, str(root / "r16"), r=16, targets=ALL7, seed=2, b_std=0.1),
        "r64": make_peft_adapter(bf16, str(root / "r64"), r=64, targets=ALL7, seed=3, b_std=0.05),
    }
    model = model_factory("qwen3", "auto_round", False)
    ps = prompts(6, seed=21)
    names: list[str | None] = [None, "r8", "r16", "r64", "r16", None]
    with make_lora_engine(model, adapters, num_blocks=64) as e1:
        ref = [r.token_ids for r in e1.generate(ps, GREEDY, names)]
        base = [r.token_ids for r in e1.generate(ps, GREEDY)]  # the same prompts without adapters
    return {"model": model, "adapters": adapters, "prompts": ps, "names": names, "ref": ref, "base": base}


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["default", "fully-sharded"])
def test_tp2_equals_tp1_with_adapters(setup: dict, fully_sharded: bool) -> None:
    with make_lora_engine(setup["model"], setup["adapters"], num_blocks=64, tp=2, fully_sharded=fully_sharded) as e2:
        out = [r.token_ids for r in e2.generate(setup["prompts"], GREEDY, setup["names"])]
    assert out == setup["ref"]
    # The adapters are not no-ops: each changes the base model's output on its own prompt.
    changed = [i for i, n in enumerate(setup["names"]) if n is not None and setup["ref"][i] != setup["base"][i]]
    assert changed == [i for i, n in enumerate(setup["names"]) if n is not None]


def test_killed_worker_fails_fast_and_leaves_no_process(setup: dict) -> None:
    engine = make_lora_engine(setup["model"], num_blocks=64, tp=2)
    procs = engine.executor.procs
    engine.generate(setup["prompts"][:1], GREEDY)
    for i, p in enumerate(setup["prompts"]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    engine.step()
    os.kill(procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineDeadError, match="exited with code"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 15
    finally:
        engine.shutdown()  # also when the checks fail, so later tests find no process group
    assert all(not p.is_alive() for p in procs)
    with pytest.raises(EngineDeadError):
        engine.step()


def test_row_parallel_int4_shard_must_fit_the_group_size() -> None:
    with as_tp_rank(0, 4), pytest.raises(
            ValueError, match=r"down_proj: 768 input features .* valid sizes for this layer: \[1, 2, 3, 6\]"):
        RowParallelLinear(768, 256, method=Int4LinearMethod(128, 1), prefix="model.layers.0.mlp.down_proj")
    assert torch.distributed.is_initialized() is False
