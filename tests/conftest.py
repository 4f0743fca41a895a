"""Shared fixtures: tiny Qwen checkpoints built by transformers + auto-round, once per test run."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """model_factory(arch, quant, tie) -> folder; quant None (bf16) or an auto-round packing format
    ("auto_round", "auto_round:auto_gptq", "auto_round:gptqmodel", with ":asym" to make it asymmetric)."""
    cache: dict[tuple, str] = {}
    root = tmp_path_factory.mktemp("models")

    def make(arch: str = "qwen3", quant: str | None = None, tie: bool = False, layers: int = 2) -> str:
        from tools.tinymodels import make_model, quantize

        key = (arch, quant, tie, layers)
        if key in cache:
            return cache[key]
        base_key = (arch, None, tie, layers)
        if base_key not in cache:
            cache[base_key] = make_model(str(root / f"{arch}-tie{int(tie)}-l{layers}-bf16"), arch, tie=tie,
                                         layers=layers)
        if quant is not None:
            asym = quant.endswith(":asym")
            fmt = quant.removesuffix(":asym")
            name = f"{arch}-tie{int(tie)}-l{layers}-{fmt.replace(':', '_')}-{'asym' if asym else 'sym'}"
            cache[key] = quantize(cache[base_key], str(root / name), fmt=fmt, sym=not asym)  # type: ignore[arg-type]
        return cache[key]

    return make
