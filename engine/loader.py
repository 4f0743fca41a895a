"""Checkpoint loading: config.json -> model, safetensors -> param.weight_loader(param, tensor, shard_id).

The loader only dispatches by name; each layer cuts its own shard. Every checkpoint tensor must be
used and every parameter filled, except the known extras (vision tower, MTP head), skipped with one
log line.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm
from transformers import GenerationConfig, PreTrainedTokenizerBase
from transformers.utils import GENERATION_CONFIG_NAME

from engine.device import Kernels
from engine.errors import CheckpointError
from engine.layers.linear import LinearBase
from engine.layers.quant import QuantConfig
from engine.models.qwen import QwenArgs, QwenForCausalLM
from engine.models.qwen3_5 import HYBRID_ARCHS, Qwen35Args, Qwen35ForCausalLM, text_config

log = logging.getLogger(__name__)
SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    hf_config: dict[str, Any]
    quant: QuantConfig
    files: tuple[str, ...]
    """safetensors files, absolute paths."""

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's fields (vocab, lengths, eos), wherever the export puts them."""
        return text_config(self.hf_config)


def thread_locked_progress() -> None:
    """tqdm's bars share a multiprocessing lock (a named semaphore) by default, which a process that ends with
    os._exit, as the engine core and the TP ranks do, leaves to the resource tracker ("1 leaked semaphore" at
    shutdown). Those processes write their bars from one process: a thread lock is enough."""
    tqdm.set_lock(threading.RLock())


def read_hf_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model folder)")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from e


def inspect_checkpoint(path: str) -> CheckpointInfo:
    if not os.path.isdir(path):
        raise CheckpointError(f"model path {path!r} is not a folder")
    hf = read_hf_config(path)
    quant = QuantConfig.from_hf(hf.get("quantization_config"))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(path, fn))]
        if missing:
            raise CheckpointError(f"{path}: shard(s) listed in model.safetensors.index.json are missing: "
                                  f"{', '.join(missing)}")
    else:
        files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
        if not files:
            if any(fn.endswith((".bin", ".pt", ".pth")) for fn in os.listdir(path)):
                raise CheckpointError(f"{path}: only pickled weights found; this engine loads safetensors only")
            raise CheckpointError(f"{path}: no *.safetensors files")
    return CheckpointInfo(path, hf, quant, tuple(os.path.join(path, fn) for fn in files))


def iter_tensors(files: tuple[str, ...]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file, name, tensor) for every tensor; a truncated or corrupt file fails naming the file."""
    for fn in files:
        try:
            with safe_open(fn, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    try:
                        t = f.get_tensor(name)
                    except (SafetensorError, RuntimeError, OSError) as e:
                        raise CheckpointError(f"{fn}: cannot read tensor {name!r} ({e}); is the file truncated?") from e
                    yield fn, name, t
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{fn}: not a readable safetensors file ({e}); is it truncated or corrupt?") from e


def is_hybrid(info: CheckpointInfo) -> bool:
    """A Qwen3.5-style model with Gated DeltaNet layers."""
    return info.hf_config.get("model_type") in HYBRID_ARCHS


def build_model(info: CheckpointInfo, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> nn.Module:
    """The model on `device`, each layer built with its op's implementation from `kernels`."""
    with torch.device(device):
        if is_hybrid(info):
            return Qwen35ForCausalLM(Qwen35Args.from_hf(info.hf_config), info.quant, kernels, dtype)
        return QwenForCausalLM(QwenArgs.from_hf(info.hf_config), info.quant, kernels, dtype)


def load_weights(model: nn.Module, info: CheckpointInfo, progress: bool = False) -> None:
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, str | int]] = model.packed_modules
    expected: dict[str, set[str | int | None]] = {}
    for name in params:
        parts = name.rsplit(".", 2)
        layer = parts[-2] if len(parts) >= 2 else ""
        expected[name] = {sid for ck, (fused, sid) in packed.items() if fused == layer} or {None}
    filled: dict[str, set[str | int | None]] = {n: set() for n in params}
    tied = bool(model.args.tie_word_embeddings)
    skipped = 0
    total = sum(_count(fn) for fn in info.files) if progress else None
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress)
    for fn, name, tensor in iter_tensors(info.files):
        bar.update(1)
        if name.startswith(SKIPPED_PREFIXES) or name.endswith(IGNORED_SUFFIXES):
            skipped += 1
            continue
        if tied and name == "lm_head.weight":
            continue  # some exporters write the tied head too
        if name.endswith(".g_idx"):
            _check_trivial_g_idx(fn, name, tensor, info.quant.group_size)
            continue
        target, shard = model.checkpoint_to_param(name), None
        module_path, _, leaf = target.rpartition(".")
        mod_parent, _, mod_name = module_path.rpartition(".")
        if mod_name in packed:
            fused, shard = packed[mod_name]
            target = f"{mod_parent}.{fused}.{leaf}"
        p = params.get(target)
        if p is None:
            raise CheckpointError(f"{fn}: tensor {name!r} is not used by the model ({type(model).__name__}); "
                                  "is this the right architecture or quantization config?")
        if shard in filled[target]:
            raise CheckpointError(f"{fn}: tensor {name!r} appears twice")
        try:
            p.weight_loader(p, tensor, shard) if shard is not None else p.weight_loader(p, tensor)
        except ValueError as e:
            raise CheckpointError(f"{fn}: tensor {name!r}: {e}") from e
        filled[target].add(shard)
    bar.close()
    missing = [n for n in params if filled[n] != expected[n]]
    if missing:
        raise CheckpointError(f"{info.path}: checkpoint lacks tensors for {len(missing)} parameter(s), e.g. "
                              f"{', '.join(missing[:5])}")
    if skipped:
        log.info("skipped %d tensors not used for text generation (vision tower / MTP)", skipped)
    for m in model.modules():
        if isinstance(m, LinearBase):
            m.process_after_loading()


def _check_trivial_g_idx(fn: str, name: str, g_idx: torch.Tensor, group_size: int) -> None:
    """gptqmodel writes g_idx even without act-order; only the trivial k // G order is served."""
    trivial = torch.arange(g_idx.numel(), dtype=torch.int64) // group_size
    if not torch.equal(g_idx.to(torch.int64).flatten(), trivial):
        raise CheckpointError(f"{fn}: {name} is a non-trivial group index (act-order / desc_act); "
                              "this is not supported, re-export without act-order")


def _count(fn: str) -> int:
    try:
        with safe_open(fn, framework="pt") as f:
            return len(list(f.keys()))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{fn}: not a readable safetensors file ({e}); is it truncated or corrupt?") from e


def eos_ids(path: str, tokenizer: PreTrainedTokenizerBase, hf: dict) -> frozenset[int]:
    """The union of config.json's, the tokenizer's and generation_config.json's eos ids."""
    ids: set[int] = set()
    sources: list[object] = [hf.get("eos_token_id"), tokenizer.eos_token_id]
    if os.path.isfile(os.path.join(path, GENERATION_CONFIG_NAME)):  # optional; the folder only, never a hub
        sources.append(GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id)
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, list):
            ids.update(int(x) for x in s)
    return frozenset(ids)
