"""The `xpulora` command: serve, generate, quantize.

Engine flags are shared by serve and generate; `--config FILE.yaml` supplies defaults for them
(keys are the flag names with dashes or underscores) and flags given on the command line win.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from engine import (
    DEVICE_CHOICES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SamplingParams,
    SchedulerConfig,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO_ROOT / "demo" / "model"
DEMO_ADAPTERS = REPO_ROOT / "demo" / "adapters"


def _lora_module(s: str) -> tuple[str, str]:
    name, sep, path = s.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules expects NAME=PATH, got {s!r}")
    return name, path


def engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--config", metavar="FILE.yaml", help="preset with defaults for these flags (flags win)")
    g.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="device kind (auto: xpu, then cuda, then cpu)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="activation dtype (auto: float32 on the CPU, bfloat16 on GPUs)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks that shard every layer")
    g.add_argument("--max-model-len", type=int, default=None, help="max prompt + output tokens")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: sized from memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of device memory to use")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                   help="reuse the KV of prompt prefixes computed under the same adapter (on by default)")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn prefix caching off")
    g.add_argument("--seed", type=int, default=0, help="seed of the global RNG")
    g.add_argument("--served-model-name", default=None, help="name of the base model in the API")
    g.add_argument("--enforce-eager", action="store_true", help="disable graph capture")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    g.add_argument("--max-loras", type=int, default=4, help="adapters per step (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank accepted")
    g.add_argument("--max-cpu-loras", type=int, default=None, help="adapters cached in host memory")
    g.add_argument("--fully-sharded-loras", action="store_true", help="shard LoRA A/B over TP ranks too")
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                   help="adapters to load at start")
    g.add_argument("--lora-root", nargs="+", action="extend", default=[], metavar="DIR",
                   help="folders runtime adapter loads may read from")
    g.add_argument("--no-lora-autoload", action="store_true",
                   help="do not load an adapter from a lora root on its first request")


def apply_config_file(p: argparse.ArgumentParser, argv: list[str]) -> None:
    """Set parser defaults from --config FILE.yaml, so that flags given on the command line win.

    Keys are flag names with dashes or underscores (`max-loras`, `max_loras`); `model` is the
    positional. Values are checked like command-line values (type, choices, on/off flags as
    booleans, lists for multi-value flags); an unknown key or a bad value fails naming the key.
    Relative paths are taken relative to the working directory, as on the command line.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return
    try:
        with open(known.config) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        p.error(f"--config {known.config}: cannot read it ({e.strerror or e})")
    except yaml.YAMLError as e:
        p.error(f"--config {known.config}: not valid YAML ({e})")
    data = {} if data is None else data
    if not isinstance(data, dict):
        p.error(f"{known.config}: expected a mapping of flag names to values")
    actions = {a.dest: a for a in p._actions if a.dest not in ("help", "config")}
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        action = actions.get(dest)
        if action is None:
            p.error(f"{known.config}: unknown key {key!r} (keys are the flag names of xpulora {p.prog.split()[-1]})")
        if _on_command_line(action, argv):
            continue  # the command line wins (matters for flags that accumulate, like --lora-root)
        try:
            defaults[dest] = _config_value(action, value)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            p.error(f"{known.config}: key {key!r}: {e}")
    p.set_defaults(**defaults)


def _on_command_line(action: argparse.Action, argv: list[str]) -> bool:
    """Whether this option is given in argv (exactly, as --opt=value, or as an unambiguous prefix)."""
    for tok in argv:
        if tok == "--":
            break
        name = tok.split("=", 1)[0]
        if name.startswith("--") and len(name) > 2 and any(o.startswith(name) for o in action.option_strings):
            return True
    return False


def _config_value(action: argparse.Action, value: Any) -> Any:
    """A YAML value converted and checked as argparse would check the same value given as a flag."""
    if action.nargs == 0:  # --enable-lora, --enforce-eager, ...
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {value!r}")
        return value  # the key names the destination, so `no_lora_autoload: true` sets it
    if value is None:
        return None
    if action.nargs in ("+", "*"):
        if isinstance(value, dict) and action.dest == "lora_modules":
            value = [f"{k}={v}" for k, v in value.items()]
        items = value if isinstance(value, list) else [value]
        return [_config_scalar(action, v) for v in items]
    return _config_scalar(action, value)


def _config_scalar(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, (list, dict)):
        raise TypeError(f"expected a single value, got {value!r}")
    conv = action.type
    if conv in (int, float):
        kinds = (int, str) if conv is int else (int, float, str)
        what = "an integer" if conv is int else "a number"
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise TypeError(f"expected {what}, got {value!r}")
        try:
            value = conv(value)
        except ValueError:
            raise ValueError(f"expected {what}, got {value!r}") from None
    elif conv is not None:
        value = conv(str(value))
    elif not isinstance(value, str):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a string, got {value!r}")
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def build_engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(a.model, dtype=a.dtype, max_model_len=a.max_model_len,
                          served_model_name=a.served_model_name),
        cache=CacheConfig(block_size=a.block_size, num_blocks=a.num_kv_blocks,
                          gpu_memory_utilization=a.gpu_memory_utilization,
                          enable_prefix_caching=a.enable_prefix_caching),
        parallel=ParallelConfig(tensor_parallel_size=a.tensor_parallel_size, device=a.device),
        lora=LoRAConfig(enable_lora=a.enable_lora, max_loras=a.max_loras, max_lora_rank=a.max_lora_rank,
                        max_cpu_loras=a.max_cpu_loras, fully_sharded_loras=a.fully_sharded_loras,
                        lora_modules=tuple(tuple(m) for m in a.lora_modules),
                        lora_roots=tuple(a.lora_root), lora_autoload=not a.no_lora_autoload),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens),
        seed=a.seed, enforce_eager=a.enforce_eager)


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
GENERATE_KEYS = {"prompt", "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs"}


def _line_request(line: dict[str, Any], base_names: set[str]) -> tuple[str | list[int], SamplingParams, str | None]:
    unknown = set(line) - GENERATE_KEYS
    if unknown:
        raise ValueError(f"unsupported field(s): {', '.join(sorted(unknown))}")
    prompt = line.get("prompt")
    if not isinstance(prompt, (str, list)):
        raise ValueError("'prompt' must be a string or a list of token ids")
    stop = line.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    params = SamplingParams(
        max_tokens=line.get("max_tokens", 16), temperature=float(line.get("temperature", 1.0)),
        top_p=float(line.get("top_p", 1.0)), top_k=int(line.get("top_k", -1)), seed=line.get("seed"),
        stop=stop, logprobs=line.get("logprobs"))
    model = line.get("model")
    adapter = None if model is None or model in base_names else str(model)
    return prompt, params, adapter


def cmd_generate(a: argparse.Namespace) -> int:
    from engine import LLMEngine

    config = build_engine_config(a)
    with LLMEngine(demo_config(config) if is_demo(a.model) else config, progress=False) as engine:
        return _generate(engine, a)


def _generate(engine: Any, a: argparse.Namespace) -> int:
    from engine.protocol import RequestError

    base_names = {engine.served_model_name, a.model}
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
def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xpulora", description="Serve many LoRA adapters on one int4 Qwen model")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None, help="model folder (default: the bundled demo model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("XPULORA_API_KEY"), help="require Bearer KEY on /v1/*")
    serve.add_argument("--max-waiting-requests", type=int, default=None, help="503 beyond this many waiting")
    engine_flags(serve)
    gen = sub.add_parser("generate", help="offline batch generation from a JSONL file")
    gen.add_argument("model", nargs="?", default=None, help="model folder (default: the bundled demo model)")
    gen.add_argument("--requests", required=True, help="input JSONL: one request per line")
    gen.add_argument("--output", default=None, help="output JSONL (default: stdout)")
    engine_flags(gen)
    q = sub.add_parser("quantize", help="quantize a 16-bit Hugging Face Qwen folder to int4 with auto-round",
                       description="Write the int4 AutoRound checkpoint this engine serves (W4A16, format "
                                   "auto_round; symmetric packs as auto_round:auto_gptq, asymmetric as "
                                   "auto_round:gptqmodel) into a flat folder OUT. "
                                   "Needs the optional extra: pip install 'xpulora[quantize]'.")
    q.add_argument("src", metavar="SRC", help="16-bit Hugging Face model folder (or a hub id)")
    q.add_argument("out", metavar="OUT", help="output folder (must not exist or be empty, unless --overwrite)")
    q.add_argument("--bits", type=int, default=4, choices=[4], help="weight bits (the engine serves 4)")
    q.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128, 256],
                   help="input features per scale / zero point")
    sym = q.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=True,
                     help="symmetric int4 (default; packed as auto_round:auto_gptq)")
    sym.add_argument("--asym", dest="sym", action="store_false",
                     help="asymmetric int4, a zero point per group (packed as auto_round:gptqmodel)")
    q.add_argument("--iters", type=int, default=0,
                   help="auto-round tuning iterations per block (0: round-to-nearest, no calibration data; "
                        "200 is auto-round's default tuning and needs --dataset or network access)")
    q.add_argument("--dataset", default=None,
                   help="calibration data for --iters > 0: a hub dataset name or a local text file "
                        "(default: auto-round's, NeelNanda/pile-10k)")
    q.add_argument("--nsamples", type=int, default=128, help="calibration samples for --iters > 0")
    q.add_argument("--seqlen", type=int, default=2048, help="calibration sequence length for --iters > 0")
    q.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="where auto-round computes (auto: xpu, then cuda, then cpu)")
    q.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    if len(argv) >= 1 and argv[0] in ("serve", "generate"):
        apply_config_file(serve if argv[0] == "serve" else gen, argv[1:])
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    a = build_parser(argv).parse_args(argv)
    try:
        if a.command in ("serve", "generate") and a.model is None:
            a.model = str(DEMO_MODEL)  # demo_config adds the demo's adapters and lora root
        if a.command == "generate":
            return cmd_generate(a)
        if a.command == "serve":
            from server.app import run_server

            return run_server(a, build_engine_config(a))
        from server.quantize import run_quantize

        return run_quantize(a)
    except ConfigError as e:
        print(f"xpulora: configuration error: {e}", file=sys.stderr)
        return 2
