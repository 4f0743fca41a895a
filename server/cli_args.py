"""The `xpulora` command line: parsers and `--config` presets. Imports nothing heavy (no torch, no
engine), so that `xpulora --help` and `--version` answer at once and a bad flag fails before the
engine is imported; server/cli.py imports the engine only once the command line is valid.

Engine flags are shared by serve and generate; `--config FILE.yaml` supplies defaults for them
(keys are the flag names with dashes or underscores) and flags given on the command line win.
Flags that vLLM has use vLLM's names and forms (`-tp`, `--model`, several `--served-model-name`,
JSON `--lora-modules`); `--lora-root` takes one folder per flag, so it can never swallow the model.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
# The bundled demo lies beside the packages in a checkout; an installed wheel (the Docker image) has none
# beside it, and XPULORA_DEMO_DIR says where it is.
DEMO_DIR = Path(os.environ.get("XPULORA_DEMO_DIR") or REPO_ROOT / "demo")
DEMO_MODEL = DEMO_DIR / "model"
DEMO_ADAPTERS = DEMO_DIR / "adapters"
# --device takes any name here; server/cli.py checks it against the engine's device module once the engine is
# imported (that module is the one that knows the kinds, and importing it here would import torch for --help).
DEVICE_HELP = "device kind: auto (an Intel GPU, then an NVIDIA GPU, then the CPU) or one kind by name (README, flags)"
try:
    VERSION = importlib.metadata.version("xpulora")
except importlib.metadata.PackageNotFoundError:  # running from a checkout that was never installed
    VERSION = "0+unknown"


class _Formatter(argparse.HelpFormatter):
    """Help lines end with the default, except where there is none to show (None, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        if d in (None, False, [], ()) or d is argparse.SUPPRESS or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


class LoraModule(tuple):
    """(name, path), with vLLM's optional base_model_name beside it (checked against the served names
    once they are known, in build_engine_config)."""

    base_model_name: str | None

    def __new__(cls, name: str, path: str, base_model_name: str | None = None) -> LoraModule:
        obj = super().__new__(cls, (name, path))
        obj.base_model_name = base_model_name
        return obj


def _lora_module(s: str) -> LoraModule:
    """`NAME=PATH` or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if s.lstrip().startswith("{"):
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON {s!r} ({e})") from None
        unknown = set(obj) - {"name", "path", "base_model_name"}
        if unknown:
            keys = ", ".join(sorted(unknown))
            raise argparse.ArgumentTypeError(f"--lora-modules: unsupported key(s) {keys} in {s!r}")
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise argparse.ArgumentTypeError(f"--lora-modules: JSON form needs string 'name' and 'path', got {s!r}")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError(f"--lora-modules: 'base_model_name' must be a string, got {s!r}")
        return LoraModule(name, path, base)
    name, sep, path = s.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules expects NAME=PATH, got {s!r} (or JSON: "
                                         '{"name": ..., "path": ..., "base_model_name": ...})')
    return LoraModule(name, path)


class _Model(argparse.Action):
    """MODEL and --model write the same destination; giving two different models is an error. A
    value identical to the default is the positional left out (argparse calls the action anyway)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values is None or values is self.default:
            return
        given = getattr(namespace, "_model_given", None)
        if given is not None and given != values:
            parser.error(f"two models given: {given!r} and {values!r} (give MODEL or --model, once)")
        namespace._model_given = values
        namespace.model = values


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, action=_Model, metavar="MODEL",
                   help="model folder (default: the bundled demo model and adapters on the CPU)")
    p.add_argument("--model", dest="model", default=None, action=_Model, metavar="MODEL",
                   help="the same as MODEL (vLLM's form)")


def engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--config", metavar="FILE.yaml", help="preset with defaults for these flags (flags win)")
    g.add_argument("--device", default="auto", metavar="DEVICE", help=DEVICE_HELP)
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="activation dtype (auto: float32 on the CPU, bfloat16 on GPUs)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks that shard every layer")
    g.add_argument("--max-model-len", type=int, default=None, help="max prompt + output tokens")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: --max-mixed-graph-tokens, at least --max-num-seqs, where "
                        "mixed-step graphs run: no step runs eagerly; else 2048)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: sized from memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of device memory to use")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                   help="reuse the KV of prompt prefixes computed under the same adapter")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn prefix caching off%(default).0s")  # (no default shown: it is the same dest)
    g.add_argument("--seed", type=int, default=0, help="seed of the global RNG")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names of the base model in the API: the first is reported, all are accepted "
                        "(default: the folder name)")
    g.add_argument("--enforce-eager", action="store_true", help="disable graph capture")
    g.add_argument("--no-mixed-graphs", dest="mixed_graphs", action="store_false",
                   help="run steps that hold a prefill chunk eagerly (default: captured as graphs)")
    g.add_argument("--max-mixed-graph-tokens", type=int, default=2048,
                   help="the largest step that holds a prefill chunk to capture as a graph (16-4096; the default "
                        "--max-num-batched-tokens follows it)")
    g.add_argument("--async-scheduling", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="launch each step before the previous one's tokens are read back (auto: on GPUs at tensor "
                        "parallel size 1; the flag alone means on)")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    g.add_argument("--max-loras", type=int, default=4, help="adapters per step (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank accepted")
    g.add_argument("--max-cpu-loras", type=int, default=None, help="adapters cached in host memory")
    g.add_argument("--fully-sharded-loras", action="store_true", help="shard LoRA A/B over TP ranks too")
    g.add_argument("--lora-dtype", choices=("auto", "bfloat16", "float16", "float32", "fp8"), default="auto",
                   help="adapter weights in the device slots: auto (the model dtype; float32 on the CPU), a float "
                        "dtype, or fp8 (e4m3 with a scale per row: half the bytes of bf16)")
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH|JSON",
                   help='adapters to load at start: NAME=PATH or {"name": ..., "path": ..., "base_model_name": ...}')
    g.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                   help="a folder runtime adapter loads may read from (repeat the flag for several)")
    g.add_argument("--no-lora-autoload", action="store_true",
                   help="do not load an adapter from a lora root on its first request")
    _kernel_flags(g)


def _kernel_flags(g: Any) -> None:
    """engine.config.KernelConfig, one flag per op (docs/kernels.md)."""
    g.add_argument("--lora-kernel", choices=("auto", "triton", "reference"), default="auto",
                   help="batched LoRA kernels: auto (Triton on GPUs, torch on the CPU), triton or reference; "
                        "Triton is checked against the reference at start-up and replaced by it if it fails")
    g.add_argument("--attention-kernel", choices=("auto", "triton", "reference"), default="auto",
                   help="paged attention and KV write: auto (Triton on GPUs, torch on the CPU)")
    g.add_argument("--fused-kernel", choices=("auto", "triton", "reference"), default="auto",
                   help="norms, rotary, silu-and-mul: auto (Triton on GPUs, torch on the CPU)")
    g.add_argument("--gdn-kernel", choices=("auto", "fla", "triton", "reference"), default="auto",
                   help="Gated DeltaNet (Qwen3.5 hybrids): auto (fla-core on GPUs when installed, else triton: our "
                        "decode kernel with torch for prompts; torch on the CPU)")
    g.add_argument("--int4-kernel", default="auto",
                   choices=("auto", "tuned", "reference", "triton", "triton_mma", "triton_gemv", "cuda_mma",
                            "native_cpu", "native_cuda", "native_xpu", "auto:native_cuda", "auto:native_xpu"),
                   help="int4 GEMM: auto (tuned on GPUs, the reference on the CPU), tuned (the fastest checked kernel "
                        "per layer shape and row count, timed at start-up or read from the cache in "
                        "$XPULORA_KERNEL_CACHE_DIR), or one backend for every row count")


def apply_config_file(p: argparse.ArgumentParser, argv: list[str]) -> None:
    """Set parser defaults from --config FILE.yaml, so that flags given on the command line win.

    Keys are flag names with dashes or underscores (`max-loras`, `max_loras`); `model` is the
    model. Values are checked like command-line values (type, choices, on/off flags as booleans,
    lists for multi-value and repeatable flags); an unknown key or a bad value fails naming the key.
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
    actions = {a.dest: a for a in p._actions if a.dest not in ("help", "config") and a.option_strings}
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
        if name in action.option_strings:  # a short form such as -tp
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
    if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
        if isinstance(value, dict) and action.dest == "lora_modules":
            value = [f"{k}={v}" for k, v in value.items()]
        items = value if isinstance(value, list) else [value]
        if action.dest == "lora_modules":  # vLLM's JSON form written as a YAML mapping
            items = [json.dumps(v) if isinstance(v, dict) else v for v in items]
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


def _quantize_parser(sub: Any) -> None:
    q = sub.add_parser("quantize", help="quantize a 16-bit Hugging Face Qwen folder to int4 with auto-round",
                       formatter_class=_Formatter,
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
    q.add_argument("--device", default="auto", metavar="DEVICE", help=f"where auto-round computes; {DEVICE_HELP}")
    q.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xpulora", description="Serve many LoRA adapters on one int4 Qwen model",
                                formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"xpulora {VERSION}")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server", formatter_class=_Formatter)
    _model_args(serve)
    # XPULORA_HOST: the Docker image sets 0.0.0.0, so that any flags after the image name keep it reachable.
    serve.add_argument("--host", default=os.environ.get("XPULORA_HOST") or "127.0.0.1",
                       help="address to listen on (default: $XPULORA_HOST, else 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port")
    serve.add_argument("--api-key", default=None,
                       help="require Bearer KEY on /v1/*, /tokenize and /detokenize (default: $XPULORA_API_KEY)")
    serve.add_argument("--max-waiting-requests", type=int, default=None, help="503 beyond this many waiting")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto": parse the tool calls the model writes (needs --tool-call-parser)')
    serve.add_argument("--tool-call-parser", choices=["hermes"], default=None,
                       help="tool-call format: hermes (Qwen's <tool_call>{...}</tool_call>)")
    serve.add_argument("--reasoning-parser", choices=["qwen3"], default=None,
                       help="put the <think>...</think> text in reasoning_content")
    engine_flags(serve)
    gen = sub.add_parser("generate", help="offline batch generation from a JSONL file", formatter_class=_Formatter)
    _model_args(gen)
    gen.add_argument("--requests", required=True, help="input JSONL: one request per line")
    gen.add_argument("--output", default=None, help="output JSONL (default: stdout)")
    engine_flags(gen)
    _quantize_parser(sub)
    chk = sub.add_parser("check-device", help="check the fast kernels against their torch references on this device "
                         "and print the table (exit 1 if one fails)", formatter_class=_Formatter)
    chk.add_argument("--device", default="auto", metavar="DEVICE", help=f"device to check; {DEVICE_HELP}")
    chk.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                     help="compute dtype (auto: bfloat16 on GPUs, float32 on the CPU)")
    _kernel_flags(chk)  # the candidates to check (triton on the CPU: under TRITON_INTERPRET=1)
    if len(argv) >= 1 and argv[0] in ("serve", "generate"):
        apply_config_file(serve if argv[0] == "serve" else gen, argv[1:])
    return p
