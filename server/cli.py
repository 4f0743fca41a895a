"""The `xpulora` command: serve, generate, quantize, check-device.

The command line is parsed first (server/cli_args.py, no heavy imports), so `--help`, `--version` and
bad flags answer without importing torch; the engine is imported once the command is known to run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.cli_args import DEMO_ADAPTERS, DEMO_MODEL, REPO_ROOT, build_parser

if TYPE_CHECKING:
    from engine import EngineConfig, KernelConfig, SamplingParams

__all__ = ["DEMO_ADAPTERS", "DEMO_MODEL", "REPO_ROOT", "build_engine_config", "build_parser", "demo_config",
           "is_demo", "main"]


def kernel_config(a: argparse.Namespace) -> KernelConfig:
    """The --*-kernel flags (serve, generate, check-device)."""
    from engine import KernelConfig

    return KernelConfig(lora=a.lora_kernel, attention=a.attention_kernel, fused=a.fused_kernel, gdn=a.gdn_kernel,
                        int4=a.int4_kernel)


def build_engine_config(a: argparse.Namespace) -> EngineConfig:
    from engine import (
        CacheConfig,
        ConfigError,
        EngineConfig,
        LoRAConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )

    names = list(a.served_model_name or [])
    base_names = names or [os.path.basename(os.path.normpath(a.model))]
    for m in a.lora_modules:
        base = getattr(m, "base_model_name", None)  # a LoraModule from the parser; tests may pass plain pairs
        if base is not None and base not in base_names:
            raise ConfigError(f"--lora-modules {m[0]}: base_model_name {base!r} is not a served model name "
                              f"({', '.join(base_names)})")
    return EngineConfig(
        model=ModelConfig(a.model, dtype=a.dtype, max_model_len=a.max_model_len,
                          served_model_name=names[0] if names else None,
                          extra_served_model_names=tuple(names[1:])),
        cache=CacheConfig(block_size=a.block_size, num_blocks=a.num_kv_blocks,
                          gpu_memory_utilization=a.gpu_memory_utilization,
                          enable_prefix_caching=a.enable_prefix_caching),
        parallel=ParallelConfig(tensor_parallel_size=a.tensor_parallel_size, device=a.device),
        lora=LoRAConfig(enable_lora=a.enable_lora, max_loras=a.max_loras, max_lora_rank=a.max_lora_rank,
                        max_cpu_loras=a.max_cpu_loras, fully_sharded_loras=a.fully_sharded_loras,
                        lora_dtype=a.lora_dtype,
                        lora_modules=tuple((name, path) for name, path in a.lora_modules),
                        lora_roots=tuple(a.lora_root), lora_autoload=not a.no_lora_autoload),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens),
        kernels=kernel_config(a),
        seed=a.seed, enforce_eager=a.enforce_eager,
        mixed_graphs=a.mixed_graphs, max_mixed_graph_tokens=a.max_mixed_graph_tokens,
        async_scheduling={"auto": None, "on": True, "off": False}[a.async_scheduling])


def is_demo(model: str) -> bool:
    return Path(model).resolve() == DEMO_MODEL.resolve()


def demo_config(config: EngineConfig, adapters: Path = DEMO_ADAPTERS) -> EngineConfig:
    """The bundled demo (serve and generate alike): LoRA on, a lora root on the demo adapters, every adapter
    there loaded at start besides those named, the CPU unless a device was asked for."""
    have = {n for n, _ in config.lora.lora_modules}
    found = sorted(d.name for d in adapters.iterdir() if (d / "adapter_config.json").is_file()) \
        if adapters.is_dir() else []
    lora = replace(config.lora, enable_lora=True, lora_roots=(*config.lora.lora_roots, str(adapters)),
                   lora_modules=(*config.lora.lora_modules, *((n, str(adapters / n)) for n in found if n not in have)))
    parallel = replace(config.parallel, device="cpu") if config.parallel.device == "auto" else config.parallel
    return replace(config, lora=lora, parallel=parallel)


# -- generate ----------------------------------------------------------------------------------------
def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


# The sampling fields of a JSONL line, each with the conversion it gets (the server's names and meanings).
_SCALAR_FIELDS: dict[str, Callable[[Any], Any]] = {
    "max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
    "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float, "min_tokens": int,
    "ignore_eos": _flag, "include_stop_str_in_output": _flag, "skip_special_tokens": _flag}
GENERATE_KEYS = {"prompt", "model", "seed", "stop", "stop_token_ids", "logit_bias", "logprobs", *_SCALAR_FIELDS}


def _line_request(line: dict[str, Any], base_names: set[str]) -> tuple[str | list[int], SamplingParams, str | None]:
    from engine import SamplingParams

    unknown = set(line) - GENERATE_KEYS
    if unknown:
        raise ValueError(f"unsupported field(s): {', '.join(sorted(unknown))}")
    prompt = line.get("prompt")
    if not isinstance(prompt, (str, list)):
        raise ValueError("'prompt' must be a string or a list of token ids")
    stop = line.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    bias = line.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise ValueError("'logit_bias' must be an object of token id -> bias")
    params = SamplingParams(
        **{k: conv(line[k]) for k, conv in _SCALAR_FIELDS.items() if line.get(k) is not None},
        seed=line.get("seed"), stop=stop, stop_token_ids=tuple(int(t) for t in line.get("stop_token_ids") or ()),
        logit_bias=tuple((int(t), float(b)) for t, b in bias.items()), logprobs=line.get("logprobs"))
    model = line.get("model")
    adapter = None if model is None or model in base_names else str(model)
    return prompt, params, adapter


def cmd_generate(a: argparse.Namespace) -> int:
    from engine import LLMEngine

    config = build_engine_config(a)
    with LLMEngine(demo_config(config) if is_demo(a.model) else config, progress=False) as engine:
        return _generate(engine, a)


def _generate(engine: Any, a: argparse.Namespace) -> int:
    from engine import RequestError

    base_names = {*engine.base_names, a.model}
    lines: list[dict[str, Any]] = []
    with open(a.requests) as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError as e:
                lines.append({"__error__": f"line {n}: invalid JSON ({e})"})
    results: list[dict[str, Any] | None] = [None] * len(lines)
    rid_to_index: dict[str, int] = {}
    for i, line in enumerate(lines):
        rid = f"req-{i}"
        try:
            if "__error__" in line:
                raise ValueError(line["__error__"])
            prompt, params, adapter = _line_request(line, base_names)
            engine.add_request(rid, prompt, params, lora_name=adapter)
            rid_to_index[rid] = i
            results[i] = {"text": "", "token_ids": [], "finish_reason": None}
            if params.logprobs is not None:
                results[i]["logprobs"] = []
        except (ValueError, TypeError, RequestError) as e:
            results[i] = {"text": "", "token_ids": [], "finish_reason": "error", "error": str(e)}
    tok = engine.tokenizer
    while engine.has_unfinished():
        for out in engine.step():
            r = results[rid_to_index[out.request_id]]
            assert r is not None
            r["text"] += out.new_text
            r["token_ids"].extend(out.new_token_ids)
            if "logprobs" in r and out.new_logprobs:
                r["logprobs"].extend({
                    "token_id": lp.token_id, "token": tok.decode([lp.token_id]), "logprob": lp.logprob,
                    "top_logprobs": [{"token_id": t, "token": tok.decode([t]), "logprob": v} for t, v in lp.top]}
                    for lp in out.new_logprobs)
            if out.finished:
                r["finish_reason"] = out.finish_reason
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if a.output:
        Path(a.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


# -- main ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser(argv).parse_args(argv)  # --help, --version and bad flags end here, before any engine import
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if a.command in ("serve", "generate"):
        if a.model is None:
            a.model = str(DEMO_MODEL)  # no model at all: the demo (demo_config adds its adapters and lora root)
        elif not (Path(a.model) / "config.json").is_file():  # a bad path is an error, never the demo
            what = "does not exist" if not Path(a.model).exists() else "is not a model folder (no config.json)"
            print(f"xpulora: model {a.model!r} {what}", file=sys.stderr)
            return 2
    if a.command == "serve" and a.api_key is None:
        a.api_key = os.environ.get("XPULORA_API_KEY") or None
    from engine import DEVICE_CHOICES, ConfigError

    if a.device not in DEVICE_CHOICES:  # the parser takes any name: only the engine's device module knows them
        print(f"xpulora: --device {a.device!r} is not one of {', '.join(DEVICE_CHOICES)}", file=sys.stderr)
        return 2

    try:
        if a.command == "generate":
            return cmd_generate(a)
        if a.command == "serve":
            from server.app import run_server

            return run_server(a, build_engine_config(a))
        if a.command == "check-device":
            from engine import check_device

            report = check_device(a.device, a.dtype, kernel_config(a))
            print(report.table())
            return 0 if report.ok else 1
        from server.quantize import run_quantize

        return run_quantize(a)
    except ConfigError as e:
        print(f"xpulora: configuration error: {e}", file=sys.stderr)
        return 2
