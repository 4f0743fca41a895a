"""PEFT LoRA adapter folder -> validated per-module (A, B) float32 CPU tensors, scale folded into B.

This module is in the serving path: it imports neither peft nor transformers. Reading the folder
(confined to the lora roots, bounded, no mmap) is adapter_files.py; the config and peft's matching rules
are peft_config.py. Module names are matched as peft saw them (the tensor key without
``base_model.model.``) and, as a fallback, in canonical form (``model.language_model.layers.`` ->
``model.layers.``), so an adapter trained on a Qwen3.5 vision-language export and one trained on a
text-only export both load.

Everything is read and validated before a LoRAAdapter is returned; any problem, whatever the files
hold, raises AdapterError (HTTP 400), AdapterNotFoundError (404) or AdapterPathForbiddenError (403) with
a message naming the adapter and the problem. A re-read (`expect`: an adapter evicted from the host
cache) compares the checksum of the raw bytes with the stored one before anything is parsed.
"""

from __future__ import annotations

import io
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import AdapterError, AdapterNotFoundError, AdapterPathForbiddenError, FileChangedError
from engine.lazy import LazyModule
from engine.lora.adapter_files import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    MAX_HEADER_BYTES,
    PICKLE_FILE,
    WEIGHTS_FILE,
    AdapterFiles,
    safe_open,
)
from engine.lora.adapter_files import checksum_bytes as _checksum_bytes
from engine.lora.peft_config import (
    _Config,
    canonical,
    check_targets_exist,
    parse_config,
    pattern_keys,
    pattern_value,
    targeted_one,
)

if TYPE_CHECKING:
    import torch
else:  # the API process validates adapter names only; loading tensors is the engine core's
    torch = LazyModule("torch")

log = logging.getLogger(__name__)
_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
# <prefix?><module>.lora_A|lora_B[.<adapter name>].weight
_KEY_RE = re.compile(r"(?P<module>.+)\.(?P<ab>lora_A|lora_B)(?:\.(?P<seg>[^.]+))?\.weight")
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


@dataclass(frozen=True)
class Fingerprint:
    """What a loaded adapter's files were: a re-read must find exactly these bytes."""

    checksum: str
    weights_size: int


@dataclass(frozen=True)
class LoRAModule:
    a: torch.Tensor  # [rank, in_features] float32, CPU, contiguous
    b: torch.Tensor  # [out_features, rank] float32, CPU, contiguous, ALREADY multiplied by the scale
    rank: int


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """Compared and hashed by identity: the model runner keeps each adapter object's packed form beside it."""

    name: str
    path: str  # resolved real path of the folder
    modules: dict[str, LoRAModule]  # canonical module name, e.g. "model.layers.3.self_attn.q_proj"
    rank: int  # max over modules
    checksum: str  # sha256 over adapter_config.json + adapter_model.safetensors bytes
    alpha: float | None = None  # informational (the config's lora_alpha)
    weights_size: int = 0  # bytes of adapter_model.safetensors (a re-read refuses any other size unread)

    @property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint(self.checksum, self.weights_size)


def validate_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise AdapterError(f"invalid adapter name {name!r}: use 1..128 characters of [A-Za-z0-9._-], "
                           f"not starting with '.'")
    return name


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
    return module, canonical(module), m.group("ab")[-1]


def load_adapter(name: str, path: str, target_shapes: Mapping[str, tuple[int, int]], max_rank: int,
                 roots: Sequence[str] = (), expect: Fingerprint | None = None) -> LoRAAdapter:
    """Read and validate the PEFT adapter in `path` against the base model's LoRA-capable modules.

    target_shapes: canonical module name -> FULL (in_features, out_features). roots: when given, the
    folder and both files must really lie inside one of them (checked on the opened files). expect: a
    re-read, refused unless the files hold exactly these bytes (compared before anything is parsed).
    Raises only AdapterError and its subclasses; returns only a fully validated adapter."""
    validate_name(name)
    try:
        with AdapterFiles(name, path, roots) as files:
            return _load(name, files, target_shapes, max_rank, expect)
    except AdapterError:
        raise
    except OSError as e:  # the folder changed under the load (removed, replaced) or cannot be read
        raise AdapterNotFoundError(f"adapter {name!r}: cannot read the adapter files in {path}: "
                                   f"{e.strerror or e}") from None
    except Exception as e:  # a backstop: whatever a file holds, the caller gets the adapter's own error
        log.exception("unexpected failure loading adapter %r from %s", name, path)
        raise AdapterError(f"adapter {name!r}: cannot load it from {path}: {e}"[:600]) from None


def _load(name: str, files: AdapterFiles, target_shapes: Mapping[str, tuple[int, int]], max_rank: int,
          expect: Fingerprint | None) -> LoRAAdapter:
    snapshot: dict[str, bytes] = {}
    source, size = files.weights, files.weights_size
    if expect is not None:
        if files.weights_size != expect.weights_size:
            raise FileChangedError(f"adapter {name!r}: {WEIGHTS_FILE} in {files.shown} is now {files.weights_size} "
                                   f"bytes, not {expect.weights_size}: the files changed on disk since the load")
        data = files.read_weights()
        if _checksum_bytes(files.config, data) != expect.checksum:
            raise FileChangedError(f"adapter {name!r}: the files in {files.shown} changed on disk since the load")
        source = io.BytesIO(data)
    cfg = parse_config(name, files.config)
    check_targets_exist(name, cfg, target_shapes)
    try:
        with safe_open(source, size, framework="pt", snapshot=snapshot) as f:
            modules = _read_tensors(name, cfg, f, target_shapes, max_rank)
    except FileChangedError as e:
        raise FileChangedError(f"adapter {name!r}: files in {files.shown} changed while being loaded; retry") from e
    except AdapterError:
        raise
    except Exception as e:  # corrupt or truncated header/data
        raise AdapterError(f"adapter {name!r}: cannot read {WEIGHTS_FILE}: {e}"[:600]) from None
    checksum = _checksum_bytes(files.config, snapshot["bytes"])  # of exactly the bytes the tensors came from
    if expect is None:
        files.check_unchanged()
    return LoRAAdapter(name=name, path=files.folder, modules=modules, rank=max(m.rank for m in modules.values()),
                       checksum=checksum, alpha=cfg.alpha, weights_size=size)


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
        if not any(targeted_one(cfg, n, target_shapes) for n in names):
            raise AdapterError(f"adapter {name!r}: module {module} has LoRA tensors but is not targeted by "
                               f"target_modules={cfg.target!r}" + (f" / layers_to_transform={list(cfg.layers)}"
                                                                    if cfg.layers else ""))
        for ab in ("A", "B"):
            if ab not in slot:
                raise AdapterError(f"adapter {name!r}: module {canon} has no lora_{ab} tensor")
        r = pattern_value(cfg, cfg.rank_pattern, names, cfg.r)
        alpha = float(pattern_value(cfg, cfg.alpha_pattern, names, cfg.alpha))
        fin, fout = target_shapes[canon]
        shape_a = list(f.get_slice(slot["A"]).get_shape())
        shape_b = list(f.get_slice(slot["B"]).get_shape())
        want_a, want_b = [r, fin], [fout, r]
        if shape_a != want_a or shape_b != want_b:
            hits = pattern_keys(cfg, cfg.rank_pattern, names)
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


__all__ = ["CONFIG_FILE", "MAX_CONFIG_BYTES", "MAX_HEADER_BYTES", "PICKLE_FILE", "WEIGHTS_FILE", "AdapterError",
           "AdapterNotFoundError", "AdapterPathForbiddenError", "Fingerprint", "LoRAAdapter", "LoRAModule",
           "load_adapter", "safe_open", "validate_name"]
