"""vLLM's sampling fields through the real server (uvicorn subprocess) and the real `openai` client's
extra_body, in ONE concurrent batch mixing the demo adapters and the base model; every output equals an
independent oracle: transformers + auto-round (base) or peft on auto-round's dequantized weights
(adapters), generating token by token with transformers' logits processors in vLLM's order (tests/oracle.py),
greedily or replaying the request's seeded draws."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
import torch
from peft import PeftModel
from transformers import AutoTokenizer, GenerationConfig

from engine.protocol import SamplingParams
from tests.oracle import inverse_cdf_pick, load_hf_dequantized, sampling_probs, sampling_processed
from tools.serverlib import API_KEY, ServerProcess
from tools.tinymodels import load_transformers_fp32

DEMO = Path(__file__).resolve().parents[2] / "demo"
PROMPT = "words: cat ant moon fox =>"
PROMPT2 = "words: owl jam dog hat key =>"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProcess(str(DEMO / "model"), [], tmp_path_factory.mktemp("sampling") / "server.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@torch.inference_mode()
def _oracle(model: torch.nn.Module, tok, prompt: list[int], p: SamplingParams, eos: tuple[int, ...]
            ) -> tuple[str, str]:
    """(text, finish_reason) under vLLM's rules: the first min_tokens tokens cannot stop; a stop token's text
    and a stop string are left out unless include_stop_str_in_output."""
    out: list[int] = []
    gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    while True:
        logits = model(torch.tensor([prompt + out])).logits[0, -1]
        x = sampling_processed(logits, p, prompt, out, eos)
        if p.temperature == 0:
            t = int(x.argmax())
        else:
            assert gen is not None
            t = inverse_cdf_pick(sampling_probs(x, p), p, float(torch.rand(1, generator=gen)[0]))
        out.append(t)
        if len(out) > p.min_tokens and ((not p.ignore_eos and t in eos) or t in p.stop_token_ids):
            keep = out if p.include_stop_str_in_output else out[:-1]
            return tok.decode(keep, skip_special_tokens=p.skip_special_tokens), "stop"
        text = tok.decode(out, skip_special_tokens=p.skip_special_tokens)
        hits = [(text.find(s), s) for s in p.stop if s in text]
        if hits:
            assert p.min_tokens == 0  # this oracle checks stop strings from the first token
            i, s = min(hits)
            return text[: i + len(s) if p.include_stop_str_in_output else i], "stop"
        if len(out) >= p.max_tokens:
            return text, "length"


def test_every_sampling_field_in_one_mixed_concurrent_batch(srv: ServerProcess) -> None:
    tok = AutoTokenizer.from_pretrained(DEMO / "model")
    eos = tuple(GenerationConfig.from_pretrained(DEMO / "model").eos_token_id)
    word = {w: tok.encode(w)[0] for w in (" CAT", " ANT", " moon", " fox", " key", " jam", " owl", " egg")}
    assert all(len(tok.encode(w)) == 1 for w in word)
    g = dict(temperature=0.0)
    cases: list[tuple[str | None, str, SamplingParams]] = [
        (None, PROMPT, SamplingParams(max_tokens=8, repetition_penalty=10.0, **g)),
        ("reverse", PROMPT, SamplingParams(max_tokens=8, presence_penalty=2.0, frequency_penalty=1.5,
                                           ignore_eos=True, **g)),
        ("upper", PROMPT, SamplingParams(max_tokens=8, logit_bias=((word[" ANT"], -100.0), (word[" CAT"], -50.0)),
                                         **g)),
        ("sort", PROMPT2, SamplingParams(max_tokens=9, min_tokens=8, **g)),
        (None, PROMPT2, SamplingParams(max_tokens=9, ignore_eos=True, skip_special_tokens=False, **g)),
        ("reverse", PROMPT2, SamplingParams(max_tokens=8, stop_token_ids=(word[" jam"],), **g)),
        ("reverse", PROMPT2, SamplingParams(max_tokens=8, stop_token_ids=(word[" jam"],),
                                            include_stop_str_in_output=True, skip_special_tokens=False, **g)),
        (None, PROMPT, SamplingParams(max_tokens=8, stop=(" moon",), include_stop_str_in_output=True, **g)),
        ("upper", PROMPT2, SamplingParams(max_tokens=8, temperature=1.5, top_k=3, seed=7)),
        ("sort", PROMPT, SamplingParams(max_tokens=8, temperature=2.0, min_p=0.05, top_p=0.95, seed=11,
                                        repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True)),
        (None, PROMPT2, SamplingParams(max_tokens=8, temperature=3.0, min_p=0.3, seed=5, presence_penalty=-1.0,
                                       logit_bias=((word[" egg"], 4.0),), min_tokens=2)),
    ]
    fields = {"top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
              "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output"}
    defaults = SamplingParams()

    def extra(p: SamplingParams) -> dict:
        body = {f: getattr(p, f) for f in fields if getattr(p, f) != getattr(defaults, f)}
        if "logit_bias" in body:
            body["logit_bias"] = {str(t): b for t, b in p.logit_bias}
        if "stop_token_ids" in body:
            body["stop_token_ids"] = list(p.stop_token_ids)
        return body

    used = set().union(*(extra(p) for _, _, p in cases))
    assert used == fields, fields - used

    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def one(model: str | None, prompt: str, p: SamplingParams) -> tuple[str, str]:
        r = await client.completions.create(
            model=model or "model", prompt=prompt, max_tokens=p.max_tokens, temperature=p.temperature,
            top_p=p.top_p, seed=p.seed, stop=list(p.stop) or None, extra_body=extra(p))
        return r.choices[0].text, r.choices[0].finish_reason

    async def main() -> list[tuple[str, str]]:
        try:
            return await asyncio.gather(*(one(m, pr, p) for m, pr, p in cases))
        finally:
            await client.close()

    got = asyncio.run(main())

    base = load_transformers_fp32(str(DEMO / "model"))
    adapters = {n: PeftModel.from_pretrained(load_hf_dequantized(str(DEMO / "model")), str(DEMO / "adapters" / n))
                for n in ("reverse", "upper", "sort")}
    for (model, prompt, p), (text, finish) in zip(cases, got):
        oracle = adapters[model] if model else base
        ids = tok.encode(prompt)
        want = _oracle(oracle, tok, ids, p, eos)
        assert (text, finish) == want, (model, prompt, p)
        if p.temperature == 0:  # every field changes what plain greedy would give
            plain = _oracle(oracle, tok, ids, SamplingParams(max_tokens=p.max_tokens, temperature=0.0), eos)
            assert want != plain, (model, prompt, p, plain)
