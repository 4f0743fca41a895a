"""adapter_config.json -> a validated, bounded _Config, and peft 0.21's module-matching rules.

The parts of peft's semantics that decide what an adapter computes:

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

Bounds (an adapter folder is untrusted input): the file's size, JSON nesting and number lengths (see
adapter_files), sane ranges for ranks, alphas and layer indices, at most MAX_PATTERN_KEYS keys per
pattern dict and MAX_PATTERN_CHARS characters per regex. Every regex of the config runs in RE2
(google-re2), which matches in time linear in the input: Python's ``re`` backtracks, holds the
interpreter lock while it does, and ``(.*.*)*X`` against a module name never returns. RE2 has no
backreferences or lookaround; a config that uses them is refused with a message that says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import re2

from engine.errors import AdapterError, JSONLimitError
from engine.lora.adapter_files import CONFIG_FILE, loads_bounded

MAX_PATTERN_KEYS = 1024  # per rank_pattern / alpha_pattern; peft's EVA init writes one per module
MAX_PATTERN_CHARS = 1024
MAX_PROGRAM = 1 << 20  # RE2 instructions over all of a config's compiled regexes (a plain key compiles to ~50)
MAX_NAMES = 4096  # entries of target_modules / exclude_modules / layers_to_transform / layers_pattern lists
MAX_RANK = 1 << 16
MAX_ABS_ALPHA = 1e6
MAX_LAYER = 1 << 20
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
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # refusals are reported to the client, not logged by the C++ library
_RE2_OPTIONS.max_mem = 1 << 20  # per regex (program + matching cache); a plain module-name key needs ~2 KiB


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
    regex: dict[str, Any]  # every regex above (pattern keys in peft's wrapped form), compiled by RE2


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


class _Compiler:
    """Compiles a config's regexes in RE2 within a total program budget; refusals name the field."""

    def __init__(self, name: str) -> None:
        self.name, self.regex, self.program = name, {}, 0

    def __call__(self, what: str, pattern: str, shown: str | None = None) -> None:
        shown = pattern if shown is None else shown
        if len(shown) > MAX_PATTERN_CHARS:
            raise AdapterError(f"adapter {self.name!r}: {what} is a regex of {len(shown)} characters; at most "
                               f"{MAX_PATTERN_CHARS} are accepted")
        if pattern in self.regex:
            return
        try:
            compiled = re2.compile(pattern, _RE2_OPTIONS)
        except re2.error as e:
            why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
            raise AdapterError(f"adapter {self.name!r}: {what} {shown[:200]!r} is not a valid regex: {why} (regexes "
                               f"run in RE2: no backreferences, no lookaround)") from None
        self.program += compiled.programsize
        if self.program > MAX_PROGRAM:
            raise AdapterError(f"adapter {self.name!r}: the config's regexes compile to more than {MAX_PROGRAM} "
                               f"instructions ({what} {shown[:80]!r} passed the limit)")
        self.regex[pattern] = compiled


def _str_or_list(compile_: _Compiler, field: str, v: Any) -> str | tuple[str, ...] | None:
    name = compile_.name
    if v is None:
        return None
    if isinstance(v, str):
        compile_(field, v)
        return v
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        if len(v) > MAX_NAMES:
            raise AdapterError(f"adapter {name!r}: {field} lists {len(v)} names; at most {MAX_NAMES} are accepted")
        return tuple(v)
    raise AdapterError(f"adapter {name!r}: {field} must be a string (regex) or a list of module names, "
                       f"got {v!r}"[:400])


def parse_config(name: str, cfg_bytes: bytes) -> _Config:
    try:
        raw = loads_bounded(cfg_bytes)
    except JSONLimitError as e:
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is refused: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    peft_type = raw.get("peft_type")
    if peft_type is not None and str(peft_type)[:40].upper() != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {peft_type!r} is not supported; only LORA"[:400])
    for key in ("r", "lora_alpha", "target_modules"):
        if raw.get(key) is None:
            raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} lacks required field {key!r}")
    r, alpha = raw["r"], raw["lora_alpha"]
    if not _is_int(r) or not 1 <= r <= MAX_RANK:
        raise AdapterError(f"adapter {name!r}: r must be a positive integer (at most {MAX_RANK}), got {r!r}"[:400])
    if not _is_num(alpha) or abs(alpha) > MAX_ABS_ALPHA:
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a finite number (|alpha| <= {MAX_ABS_ALPHA:g}), "
                           f"got {alpha!r}"[:400])

    for field, what in _VARIANT_FIELDS.items():
        if raw.get(field):
            raise AdapterError(f"adapter {name!r}: {what} is not supported; only plain LoRA adapters")
    bias = raw.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(f"adapter {name!r}: bias={bias!r} is not supported; only bias='none'"[:400])
    if raw.get("modules_to_save"):
        raise AdapterError(f"adapter {name!r}: modules_to_save={raw['modules_to_save']!r} is not supported "
                           f"(fully trained modules are not LoRA)"[:400])
    if raw.get("fan_in_fan_out"):
        raise AdapterError(f"adapter {name!r}: fan_in_fan_out=true is not supported (Conv1D-style weights)")
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise AdapterError(f"adapter {name!r}: init_lora_weights={init[:60]!r} trains against modified base "
                           f"weights; convert it with peft's path_initial_model_for_weight_conversion before serving")

    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"adapter {name!r}: use_rslora must be true or false, got {rslora!r}"[:400])

    compile_ = _Compiler(name)
    target = _str_or_list(compile_, "target_modules", raw["target_modules"])
    if not target:
        raise AdapterError(f"adapter {name!r}: target_modules is empty")
    exclude = _str_or_list(compile_, "exclude_modules", raw.get("exclude_modules"))
    layers = _layers(name, raw.get("layers_to_transform"))
    lp = raw.get("layers_pattern")
    if isinstance(lp, str):
        lp = (lp,) if lp else None
    elif isinstance(lp, list) and all(isinstance(x, str) for x in lp) and len(lp) <= MAX_NAMES:
        lp = tuple(lp) or None
    elif lp is not None:
        raise AdapterError(f"adapter {name!r}: layers_pattern must be a string or a list, got {lp!r}"[:400])
    for p in lp or ():
        compile_("layers_pattern", _layer_regex(p), p)

    patterns: list[dict] = []
    for field, check, what in (("rank_pattern", lambda v: _is_int(v) and 1 <= v <= MAX_RANK,
                                f"a positive integer (at most {MAX_RANK})"),
                               ("alpha_pattern", lambda v: _is_num(v) and abs(v) <= MAX_ABS_ALPHA,
                                f"a finite number (|alpha| <= {MAX_ABS_ALPHA:g})")):
        pat = raw.get(field) or {}
        if not isinstance(pat, dict):
            raise AdapterError(f"adapter {name!r}: {field} must be an object, got {pat!r}"[:400])
        if len(pat) > MAX_PATTERN_KEYS:
            raise AdapterError(f"adapter {name!r}: {field} has {len(pat)} keys; at most {MAX_PATTERN_KEYS} are "
                               f"accepted")
        for k, v in pat.items():
            compile_(f"{field} key", k)
            compile_(f"{field} key", _key_regex(k), k)
            if not check(v):
                raise AdapterError(f"adapter {name!r}: {field}[{k!r}] must be {what}, got {v!r}"[:400])
        patterns.append(dict(pat))
    return _Config(r, float(alpha), rslora, target, exclude, layers, lp, patterns[0], patterns[1], compile_.regex)


def _layers(name: str, layers: Any) -> tuple[int, ...] | None:
    if _is_int(layers):
        layers = [layers]
    if layers is None or (isinstance(layers, list) and not layers):
        return None
    if (isinstance(layers, list) and len(layers) <= MAX_NAMES
            and all(_is_int(x) and 0 <= x <= MAX_LAYER for x in layers)):
        return tuple(layers)
    raise AdapterError(f"adapter {name!r}: layers_to_transform must be an int or a list of ints in "
                       f"[0, {MAX_LAYER}], got {layers!r}"[:400])


# ----------------------------------------------------------------------------------------------
# peft's matching rules, reproduced (in RE2)


def _key_regex(key: str) -> str:
    return rf"(.*\.)?({key})$"


def _layer_regex(layers_pattern: str) -> str:
    return rf"(?:^|.*?\.){layers_pattern}\.(?P<idx>\d+)\."


_DEFAULT_LAYER_RE = re2.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.", _RE2_OPTIONS)


def pattern_keys(cfg: _Config, pattern: Mapping[str, Any], names: tuple[str, ...]) -> list[str]:
    """The keys (in config order) that peft's get_pattern_key would accept for any of `names`."""
    return [key for key in pattern if any(cfg.regex[_key_regex(key)].match(n) for n in names)]


def pattern_value(cfg: _Config, pattern: Mapping[str, Any], names: tuple[str, ...], default: Any) -> Any:
    """peft get_pattern_key + dict lookup: the first key in the file's order matching a dot-suffix of the name.

    Note: peft's save_pretrained writes the config with sorted keys, so with overlapping keys the order
    (and the winner) on reload can differ from training time; we follow the file, like
    PeftModel.from_pretrained does."""
    for key in pattern:
        if any(cfg.regex[_key_regex(key)].match(n) for n in names):
            return pattern[key]
    for n in names:
        if n in pattern:
            return pattern[n]
    return default


def _layer_index(cfg: _Config, module: str) -> int | None:
    if cfg.layers_pattern is None:
        m = _DEFAULT_LAYER_RE.match(module)
    else:
        m = None
        for p in cfg.layers_pattern:
            m = cfg.regex[_layer_regex(p)].match(module)
            if m is not None:
                break
    return int(m.group("idx")) if m else None


def _dot_suffixes(module: str) -> list[str]:
    """The module name and every part of it after a dot: `n == t or n.endswith("." + t)` is `t in this`."""
    parts = module.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


@lru_cache(maxsize=64)
def _name_set(names: tuple[str, ...]) -> frozenset[str]:
    return frozenset(names)


def targeted_one(cfg: _Config, module: str, supported: Mapping[str, Any]) -> bool:
    if cfg.exclude:
        if isinstance(cfg.exclude, str):
            if cfg.regex[cfg.exclude].fullmatch(module):
                return False
        elif not _name_set(cfg.exclude).isdisjoint(_dot_suffixes(module)):
            return False
    if isinstance(cfg.target, str):
        if cfg.target.lower() == "all-linear":
            return canonical(module) in supported
        return cfg.regex[cfg.target].fullmatch(module) is not None
    if module in _name_set(cfg.target):
        return True
    if _name_set(cfg.target).isdisjoint(_dot_suffixes(module)):
        return False
    if cfg.layers is None:
        return True
    idx = _layer_index(cfg, module)
    return idx is not None and idx in cfg.layers


def canonical(module: str) -> str:
    if module.startswith("model.language_model."):
        return "model." + module[len("model.language_model."):]
    return module


def check_targets_exist(name: str, cfg: _Config, supported: Mapping[str, Any]) -> None:
    """A list entry that names no LoRA-capable module of the base (e.g. lm_head) is refused."""
    if isinstance(cfg.target, str):
        return
    spellings = [*supported, *("model.language_model." + m[len("model."):] for m in supported
                               if m.startswith("model.layers."))]
    known = {s for m in spellings for s in _dot_suffixes(m)}
    for t in cfg.target:
        if t not in known:
            leaves = sorted({m.rsplit(".", 1)[-1] for m in supported})
            raise AdapterError(f"adapter {name!r}: target module {t[:200]!r} is not a LoRA-capable module of the "
                               f"base model (supported: {', '.join(leaves)})")
