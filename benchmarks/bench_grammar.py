"""Cost of structured output per decode step at batch 32: a JSON-schema grammar on every request vs none,
on a Qwen3-8B-shaped random int4 checkpoint (vocab 151936), plus the two parts of the grammar work alone:
the host bitmask fill (32 llguidance matchers) and the device apply on [32, vocab] logits. One JSON line
per measurement.

    python3 benchmarks/bench_grammar.py              # on a GPU (CUDA / XPU)
    python3 benchmarks/bench_grammar.py --quick      # tiny shapes on the CPU (smoke test)

The schema (an array of >= 1000 objects with a string, an integer and an enum) cannot be completed in the
timed steps, so every request decodes every step, and its JSON lexer and parser do real work each token.
The checkpoint's tokenizer is the test suite's tiny byte-level BPE (~420 tokens), so the host fill here
is cheaper than with Qwen's 151k-token tokenizer (llguidance walks the token trie); the device apply and
the logits width are the real model's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import emit, engine_config, requests
from benchmarks.timing import device_sync, time_us
from engine import LLMEngine, SamplingParams, StructuredSpec
from engine.structured import GrammarMatchers, apply_bitmask
from tools.random_int4 import QWEN3_8B, Shape, write_random_int4

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "n", "kind"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"},
                   "kind": {"enum": ["alpha", "beta", "gamma"]}}}}
SPEC = StructuredSpec("json", json.dumps(SCHEMA))


def decode_ms(e: LLMEngine, batch: int, new_tokens: int, spec: StructuredSpec | None) -> dict[str, float]:
    """Prefill every request in one step, then time the decode steps until all finish (sampled at
    temperature 1 with seeds: greedy on a random model repeats one token, which a grammar would not)."""
    prompts, _ = requests(batch, 0)
    for i, p in enumerate(prompts):
        e.add_request(f"{spec is not None}-{i}", p, SamplingParams(
            max_tokens=new_tokens, temperature=1.0, seed=i, ignore_eos=True, structured=spec))
    e.step()
    e.device.synchronize()
    t0, steps = time.perf_counter(), 0
    while e.has_unfinished():
        e.step()
        steps += 1
    e.device.synchronize()
    return {"steps": steps, "ms_per_step": 1e3 * (time.perf_counter() - t0) / steps}


def parts_us(e: LLMEngine, batch: int, budget_s: float) -> dict[str, float]:
    """The grammar work of one step alone: fill 32 masks on the host (matchers advanced a few tokens into
    the document), copy + apply them to [batch, vocab] float32 logits on the device."""
    m = GrammarMatchers(e.grammar.compiler, e.grammar.parallel)
    doc = e.tokenizer.encode('[{"name": "ab", "n": 12, "kind": "beta"}, {"name": "')
    for sid in range(batch):
        m.add(sid, SPEC)
        for t in doc[: 4 + sid % (len(doc) - 4)]:  # rows at different places of the document
            m.accept(sid, t)
    ids = list(range(batch))
    dev = e.device.torch_device
    logits = torch.randn(batch, e.vocab_size, device=dev)
    sync = device_sync(dev)
    bm = m.fill(ids)
    assert bm is not None and len(bm.rows) == batch
    fill = time_us(lambda: m.fill(ids), lambda: None, budget_s)
    apply = time_us(lambda: apply_bitmask(logits, bm), sync, budget_s)
    return {"fill_us": fill, "apply_us": apply}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, CPU smoke test")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batch", type=int, default=None, help="default 32 (--quick: 4)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (--quick: 6)")
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs of each case (the median is kept)")
    ap.add_argument("--root", default="/tmp/xpulora-grammar")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    s = Shape(256, 768, 2, 4, 2, 64, 1024) if a.quick else QWEN3_8B
    layers = 2 if a.quick else a.layers
    a.batch = a.batch or (4 if a.quick else 32)
    a.new_tokens = a.new_tokens or (6 if a.quick else 64)
    a.repeats = 1 if a.quick else a.repeats
    path = write_random_int4(f"{a.root}/model", s, layers=layers, device=device)
    with LLMEngine(engine_config(path, [], a.batch, device.type)) as e:
        decode_ms(e, a.batch, 4, SPEC)  # warm-up at the timed batch size (and the grammar's compile)
        runs: dict[str, list[float]] = {"none": [], "json_schema": []}
        for _ in range(a.repeats):  # alternated, so drift hits both cases alike
            for name, spec in (("none", None), ("json_schema", SPEC)):
                r = decode_ms(e, a.batch, a.new_tokens, spec)
                runs[name].append(r["ms_per_step"])
                emit(case="decode", grammar=name, batch=a.batch, device=device.type, tokenizer=len(e.tokenizer),
                     vocab=e.vocab_size, **r)
        med = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
        emit(case="summary", batch=a.batch, device=device.type, ms_per_step_none=med["none"],
             ms_per_step_json_schema=med["json_schema"], overhead_ms=med["json_schema"] - med["none"],
             overhead_pct=100 * (med["json_schema"] / med["none"] - 1))
        emit(case="parts", batch=a.batch, device=device.type, vocab=e.vocab_size,
             **parts_us(e, a.batch, 0.0 if a.quick else 0.5))


if __name__ == "__main__":
    main()
