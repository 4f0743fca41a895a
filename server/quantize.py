"""`xpulora quantize SRC OUT`: make the int4 AutoRound checkpoint this engine serves from a 16-bit
Hugging Face Qwen folder.

auto-round is the optional `quantize` extra (`pip install 'xpulora[quantize]'`); it is imported only
inside this command (it drags datasets and pandas, seconds of import time the server must not pay).

What is written: W4A16 (4-bit int weights, 16-bit activations), one scale (and for --asym one zero
point) per `--group-size` inputs, format `auto_round` (symmetric packs as `auto_round:auto_gptq`,
GPTQ v1 zeros; asymmetric as `auto_round:gptqmodel`, v2 zeros), decoder linears only (embeddings,
lm_head and norms stay 16-bit), tokenizer and generation config copied. OUT is a flat folder
(config.json at its top), written next to OUT first and moved into place only when complete, so a
failed run leaves no half checkpoint.

`--iters 0` (the default) is plain round-to-nearest: no calibration data, seconds for a tiny model,
and the CPU is enough. `--iters N` runs auto-round's sign-gradient tuning (better accuracy; needs
calibration text and is best run on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SERVED_PACKINGS = ("auto_round:auto_gptq", "auto_round", "auto_round:gptqmodel")
QWEN_TYPES = ("qwen2", "qwen3", "qwen3_5", "qwen3_5_text")


class QuantizeError(Exception):
    """A problem the user can fix; the message says what and how."""


def _say(msg: str) -> None:
    print(f"xpulora quantize: {msg}", file=sys.stderr, flush=True)


def _check_src(src: str) -> dict[str, Any] | None:
    """config.json of a local SRC (None for a hub id, checked by transformers when it downloads)."""
    path = Path(src)
    if not path.exists():
        if src.count("/") == 1 and not src.startswith((".", "/")):
            return None  # a hub id such as Qwen/Qwen3-8B
        raise QuantizeError(f"SRC {src} does not exist (give a Hugging Face model folder or a hub id)")
    if not path.is_dir():
        raise QuantizeError(f"SRC {src} is not a folder")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise QuantizeError(f"SRC {src} has no config.json (expected a Hugging Face model folder)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise QuantizeError(f"{cfg_path}: invalid JSON ({e})") from e
    if not any(path.glob("*.safetensors")):
        raise QuantizeError(f"SRC {src} has no *.safetensors weights")
    return cfg


def _check_config(cfg: dict[str, Any], src: str) -> None:
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    if qc:
        raise QuantizeError(f"SRC {src} is already quantized (quant_method {qc.get('quant_method')!r}); "
                            "start from the 16-bit (bf16/fp16) checkpoint")
    mt = str(cfg.get("model_type", ""))
    if mt not in QWEN_TYPES:
        _say(f"warning: model_type {mt!r} is not one this engine serves ({', '.join(QWEN_TYPES)}); "
             "quantizing anyway")


def _prepare_out(out: str, overwrite: bool) -> Path:
    path = Path(out)
    if path.exists():
        if not path.is_dir():
            raise QuantizeError(f"OUT {out} exists and is not a folder")
        if any(path.iterdir()) and not overwrite:
            raise QuantizeError(f"OUT {out} exists and is not empty; choose a new folder or pass --overwrite")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _device_map(device: str) -> str | int:
    """auto-round's device_map for --device: auto is auto-round's own default (0: the first accelerator
    torch reports, else the CPU); an explicit kind is passed through."""
    return 0 if device == "auto" else device


def flatten_output(tmp: Path) -> Path:
    """The folder that holds the checkpoint: auto-round writes an in-memory model into
    tmp/<name>-w4g128/ rather than tmp/ itself."""
    if (tmp / "config.json").is_file():
        return tmp
    inner = [d for d in tmp.iterdir() if d.is_dir() and (d / "config.json").is_file()]
    if len(inner) != 1:
        raise QuantizeError(f"auto-round wrote no single checkpoint folder under {tmp}: "
                            f"{sorted(p.name for p in tmp.iterdir())}")
    return inner[0]


def export_format(sym: bool) -> str:
    """auto-round's export format. Symmetric: `auto_round`, which packs as `auto_round:auto_gptq`
    (GPTQ v1 zeros, the common case). Asymmetric: plain `auto_round` would pack as AWQ
    (`auto_round:auto_awq`), which this engine does not serve, so ask for the GPTQModel packing
    (`auto_round:gptqmodel`, v2 zeros), which it serves and transformers + auto-round load."""
    return "auto_round" if sym else "auto_round:gptqmodel"


def _algorithm(bits: int, group_size: int, sym: bool, iters: int) -> Any:
    if iters == 0:
        from auto_round.algorithms.quantization.rtn.config import RTNConfig

        return RTNConfig(bits=bits, group_size=group_size, sym=sym, disable_opt_rtn=True)
    from auto_round.algorithms.quantization.sign_round.config import SignRoundConfig

    return SignRoundConfig(iters=iters, bits=bits, group_size=group_size, sym=sym)


def _dataset(spec: str | None) -> Any:
    """A local text file becomes a list of strings (one per non-empty paragraph); anything else is
    passed to auto-round, which treats it as a hub dataset name."""
    if spec is None or not os.path.isfile(spec):
        return spec
    text = Path(spec).read_text(encoding="utf-8")
    parts = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not parts:
        raise QuantizeError(f"--dataset {spec}: the file holds no text")
    return parts


def quantize_folder(src: str, out: str, *, bits: int = 4, group_size: int = 128, sym: bool = True, iters: int = 0,
                    dataset: str | None = None, nsamples: int = 128, seqlen: int = 2048, device: str = "auto",
                    overwrite: bool = False) -> Path:
    """Quantize the model at src into the flat folder out; returns out."""
    if bits != 4:
        raise QuantizeError(f"--bits {bits}: the engine serves 4-bit weights only")
    if iters < 0 or nsamples < 1 or seqlen < 1:
        raise QuantizeError("--iters must be >= 0, --nsamples and --seqlen >= 1")
    cfg = _check_src(src)
    if cfg is not None:
        _check_config(cfg, src)
    out_path = _prepare_out(out, overwrite)
    device_map = _device_map(device)
    try:
        import auto_round  # noqa: F401  (fail early, before loading a large model)
    except ImportError as e:
        raise QuantizeError("auto-round is not installed; install the optional extra: "
                            "pip install 'xpulora[quantize]'") from e
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mode = "round-to-nearest, no calibration data" if iters == 0 else f"{iters} tuning iterations per block"
    _say(f"[1/3] loading {src}")
    t0 = time.monotonic()
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval()
        tokenizer = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise QuantizeError(f"transformers cannot load {src}: {e}") from e
    if cfg is None:  # a hub id: now that its config is here, apply the same checks as for a folder
        _check_config(model.config.to_dict(), src)
    where = "the first accelerator, else the CPU" if device == "auto" else device
    _say(f"[2/3] quantizing {type(model).__name__} to int{bits} group {group_size} "
         f"{'sym' if sym else 'asym'} ({mode}) on {where}")
    kwargs: dict[str, Any] = {}
    if iters > 0:
        kwargs.update(nsamples=nsamples, seqlen=seqlen)
        if dataset is not None:
            kwargs["dataset"] = _dataset(dataset)
    ar = AutoRound(model, tokenizer, scheme="W4A16", alg_configs=_algorithm(bits, group_size, sym, iters),
                   device_map=device_map, **kwargs)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        ar.quantize_and_save(str(tmp), format=export_format(sym))
        written = flatten_output(tmp)
        _say(f"[3/3] checking the written checkpoint and moving it to {out}")
        _check_written(written)
        _readable(written)
        if out_path.exists():
            shutil.rmtree(out_path)
        shutil.move(str(written), str(out_path))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in out_path.glob("*.safetensors"))
    _say(f"done in {time.monotonic() - t0:.0f} s: {out} ({size / 2**20:.1f} MiB of weights); "
         f"serve it with: xpulora serve {out}")
    return out_path


def _readable(folder: Path) -> None:
    """Ordinary permissions (the temporary folder is 0700 and auto-round writes weights 0600, which a
    server running as another user, as in the Docker image, could not read)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def _check_written(folder: Path) -> None:
    """What the engine needs from the written config (catches an auto-round change early)."""
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    fmt = qc.get("packing_format")
    if str(qc.get("quant_method", "")).replace("_", "-") != "auto-round" or fmt not in SERVED_PACKINGS:
        raise QuantizeError(f"auto-round wrote quantization_config {qc!r}, which this engine does not serve")
    if not any(folder.glob("*.safetensors")):
        raise QuantizeError(f"auto-round wrote no *.safetensors into {folder}")


def run_quantize(args: argparse.Namespace) -> int:
    try:
        quantize_folder(args.src, args.out, bits=args.bits, group_size=args.group_size, sym=args.sym,
                        iters=args.iters, dataset=args.dataset, nsamples=args.nsamples, seqlen=args.seqlen,
                        device=args.device, overwrite=args.overwrite)
    except QuantizeError as e:
        _say(f"error: {e}")
        return 2
    return 0
