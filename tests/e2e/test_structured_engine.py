"""Structured output in the engine with tensor parallelism: at TP=2 (gloo, two processes; only rank 0 has
matchers and applies masks) the demo model gives the same constrained outputs as at TP=1, for the base
model and two adapters in one batch, and they validate."""

from __future__ import annotations

import json

import jsonschema

from engine import SamplingParams, StructuredSpec
from tests.helpers import make_lora_engine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["w", "n"],
          "properties": {"w": {"enum": ["cat", "ant", "fox"]}, "n": {"type": "array", "maxItems": 3,
                                                                   "items": {"type": "integer", "maximum": 99}}}}
ADAPTERS = {n: f"demo/adapters/{n}" for n in ("reverse", "upper")}


def _run(tp: int) -> list[tuple[str, str | None]]:
    spec = StructuredSpec("json", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=60, temperature=t, seed=i, structured=spec)
              for i, t in enumerate([0.0, 1.0, 0.8] * 2)]
    with make_lora_engine("demo/model", ADAPTERS, tp=tp) as e:
        res = e.generate(["words: cat ant moon fox =>"] * 6, params, [None, "reverse", "upper"] * 2)
    return [(r.text, r.finish_reason) for r in res]


def test_tp2_equals_tp1_and_validates() -> None:
    one = _run(1)
    assert _run(2) == one
    for text, reason in one:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
