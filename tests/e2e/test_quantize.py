"""`xpulora quantize SRC OUT` as a user runs it: a real subprocess on a tiny bf16 Qwen3, then the
folder it wrote served by `xpulora generate` (another subprocess) and loaded by transformers +
auto-round (the independent int4 oracle), with equal greedy outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.helpers import prompts
from tests.oracle import hf_greedy
from tools.tinymodels import load_transformers_fp32

MAX_NEW = 8


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli_main", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def bf16_model(model_factory) -> str:
    return model_factory("qwen3", None, False)


def test_quantize_writes_a_flat_folder_that_generate_serves_like_transformers(bf16_model: str,
                                                                            tmp_path: Path) -> None:
    out = tmp_path / "models" / "tiny-qwen3-int4"  # its parent does not exist yet
    proc = _cli("quantize", bf16_model, str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # A progress bar over the decoder blocks (auto-round's), and our stage lines.
    assert "Quantizing model.layers.1" in proc.stderr and "100%" in proc.stderr, proc.stderr[-2000:]
    assert f"[3/3] checking the written checkpoint and moving it to {out}" in proc.stderr and f"xpulora serve {out}" in proc.stderr
    # Flat: the checkpoint is OUT itself, not OUT/<name>-w4g128/; no temporary folder is left beside it.
    names = sorted(p.name for p in out.iterdir())
    assert not [p for p in out.iterdir() if p.is_dir()], names
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["packing_format"], qc["bits"], qc["group_size"], qc["sym"]) == (
        "auto-round", "auto_round:auto_gptq", 4, 128, True)

    ps = prompts(4, seed=11, min_words=2, max_words=12)
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt": p, "max_tokens": MAX_NEW, "temperature": 0}) + "\n"
                                for p in ps))
    gen = _cli("generate", str(out), "--requests", str(requests), "--max-model-len", "128")
    assert gen.returncode == 0, gen.stderr[-3000:]
    results = [json.loads(line) for line in gen.stdout.splitlines()]
    assert len(results) == len(ps)

    tok = AutoTokenizer.from_pretrained(str(out))
    hf = load_transformers_fp32(str(out))  # transformers + auto-round's QuantLinear, float32
    for p, r in zip(ps, results):
        assert r["finish_reason"] in ("length", "stop"), r
        ours = r["token_ids"]
        ref = hf_greedy(hf, tok.encode(p), MAX_NEW)
        if r["finish_reason"] == "length":
            assert ours == ref, (p, ours, ref)
        else:  # stopped at an eos: the same tokens up to it
            assert ours and ref[: len(ours)] == ours and ours[-1] == tok.eos_token_id, (p, ours, ref)


def test_quantize_refuses_before_any_work(bf16_model: str, tmp_path: Path) -> None:
    from server.quantize import QuantizeError, quantize_folder

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    with pytest.raises(QuantizeError, match="exists and is not empty; choose a new folder or pass --overwrite"):
        quantize_folder(bf16_model, str(busy))
    assert (busy / "keep.txt").read_text() == "x"
    with pytest.raises(QuantizeError, match=r"has no config\.json"):
        quantize_folder(str(busy), str(tmp_path / "o1"))
    with pytest.raises(QuantizeError, match="does not exist"):
        quantize_folder(str(tmp_path / "missing" / "model"), str(tmp_path / "o2"))
    quantized = tmp_path / "already"
    quantized.mkdir()
    cfg = json.loads((Path(bf16_model) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "auto-round", "bits": 4}
    (quantized / "config.json").write_text(json.dumps(cfg))
    (quantized / "model.safetensors").write_bytes(b"")
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_folder(str(quantized), str(tmp_path / "o3"))
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()
    # The CLI reports the same as a one-line error and exit status 2, without a traceback.
    proc = _cli("quantize", bf16_model, str(busy))
    assert proc.returncode == 2 and "xpulora quantize: error: OUT" in proc.stderr and "Traceback" not in proc.stderr


def test_asym_writes_a_packing_the_engine_serves(tmp_path: Path) -> None:
    """auto-round's default asymmetric export is AWQ-packed (not served); --asym must write the
    GPTQModel packing (v2 zeros) instead, and the engine must match transformers + auto-round on it."""
    from engine import SamplingParams
    from server.quantize import quantize_folder
    from tests.helpers import make_engine
    from tools.tinymodels import make_model

    src = make_model(str(tmp_path / "bf16"), "qwen3", tie=True, layers=1, seed=3)
    out = quantize_folder(src, str(tmp_path / "int4-asym"), sym=False, device="cpu")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["packing_format"], qc["sym"]) == ("auto_round:gptqmodel", False)
    engine = make_engine(str(out), max_model_len=128)
    results = engine.generate(prompts(3, seed=5, min_words=2, max_words=10),
                              SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    hf = load_transformers_fp32(str(out))
    for r in results:
        assert r.token_ids == hf_greedy(hf, r.prompt_token_ids, MAX_NEW), r.prompt_token_ids
