"""Checkpoint loading: formats we refuse, broken folders, and what still loads."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import CheckpointError, SamplingParams
from engine.layers.quant import QuantConfigError
from tests.helpers import make_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def int4_path(model_factory) -> str:
    return model_factory("qwen3", "auto_round", True)


@pytest.fixture(scope="module")
def reference_ids(int4_path: str) -> list[int]:
    return make_engine(int4_path).generate(["hello world engine"], GREEDY)[0].token_ids


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, fn) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, fn) -> None:
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda q: q.update(packing_format="auto_round:auto_awq"), "packing_format 'auto_round:auto_awq' is not supported"),
    (lambda q: q.update(quant_method="fp8"), "quantization method 'fp8' is not supported"),
    (lambda q: q.update(quant_method="gptq"), "quantization method 'gptq' is not supported"),
    (lambda q: q.update(data_type="mx_fp", bits=4), "data_type='mx_fp' is not supported"),
    (lambda q: q.update(bits=3), "bits=3"),
    (lambda q: q.update(act_bits=8), "activation quantization"),
])
def test_unsupported_quantization_is_refused(int4_path: str, tmp_path: Path, edit, needle: str) -> None:
    p = _copy(int4_path, tmp_path / "m")
    _edit_config(p, lambda c: edit(c["quantization_config"]))
    with pytest.raises(QuantConfigError, match=r"not supported|bits=3") as e:
        make_engine(str(p))
    assert needle in str(e.value)
    if "packing_format" in needle:
        assert "auto_round:auto_gptq" in str(e.value)  # says what is supported


def test_missing_tensor_names_the_parameter(int4_path: str, tmp_path: Path) -> None:
    p = _copy(int4_path, tmp_path / "m")
    _edit_tensors(p, lambda t: t.pop("model.layers.1.mlp.up_proj.scales"))
    with pytest.raises(CheckpointError, match=r"lacks tensors.*model\.layers\.1\.mlp\.gate_up_proj\.scales"):
        make_engine(str(p))


def test_leftover_tensor_is_an_error(int4_path: str, tmp_path: Path) -> None:
    p = _copy(int4_path, tmp_path / "m")
    _edit_tensors(p, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(4)}))
    with pytest.raises(CheckpointError, match=r"safetensors: tensor 'model\.layers\.0\.mystery\.weight' is not used"):
        make_engine(str(p))


def test_wrong_shape_names_file_and_tensor(int4_path: str, tmp_path: Path) -> None:
    p = _copy(int4_path, tmp_path / "m")
    _edit_tensors(p, lambda t: t.update({"model.layers.0.self_attn.o_proj.scales": torch.zeros(3, 256).half()}))
    with pytest.raises(CheckpointError, match=r"safetensors: tensor 'model\.layers\.0\.self_attn\.o_proj\.scales'"):
        make_engine(str(p))


def test_truncated_shard_names_the_file(int4_path: str, tmp_path: Path) -> None:
    p = _copy(int4_path, tmp_path / "m")
    f = p / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        make_engine(str(p))


def test_sharded_checkpoint_loads_and_missing_shard_is_named(int4_path: str, tmp_path: Path,
                                                             reference_ids: list[int]) -> None:
    p = _copy(int4_path, tmp_path / "m")
    tensors = load_file(str(p / "model.safetensors"))
    os.remove(p / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fn, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(p / fn), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, fn))
    (p / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert make_engine(str(p)).generate(["hello world engine"], GREEDY)[0].token_ids == reference_ids
    os.remove(p / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors"):
        make_engine(str(p))


def test_vision_and_mtp_tensors_are_skipped_with_one_log_line(int4_path: str, tmp_path: Path, caplog,
                                                              reference_ids: list[int]) -> None:
    p = _copy(int4_path, tmp_path / "m")
    _edit_tensors(p, lambda t: t.update({"model.visual.blocks.0.attn.qkv.weight": torch.zeros(8, 8),
                                         "mtp.layers.0.norm.weight": torch.zeros(8)}))
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        engine = make_engine(str(p))
    assert [r.message for r in caplog.records if "skipped" in r.message] == [
        "skipped 2 tensors not used for text generation (vision tower / MTP)"]
    assert engine.generate(["hello world engine"], GREEDY)[0].token_ids == reference_ids


def test_rope_theta_and_rope_parameters_are_equivalent(int4_path: str, tmp_path: Path,
                                                       reference_ids: list[int]) -> None:
    p = _copy(int4_path, tmp_path / "m")

    def classic(c: dict) -> None:
        c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
        c["rope_scaling"] = None

    _edit_config(p, classic)
    assert make_engine(str(p)).generate(["hello world engine"], GREEDY)[0].token_ids == reference_ids
    _edit_config(p, lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        make_engine(str(p))


def test_pickled_weights_are_refused(int4_path: str, tmp_path: Path) -> None:
    p = _copy(int4_path, tmp_path / "m")
    os.remove(p / "model.safetensors")
    (p / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="safetensors only"):
        make_engine(str(p))


def test_unsupported_architecture(int4_path: str, tmp_path: Path) -> None:
    p = _copy(int4_path, tmp_path / "m")
    _edit_config(p, lambda c: c.update(model_type="llama"))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        make_engine(str(p))


def test_act_order_g_idx_is_refused(model_factory, tmp_path: Path) -> None:
    p = _copy(model_factory("qwen3", "auto_round:gptqmodel:asym", False), tmp_path / "m")

    def shuffle(t: dict) -> None:
        g = t["model.layers.0.mlp.down_proj.g_idx"]
        t["model.layers.0.mlp.down_proj.g_idx"] = g.flip(0).contiguous()

    _edit_tensors(p, shuffle)
    with pytest.raises(CheckpointError, match="act-order"):
        make_engine(str(p))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_unquantized_fp16_and_fp32_checkpoints(tmp_path: Path, dtype: torch.dtype) -> None:
    from tests.oracle import hf_greedy
    from tools.tinymodels import load_transformers_fp32, make_model

    path = make_model(str(tmp_path / "m"), "qwen3", dtype=dtype, seed=3)
    engine = make_engine(path)
    hf = load_transformers_fp32(path)
    for r in engine.generate(["hello world engine", "the quick brown fox"], GREEDY):
        assert r.token_ids == hf_greedy(hf, r.prompt_token_ids, GREEDY.max_tokens)
