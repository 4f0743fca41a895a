"""The bundled demo: `xpulora generate` with no model serves the demo model and its adapters; outputs
equal transformers + auto-round (base) and peft on auto-round's dequantized weights (adapters), and
each adapter visibly does its task."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from peft import PeftModel

from tests.oracle import hf_greedy, load_hf_dequantized
from tools.tinymodels import load_transformers_fp32

DEMO = Path(__file__).resolve().parents[2] / "demo"


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> list[tuple[dict, dict]]:
    out = tmp_path_factory.mktemp("demo") / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "server.cli_main", "generate", "--requests",
                           str(DEMO / "prompts.jsonl"), "--output", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in (DEMO / "prompts.jsonl").read_text().splitlines()]
    return list(zip(lines, [json.loads(x) for x in out.read_text().splitlines()]))


def test_demo_outputs_equal_the_oracles(generated: list[tuple[dict, dict]]) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(DEMO / "model")
    base = load_transformers_fp32(str(DEMO / "model"))  # transformers + auto-round's own int4 layers
    dense = load_hf_dequantized(str(DEMO / "model"))
    oracles = {name: PeftModel.from_pretrained(load_hf_dequantized(str(DEMO / "model")), str(DEMO / "adapters" / name))
               for name in {line.get("model") for line, _ in generated} - {None}}
    eos = GenerationConfig.from_pretrained(DEMO / "model").eos_token_id
    for line, out in generated:
        ids = tok.encode(line["prompt"])
        model = oracles[line["model"]] if "model" in line else base
        ref = hf_greedy(model, ids, line["max_tokens"], eos=eos)
        assert out["token_ids"] == ref, line
        if "model" not in line:
            assert out["token_ids"] == hf_greedy(dense, ids, line["max_tokens"], eos=eos)


def test_each_adapter_does_its_task(generated: list[tuple[dict, dict]]) -> None:
    for line, out in generated:
        words = line["prompt"].removeprefix("words: ").removesuffix(" =>").split()
        expected = {None: words, "reverse": words[::-1], "upper": [w.upper() for w in words],
                    "sort": sorted(words)}[line.get("model")]
        assert out["text"].split() == expected, (line, out["text"])
        assert out["finish_reason"] == "stop"
