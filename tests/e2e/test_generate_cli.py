"""`xpulora generate` as a user runs it: a real subprocess, JSONL in, JSONL out in input order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine import SamplingParams
from tests.helpers import make_engine


def _run(model: str, lines: list[str], tmp: Path, *flags: str) -> list[dict]:
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "server.cli_main", "generate", model, "--requests", str(inp), "--output", str(out),
           *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_generate_outputs_and_per_request_errors(model_factory, tmp_path: Path) -> None:
    model = model_factory("qwen3", "auto_round", True)
    good = ["hello world", "the quick brown fox jumps", "café 你好"]
    lines = [
        json.dumps({"prompt": good[0], "max_tokens": 6, "temperature": 0}),
        json.dumps({"prompt": "", "max_tokens": 6}),
        json.dumps({"prompt": good[1], "max_tokens": 0}),
        json.dumps({"prompt": "word " * 100, "max_tokens": 4}),
        json.dumps({"prompt": good[1], "max_tokens": 5, "temperature": 0, "logprobs": 2}),
        "{not json",
        json.dumps({"prompt": good[2], "max_tokens": 3, "temperature": 0.7, "seed": 5, "stop": ["zzz"]}),
        json.dumps({"prompt": good[0], "model": "some-adapter"}),
        json.dumps({"prompt": good[0], "best_of": 3}),
    ]
    out = _run(model, lines, tmp_path, "--max-model-len", "64")
    assert len(out) == len(lines)
    engine = make_engine(model, max_model_len=64)
    ref = engine.generate([good[0], good[1]], SamplingParams(max_tokens=6, temperature=0))
    assert out[0]["token_ids"] == ref[0].token_ids and out[0]["text"] == ref[0].text
    assert out[0]["finish_reason"] in ("length", "stop")
    assert out[1] == {"text": "", "token_ids": [], "finish_reason": "error", "error": "the prompt is empty"}
    assert "max_tokens must be an integer >= 1" in out[2]["error"]
    assert "max_model_len is 64" in out[3]["error"]
    assert out[4]["token_ids"] == ref[1].token_ids[:5]
    assert len(out[4]["logprobs"]) == 5 and all(len(lp["top_logprobs"]) == 2 for lp in out[4]["logprobs"])
    assert all(lp["logprob"] <= lp["top_logprobs"][0]["logprob"] + 1e-6 for lp in out[4]["logprobs"])
    assert "invalid JSON" in out[5]["error"]
    assert out[6]["finish_reason"] in ("length", "stop") and len(out[6]["token_ids"]) <= 3
    assert "LoRA is not enabled" in out[7]["error"]
    assert "unsupported field(s): best_of" in out[8]["error"]


def test_seeded_generate_is_reproducible(model_factory, tmp_path: Path) -> None:
    model = model_factory("qwen3", "auto_round", True)
    line = json.dumps({"prompt": "hello world", "max_tokens": 8, "temperature": 1.0, "seed": 42})
    a = _run(model, [line, line], tmp_path)
    assert a[0]["token_ids"] == a[1]["token_ids"]


def test_generate_takes_the_servers_sampling_fields(model_factory, tmp_path: Path) -> None:
    """The vLLM sampling fields reach SamplingParams with the server's meanings (their effect on the logits is
    checked against transformers' processors in tests/unit/test_logits_processors.py)."""
    model = model_factory("qwen3", "auto_round", True)
    fields = {"max_tokens": 6, "temperature": 0, "repetition_penalty": 1.5, "presence_penalty": 0.5,
              "frequency_penalty": 0.7, "min_p": 0.1, "top_k": 5, "logit_bias": {"7": 8.0}, "min_tokens": 6,
              "ignore_eos": True, "stop_token_ids": [3], "include_stop_str_in_output": True}
    lines = [json.dumps({"prompt": "hello world", **fields}), json.dumps({"prompt": "hello world", "max_tokens": 6,
             "temperature": 0}), json.dumps({"prompt": "hi", "ignore_eos": "yes"})]
    out = _run(model, lines, tmp_path, "--max-model-len", "64")
    engine = make_engine(model, max_model_len=64)
    params = SamplingParams(**{**fields, "logit_bias": ((7, 8.0),), "stop_token_ids": (3,)})
    ref = engine.generate(["hello world"], params)[0]
    plain = engine.generate(["hello world"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert out[0]["token_ids"] == ref.token_ids and out[0]["text"] == ref.text
    assert out[1]["token_ids"] == plain.token_ids
    assert ref.token_ids != plain.token_ids  # the fields change the output, so dropping them would show
    assert "expected true or false" in out[2]["error"]
