"""Shared fixtures: tiny Qwen checkpoints built by transformers + auto-round, once per test run."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
MIXED_LAYERS = {"model.layers.0.mlp.down_proj": {"bits": 16}, "model.layers.1.self_attn.o_proj": {"bits": 16}}


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """model_factory(arch, quant, tie) -> folder; quant None (bf16) or an auto-round packing format
    ("auto_round", "auto_round:auto_gptq", "auto_round:gptqmodel"), with ":asym" for asymmetric and
    "+mixed" to keep two linears at 16 bits through extra_config, "+int8" for 8-bit."""
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
            int8 = quant.endswith("+int8")
            spec = quant.removesuffix("+int8")
            spec, mixed = spec.removesuffix("+mixed"), spec.endswith("+mixed")
            asym = spec.endswith(":asym")
            fmt = spec.removesuffix(":asym")
            kind = ("asym" if asym else "sym") + ("-mixed" if mixed else "") + ("-int8" if int8 else "")
            name = f"{arch}-tie{int(tie)}-l{layers}-{fmt.replace(':', '_')}-{kind}"
            lc = MIXED_LAYERS if mixed else None
            cache[key] = quantize(cache[base_key], str(root / name), fmt=fmt, sym=not asym,  # type: ignore[arg-type]
                                  layer_config=lc, bits=8 if int8 else 4)
        return cache[key]

    return make
