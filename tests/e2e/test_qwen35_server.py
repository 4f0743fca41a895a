"""The Qwen3.5 hybrid through `python -m server`: concurrent sequences of different lengths get the
outputs they get alone (state slots isolated and reused), and aborted requests free their state slots."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from engine import SamplingParams
from tests.helpers import make_engine, prompts
from tools.serverlib import API_KEY, ServerProcess
from tools.tinymodels import make_qwen35_model, quantize

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("q35srv")
    model = quantize(make_qwen35_model(str(root / "bf16"), vision=True, seed=4), str(root / "int4"))
    # Two state slots for eight requests: slots are reused while others are still running.
    s = ServerProcess(model, ["--max-num-seqs", "2", "--max-model-len", "512"], root / "server.log")
    try:
        s.wait_ready()
        s.model = model
        yield s
    finally:
        s.stop()


def test_concurrent_sequences_equal_each_alone(srv: ServerProcess) -> None:
    ps = prompts(8, seed=41, min_words=1, max_words=40)
    engine = make_engine(srv.model)
    alone = [engine.generate([p], GREEDY)[0].text for p in ps]
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def main() -> list[str]:
        base = (await client.models.list()).data[0].id
        rs = await asyncio.gather(*(client.completions.create(model=base, prompt=p, max_tokens=12, temperature=0,
                                                              extra_body={"ignore_eos": True}) for p in ps))
        return [r.choices[0].text for r in rs]

    assert asyncio.run(main()) == alone


def test_aborted_requests_free_their_state_slots(srv: ServerProcess) -> None:
    base = httpx.get(srv.url + "/v1/models", headers=srv.headers).json()["data"][0]["id"]
    body = {"model": base, "prompt": "hello world", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    for _ in range(2):  # occupy both state slots, then disconnect mid-stream
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=srv.headers, timeout=60) as r:
            assert sum(1 for _, line in zip(range(4), r.iter_lines()) if line.startswith("data: {")) >= 2
    m = srv.wait_idle()
    assert m["xpulora:num_requests_running"] == 0 and m["xpulora:kv_cache_usage_perc"] == 0.0
    # With two slots and nothing leaked, two new requests run at once and finish.
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    for _ in range(3):
        r = client.completions.create(model=base, prompt="café", max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")


def test_structured_output_on_the_hybrid(srv: ServerProcess) -> None:
    """json_schema and choice constrain the Qwen3.5 hybrid's output too (concurrent, sampled, n > 1)."""
    import json
    import re

    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                             "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["x", "y"]}}}}
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def main() -> list:
        base = (await client.models.list()).data[0].id
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
        return await asyncio.gather(
            *(client.completions.create(model=base, prompt=p, max_tokens=80, temperature=1.0, seed=i, n=2,
                                        extra_body={"response_format": fmt}) for i, p in enumerate(prompts(3, seed=5))),
            client.completions.create(model=base, prompt="pick", max_tokens=8, temperature=1.0, n=3,
                                      extra_body={"structured_outputs": {"regex": "(red|blue)-[0-9]{2}"}}))

    *docs, regex = asyncio.run(main())
    for r in docs:
        for c in r.choices:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), schema)
    assert all(re.fullmatch("(red|blue)-[0-9]{2}", c.text) for c in regex.choices)
