"""Every parallel layer on 2 gloo processes equals the single-process layer (fp32 and int4, with and
without LoRA, both LoRA modes, mixed slots and ranks), and the seed's unconditional gather breaks it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from engine.lora.layers import shrink_needs_gather
from tests.layers import tp_worker
from tools.serverlib import free_port

CASES = [(k, q, m) for k in tp_worker.KINDS for q in (False, True) for m in (None, "default", "full")]


def _spawn(tmp: Path, cases, buggy: bool) -> list[dict]:
    out = tmp / ("buggy" if buggy else "ok")
    mp.start_processes(tp_worker.run, args=(2, f"tcp://127.0.0.1:{free_port()}", str(out), cases, buggy), nprocs=2,
                       join=True, start_method="spawn")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def test_gather_rule() -> None:
    assert shrink_needs_gather(True, 2) and shrink_needs_gather(True, 4)
    assert not shrink_needs_gather(False, 2) and not shrink_needs_gather(False, 1) and not shrink_needs_gather(True, 1)


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> list[dict]:
    return _spawn(tmp_path_factory.mktemp("tp"), CASES, buggy=False)


@pytest.mark.parametrize(("kind", "quant", "mode"), CASES)
def test_tp2_layer_equals_tp1(tp_results: list[dict], kind: str, quant: bool, mode: str | None) -> None:
    key = f"{kind}-{'int4' if quant else 'fp32'}-{mode}"
    for rank, res in enumerate(tp_results):
        assert "fatal" not in res, res["fatal"]
        diff = res[key]
        assert isinstance(diff, float), f"rank {rank}: {diff}"
        assert diff < 1e-4, f"rank {rank}: max diff {diff}"


def test_vocab_parallel_embedding_and_padded_lm_head(tp_results: list[dict]) -> None:
    assert all(res["vocab"] < 1e-5 for res in tp_results)


def test_unconditional_gather_breaks_default_mode(tmp_path: Path) -> None:
    """Seed bug 2: gathering the default-mode shrink output inflates the rank dim to r_max * tp, which
    the expand must refuse (on XPU the seed saw `inputs.size(1) must match lora_b_weights.size(-1)`)."""
    cases = [("qkv", True, "default"), ("gate_up", False, "default")]
    res = _spawn(tmp_path, cases, buggy=True)[0]
    for key in ("qkv-int4-default", "gate_up-fp32-default"):
        assert "does not match LoRA B" in str(res[key]), f"{key}: the buggy gather went unnoticed ({res[key]})"
