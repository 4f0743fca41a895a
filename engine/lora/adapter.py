"""PEFT LoRA adapter folder -> validated per-module (A, B) float32 CPU tensors, scale folded into B.

This module is in the serving path: it imports neither peft nor transformers. It reproduces the
parts of peft 0.21's semantics that decide what an adapter computes:

- scale per module: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), with ``r`` and
  ``lora_alpha`` overridden per module by ``rank_pattern`` / ``alpha_pattern``;
- pattern keys (peft ``get_pattern_key``): the keys are tried in the config file's order and the first key
  ``k`` for which ``re.match(rf"(.*\\.)?({k})$", module_name)`` succeeds wins, i.e. ``k`` is a regex that
  must match a whole dot-separated suffix of the module name; if none matches, the plain dict lookup
  of the module name itself is used, else the global value;
- target modules (peft ``check_target_module_exists``): a string is a regex that must ``fullmatch``
  the module name; a list matches a name equal to an entry or ending in ``"." + entry``, then
  ``layers_to_transform`` / ``layers_pattern`` restrict the layer index; ``exclude_modules`` removes
  matches (regex fullmatch for a string, equal / dot-suffix for a list); ``"all-linear"`` means every
  LoRA-capable module of the base.

Module names are matched as peft saw them (the tensor key without ``base_model.model.``) and, as a
fallback, in canonical form (``model.language_model.layers.`` -> ``model.layers.``), so an adapter
trained on a Qwen3.5 vision-language export and one trained on a text-only export both load.

Everything is read and validated before a LoRAAdapter is returned; any problem raises AdapterError
(HTTP 400) or AdapterNotFoundError (HTTP 404) with a message naming the adapter, the module and the
limit.

The weights file is read with plain reads, never memory-mapped: a file truncated by another process
while mapped kills the reading process with SIGBUS, and adapter folders are written by other people's
tools while the server runs. Only the header is read until every tensor's name, shape and dtype has
been checked (and the header must describe exactly the file's size), so a file that declares huge
shapes, or a huge sparse file, is refused before its data is read. The data is then read once; the
checksum and the tensors come from those same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
# <prefix?><module>.lora_A|lora_B[.<adapter name>].weight
_KEY_RE = re.compile(r"(?P<module>.+)\.(?P<ab>lora_A|lora_B)(?:\.(?P<seg>[^.]+))?\.weight")
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_ITEM_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
MAX_CONFIG_BYTES = 1 << 20  # a peft adapter_config.json is about 1 KiB
MAX_HEADER_BYTES = 16 << 20  # safetensors' own limit is 100 MB; ~150 bytes per tensor in practice
# Config fields that turn on a LoRA variant whose forward is not plain x A^T B^T (peft marks them
# `is_lora_variant`; VeLoRA only changes the backward pass and is therefore accepted).
_VARIANT_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "lora_bias": "LoRA-B bias (lora_bias)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "parameter targeting (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "megatron_config": "Megatron parallel LoRA (megatron_config)",
}
# init_lora_weights values whose training changed the BASE weights (residual init); such an adapter
# is only correct on that modified base unless peft converted it at save time.
_BASE_MODIFYING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


class AdapterError(ValueError):
    """Invalid adapter; message names the adapter, the module and the limit. (HTTP 400)"""


class AdapterNotFoundError(AdapterError):
    """Path missing / no adapter files there (HTTP 404)."""


class _FileChanged(AdapterError):
    """The weights file changed between its header and its data being read."""


@dataclass(frozen=True)
class LoRAModule:
    a: torch.Tensor  # [rank, in_features] float32, CPU, contiguous
    b: torch.Tensor  # [out_features, rank] float32, CPU, contiguous, ALREADY multiplied by the scale
    rank: int


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str  # resolved real path of the folder
    modules: dict[str, LoRAModule]  # canonical module name, e.g. "model.layers.3.self_attn.q_proj"
    rank: int  # max over modules
    checksum: str  # sha256 over adapter_config.json + adapter_model.safetensors bytes
    alpha: float | None = None  # informational (the config's lora_alpha)


# ----------------------------------------------------------------------------------------------
# names, paths, checksum


def validate_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise AdapterError(f"invalid adapter name {name!r}: use 1..128 characters of [A-Za-z0-9._-], "
                           f"not starting with '.'")
    return name


def _resolve(name: str, path: Any) -> tuple[str, str, str]:
    """(real folder, config file, weights file) or AdapterNotFoundError / AdapterError."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise AdapterNotFoundError(f"adapter {name!r}: no adapter path given")
    real = os.path.realpath(os.fspath(path))
    if not os.path.exists(real):
        raise AdapterNotFoundError(f"adapter {name!r}: path {path} does not exist")
    if not os.path.isdir(real):
        raise AdapterNotFoundError(f"adapter {name!r}: path {path} is not a directory")
    cfg, weights = os.path.join(real, CONFIG_FILE), os.path.join(real, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(real, PICKLE_FILE)):
            raise AdapterError(f"adapter {name!r}: {path} holds only {PICKLE_FILE}; pickled .bin adapters are "
                               f"refused; save with safe_serialization=True")
        raise AdapterNotFoundError(f"adapter {name!r}: no {WEIGHTS_FILE} in {path}")
    if not os.path.isfile(cfg):
        raise AdapterNotFoundError(f"adapter {name!r}: no {CONFIG_FILE} in {path}")
    return real, cfg, weights


def _stat_sig(*files: str) -> tuple:
    out = []
    for f in files:
        st = os.stat(f)
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _checksum_bytes(*parts: bytes | bytearray) -> str:
    """sha256 over (length, bytes) of each part: adapter_config.json then adapter_model.safetensors."""
    h = hashlib.sha256()
    for b in parts:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _read_small(path: str, limit: int, what: str) -> bytes:
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise ValueError(f"{what} is {size} bytes; at most {limit} are accepted")
        return fh.read(limit + 1)


class _Slice:
    def __init__(self, meta: dict[str, Any]) -> None:
        self.meta = meta

    def get_shape(self) -> list[int]:
        return list(self.meta["shape"])

    def get_dtype(self) -> str:
        return str(self.meta["dtype"])


class _SafetensorsFile:
    """The subset of safetensors.safe_open's API that _read_tensors uses, over plain reads (see the
    module docstring). Opening reads and checks the header only; the first get_tensor reads the whole
    file once into memory and stores it in `snapshot["bytes"]`."""

    def __init__(self, path: str, snapshot: dict[str, bytearray] | None = None) -> None:
        self._fh = open(path, "rb")  # noqa: SIM115 - closed by __exit__ / close
        try:
            self._size = os.fstat(self._fh.fileno()).st_size
            self._header_raw = self._read_header()
        except BaseException:
            self._fh.close()
            raise
        self._data: bytearray | None = None
        self._snapshot = snapshot if snapshot is not None else {}

    def _read_header(self) -> bytes:
        head = self._fh.read(8)
        if len(head) < 8:
            raise ValueError(f"file of {self._size} bytes is too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > self._size:
            raise ValueError(f"declared header length {n} exceeds the file ({self._size} bytes) or the limit "
                             f"of {MAX_HEADER_BYTES} bytes")
        raw = self._fh.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"corrupt header: {e}") from e
        if not isinstance(header, dict):
            raise ValueError("corrupt header: not a JSON object")
        header.pop("__metadata__", None)
        spans: list[tuple[int, int]] = []
        for key, meta in header.items():
            dt, shape, offs = (meta.get(k) if isinstance(meta, dict) else None
                               for k in ("dtype", "shape", "data_offsets"))
            if (not isinstance(dt, str) or not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape)
                    or not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs)):
                raise ValueError(f"corrupt header entry for {key!r}: {meta!r}"[:300])
            if dt in _ITEM_SIZES and offs[1] - offs[0] != math.prod(shape) * _ITEM_SIZES[dt]:
                raise ValueError(f"tensor {key!r}: data_offsets {offs} do not match shape {shape} and dtype {dt}")
            spans.append((offs[0], offs[1]))
        # Like safetensors: the tensors tile the data region exactly (no gap, no overlap, nothing after),
        # so the file's size is what the (checked) shapes say and nothing else is ever read.
        end = 0
        for b, e in sorted(spans):
            if b != end or e < b:
                raise ValueError(f"tensor data offsets overlap or leave a gap at byte {end}")
            end = e
        if 8 + n + end != self._size:
            raise ValueError(f"the header describes {8 + n + end} bytes but the file has {self._size} "
                             "(truncated, or data after the tensors)")
        self._header, self._base = header, 8 + n
        return head + raw

    def __enter__(self) -> _SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._fh.close()

    def keys(self) -> list[str]:
        return list(self._header)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self._header[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        if self._data is None:
            data = bytearray(self._size)
            self._fh.seek(0)
            got = self._fh.readinto(data)
            if got != self._size or self._fh.read(1) or bytes(data[: len(self._header_raw)]) != self._header_raw:
                raise _FileChanged("the file changed while being loaded; retry")
            self._data = self._snapshot["bytes"] = data
        meta = self._header[key]
        dtype = _TORCH_DTYPES[meta["dtype"]]
        b, e = meta["data_offsets"]
        count = (e - b) // _ITEM_SIZES[meta["dtype"]]
        return torch.frombuffer(self._data, dtype=dtype, count=count, offset=self._base + b).reshape(
            meta["shape"]).clone()


def safe_open(path: str, framework: str = "pt", snapshot: dict[str, bytearray] | None = None) -> _SafetensorsFile:
    """Stand-in for safetensors.safe_open (framework "pt" only) without mmap; see _SafetensorsFile."""
    if framework != "pt":
        raise ValueError(f"framework {framework!r} is not supported")
    return _SafetensorsFile(path, snapshot)


# ----------------------------------------------------------------------------------------------
# config


@dataclass(frozen=True)
class _Config:
    r: int
    alpha: float
    rslora: bool
    target: str | tuple[str, ...]  # regex string or list of names; "all-linear" kept as a string
    exclude: str | tuple[str, ...] | None
    layers: tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _compile(name: str, what: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise AdapterError(f"adapter {name!r}: {what} {pattern!r} is not a valid regex: {e}") from e


def _str_or_list(name: str, field: str, v: Any) -> str | tuple[str, ...] | None:
    if v is None:
        return None
    if isinstance(v, str):
        _compile(name, field, v)
        return v
    if isinstance(v, (list, tuple, set)) and all(isinstance(x, str) for x in v):
        return tuple(sorted(v)) if isinstance(v, set) else tuple(v)
    raise AdapterError(f"adapter {name!r}: {field} must be a string (regex) or a list of module names, got {v!r}")


def _parse_config(name: str, cfg_bytes: bytes) -> _Config:
    try:
        raw = json.loads(cfg_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    peft_type = raw.get("peft_type")
    if peft_type is not None and str(peft_type).upper() != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {peft_type!r} is not supported; only LORA")
    for key in ("r", "lora_alpha", "target_modules"):
        if raw.get(key) is None:
            raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} lacks required field {key!r}")
    r, alpha = raw["r"], raw["lora_alpha"]
    if not _is_int(r) or r < 1:
        raise AdapterError(f"adapter {name!r}: r must be a positive integer, got {r!r}")
    if not _is_num(alpha):
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a finite number, got {alpha!r}")

    for field, what in _VARIANT_FIELDS.items():
        if raw.get(field):
            raise AdapterError(f"adapter {name!r}: {what} is not supported; only plain LoRA adapters")
    bias = raw.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(f"adapter {name!r}: bias={bias!r} is not supported; only bias='none'")
    if raw.get("modules_to_save"):
        raise AdapterError(f"adapter {name!r}: modules_to_save={raw['modules_to_save']!r} is not supported "
                           f"(fully trained modules are not LoRA)")
    if raw.get("fan_in_fan_out"):
        raise AdapterError(f"adapter {name!r}: fan_in_fan_out=true is not supported (Conv1D-style weights)")
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise AdapterError(f"adapter {name!r}: init_lora_weights={init!r} trains against modified base weights; "
                           f"convert it with peft's path_initial_model_for_weight_conversion before serving")

    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"adapter {name!r}: use_rslora must be true or false, got {rslora!r}")

    target = _str_or_list(name, "target_modules", raw["target_modules"])
    if not target:
        raise AdapterError(f"adapter {name!r}: target_modules is empty")
    exclude = _str_or_list(name, "exclude_modules", raw.get("exclude_modules"))

    layers = raw.get("layers_to_transform")
    if _is_int(layers):
        layers = (layers,)
    elif isinstance(layers, list) and all(_is_int(x) for x in layers):
        layers = tuple(layers) or None
    elif layers is not None:
        raise AdapterError(f"adapter {name!r}: layers_to_transform must be an int or a list of ints, got {layers!r}")
    lp = raw.get("layers_pattern")
    if isinstance(lp, str):
        lp = (lp,) if lp else None
    elif isinstance(lp, list) and all(isinstance(x, str) for x in lp):
        lp = tuple(lp) or None
    elif lp is not None:
        raise AdapterError(f"adapter {name!r}: layers_pattern must be a string or a list, got {lp!r}")
    for p in lp or ():
        _compile(name, "layers_pattern", p)

    patterns: list[dict] = []
    for field, check, what in (("rank_pattern", lambda v: _is_int(v) and v >= 1, "a positive integer"),
                               ("alpha_pattern", _is_num, "a finite number")):
        pat = raw.get(field) or {}
        if not isinstance(pat, dict):
            raise AdapterError(f"adapter {name!r}: {field} must be an object, got {pat!r}")
        for k, v in pat.items():
            _compile(name, f"{field} key", k)
            if not check(v):
                raise AdapterError(f"adapter {name!r}: {field}[{k!r}] must be {what}, got {v!r}")
        patterns.append(dict(pat))
    return _Config(r, float(alpha), rslora, target, exclude, layers, lp, patterns[0], patterns[1])


# ----------------------------------------------------------------------------------------------
# peft's matching rules, reproduced


def _pattern_keys(pattern: Mapping[str, Any], names: tuple[str, ...]) -> list[str]:
    """The keys (in config order) that peft's get_pattern_key would accept for any of `names`."""
    return [key for key in pattern if any(re.match(rf"(.*\.)?({key})$", n) for n in names)]


def _pattern_value(pattern: Mapping[str, Any], names: tuple[str, ...], default: Any) -> Any:
    """peft get_pattern_key + dict lookup: the first key in the file's order matching a dot-suffix of the name.

    Note: peft's save_pretrained writes the config with sorted keys, so with overlapping keys the order
    (and the winner) on reload can differ from training time; we follow the file, like
    PeftModel.from_pretrained does."""
    keys = _pattern_keys(pattern, names)
    if keys:
        return pattern[keys[0]]
    for n in names:
        if n in pattern:
            return pattern[n]
    return default


def _layer_index(cfg: _Config, module: str) -> int | None:
    if cfg.layers_pattern is None:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        m = None
        for p in cfg.layers_pattern:
            m = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module)
            if m is not None:
                break
    return int(m.group("idx")) if m else None


def _targeted_one(cfg: _Config, module: str, supported: Mapping[str, Any]) -> bool:
    if cfg.exclude:
        if isinstance(cfg.exclude, str):
            if re.fullmatch(cfg.exclude, module):
                return False
        elif module in cfg.exclude or any(module.endswith("." + e) for e in cfg.exclude):
            return False
    if isinstance(cfg.target, str):
        if cfg.target.lower() == "all-linear":
            return _canonical(module) in supported
        return re.fullmatch(cfg.target, module) is not None
    if module in cfg.target:
        return True
    if not any(module.endswith("." + t) for t in cfg.target):
        return False
    if cfg.layers is None:
        return True
    idx = _layer_index(cfg, module)
    return idx is not None and idx in cfg.layers


def _canonical(module: str) -> str:
    if module.startswith("model.language_model."):
        return "model." + module[len("model.language_model."):]
    return module


def _check_targets_exist(name: str, cfg: _Config, supported: Mapping[str, Any]) -> None:
    """A list entry that names no LoRA-capable module of the base (e.g. lm_head) is refused."""
    if isinstance(cfg.target, str):
        return
    spellings = [*supported, *("model.language_model." + m[len("model."):] for m in supported
                               if m.startswith("model.layers."))]
    for t in cfg.target:
        if not any(m == t or m.endswith("." + t) for m in spellings):
            leaves = sorted({m.rsplit(".", 1)[-1] for m in supported})
            raise AdapterError(f"adapter {name!r}: target module {t!r} is not a LoRA-capable module of the base "
                               f"model (supported: {', '.join(leaves)})")


# ----------------------------------------------------------------------------------------------
# tensors


def _parse_key(name: str, key: str) -> tuple[str, str, str]:
    """tensor key -> (module as peft saw it, canonical module, 'A' | 'B')."""
    k = key.removeprefix("base_model.model.")
    m = _KEY_RE.fullmatch(k)
    if m is None:
        if "lora_magnitude_vector" in key:
            why = "DoRA magnitude vectors are not supported"
        elif "lora_embedding_" in key:
            why = "embedding LoRA is not supported"
        elif key.endswith(".bias"):
            why = "bias tensors are not supported"
        else:
            why = "unexpected tensor (only <module>.lora_A.weight / <module>.lora_B.weight)"
        raise AdapterError(f"adapter {name!r}: tensor {key!r}: {why}")
    module = m.group("module")
    return module, _canonical(module), m.group("ab")[-1]


def load_adapter(name: str, path: str, target_shapes: Mapping[str, tuple[int, int]], max_rank: int) -> LoRAAdapter:
    """Read and validate the PEFT adapter in `path` against the base model's LoRA-capable modules.

    target_shapes: canonical module name -> FULL (in_features, out_features). Raises AdapterError /
    AdapterNotFoundError; returns only a fully validated adapter."""
    validate_name(name)
    real, cfg_path, weights = _resolve(name, path)
    try:
        before = _stat_sig(cfg_path, weights)
        cfg_bytes = _read_small(cfg_path, MAX_CONFIG_BYTES, CONFIG_FILE)
    except OSError as e:
        raise AdapterNotFoundError(f"adapter {name!r}: cannot read adapter files in {path}: {e}") from e
    except ValueError as e:
        raise AdapterError(f"adapter {name!r}: {e}") from e
    cfg = _parse_config(name, cfg_bytes)
    _check_targets_exist(name, cfg, target_shapes)

    snapshot: dict[str, bytearray] = {}
    try:
        with safe_open(weights, framework="pt", snapshot=snapshot) as f:
            modules = _read_tensors(name, cfg, f, target_shapes, max_rank)
    except _FileChanged as e:
        raise AdapterError(f"adapter {name!r}: files in {path} changed while being loaded; retry") from e
    except AdapterError:
        raise
    except Exception as e:  # corrupt or truncated header/data
        raise AdapterError(f"adapter {name!r}: cannot read {WEIGHTS_FILE}: {e}") from e
    checksum = _checksum_bytes(cfg_bytes, snapshot["bytes"])  # of exactly the bytes the tensors came from

    try:
        changed = _stat_sig(cfg_path, weights) != before
    except OSError:
        changed = True
    if changed:
        raise AdapterError(f"adapter {name!r}: files in {path} changed while being loaded; retry")
    return LoRAAdapter(name=name, path=real, modules=modules, rank=max(m.rank for m in modules.values()),
                       checksum=checksum, alpha=cfg.alpha)


def _read_tensors(name: str, cfg: _Config, f, target_shapes: Mapping[str, tuple[int, int]],
                  max_rank: int) -> dict[str, LoRAModule]:
    keys = list(f.keys())
    # 1. names: parse every key, group A/B per canonical module
    parts: dict[str, dict[str, str]] = {}
    seen_as: dict[str, str] = {}
    for key in keys:
        module, canon, ab = _parse_key(name, key)
        slot = parts.setdefault(canon, {})
        if ab in slot:
            raise AdapterError(f"adapter {name!r}: module {canon}: two lora_{ab} tensors ({slot[ab]!r} and {key!r})")
        slot[ab] = key
        seen_as.setdefault(canon, module)
    if not parts or not any(c in target_shapes for c in parts):
        sample = ", ".join(keys[:3]) or "no tensors"
        raise AdapterError(f"adapter {name!r}: matches no module of the base model ({sample}); expected keys "
                           f"like base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    # 2. every module: in the base, targeted by the config, both factors, shapes, rank limit
    plan: list[tuple[str, str, str, int, float]] = []
    for canon in sorted(parts):
        slot, module = parts[canon], seen_as[canon]
        if canon not in target_shapes:
            raise AdapterError(f"adapter {name!r}: module {module} is not a LoRA-capable module of the base model")
        names = (module, canon) if module != canon else (module,)
        if not any(_targeted_one(cfg, n, target_shapes) for n in names):
            raise AdapterError(f"adapter {name!r}: module {module} has LoRA tensors but is not targeted by "
                               f"target_modules={cfg.target!r}" + (f" / layers_to_transform={list(cfg.layers)}"
                                                                    if cfg.layers else ""))
        for ab in ("A", "B"):
            if ab not in slot:
                raise AdapterError(f"adapter {name!r}: module {canon} has no lora_{ab} tensor")
        r = _pattern_value(cfg.rank_pattern, names, cfg.r)
        alpha = float(_pattern_value(cfg.alpha_pattern, names, cfg.alpha))
        fin, fout = target_shapes[canon]
        shape_a = list(f.get_slice(slot["A"]).get_shape())
        shape_b = list(f.get_slice(slot["B"]).get_shape())
        want_a, want_b = [r, fin], [fout, r]
        if shape_a != want_a or shape_b != want_b:
            hits = _pattern_keys(cfg.rank_pattern, names)
            note = (f"; rank_pattern keys {hits} all match this module and the first one in the file wins "
                    f"(peft saves the config with sorted keys)" if len(hits) > 1 else "")
            raise AdapterError(f"adapter {name!r}: module {canon}: lora_A shape {shape_a} / lora_B shape {shape_b} "
                               f"!= expected {want_a} / {want_b} (rank {r} from the config, in/out from the base)"
                               + note)
        if r > max_rank:
            raise AdapterError(f"adapter {name!r}: module {canon} has rank {r} > max_lora_rank {max_rank}")
        for ab in ("A", "B"):
            dt = f.get_slice(slot[ab]).get_dtype()
            if dt not in _FLOAT_DTYPES:
                raise AdapterError(f"adapter {name!r}: module {canon}: lora_{ab} has dtype {dt}; "
                                   f"expected one of {sorted(_FLOAT_DTYPES)}")
        scale = alpha / math.sqrt(r) if cfg.rslora else alpha / r
        plan.append((canon, slot["A"], slot["B"], r, scale))
    # 3. data: read as float32, check finite, fold the scale into B
    modules: dict[str, LoRAModule] = {}
    for canon, ka, kb, r, scale in plan:
        a = f.get_tensor(ka).to(torch.float32).contiguous()
        b = f.get_tensor(kb).to(torch.float32)
        for ab, t in (("A", a), ("B", b)):
            if not bool(torch.isfinite(t).all()):
                raise AdapterError(f"adapter {name!r}: module {canon}: lora_{ab} contains NaN or inf")
        b = (b * scale).contiguous()
        if not bool(torch.isfinite(b).all()):
            raise AdapterError(f"adapter {name!r}: module {canon}: lora_B * scale {scale:g} overflows float32")
        modules[canon] = LoRAModule(a=a, b=b, rank=r)
    return modules


__all__ = ["AdapterError", "AdapterNotFoundError", "LoRAAdapter", "LoRAModule", "load_adapter",
           "validate_name"]
