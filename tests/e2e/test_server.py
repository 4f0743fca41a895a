"""`python -m server` in a subprocess, driven by the real openai client: completions and chat, streamed
and not, for the base and every adapter, equal to the engine's offline outputs; usage, stop, max_tokens,
n with seeds, logprobs, prompt forms, echo; hot load/unload; 64 concurrent streams while adapters are
loaded and unloaded; client disconnects free their KV blocks."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import httpx
import openai
import pytest

from engine import SamplingParams
from tests.helpers import ALL7, make_lora_engine, prompts
from tools.serverlib import API_KEY, ServerProcess
from tools.tinymodels import make_peft_adapter

MAX = 8
PROMPTS = prompts(6, seed=11, min_words=3, max_words=12)
SHORT = prompts(4, seed=12, min_words=2, max_words=4)
RANKS = [8, 16, 4, 8, 16]


class Env:
    def __init__(self, srv: ServerProcess, model: str, paths: dict[str, str]) -> None:
        self.srv, self.url, self.paths = srv, srv.url, paths
        self.engine = make_lora_engine(model, paths, max_loras=5, max_model_len=1024)  # as the server
        self.tok = self.engine.tokenizer
        self.client = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120)
        self._cache: dict[tuple, object] = {}

    def ref(self, prompt: str | list[int], adapter: str | None, max_tokens: int = MAX, **kw):
        """The offline engine's result for this request run alone (greedy unless kw says otherwise)."""
        key = (prompt if isinstance(prompt, str) else tuple(prompt), adapter, max_tokens, tuple(sorted(kw.items())))
        if key not in self._cache:
            sp = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **kw})
            self._cache[key] = self.engine.generate([prompt], sp, [adapter])[0]
        return self._cache[key]

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False)

    @property
    def base(self) -> str:
        return self.http.get("/v1/models").json()["data"][0]["id"]

    def model_ids(self) -> list[str]:
        return [m["id"] for m in self.http.get("/v1/models").json()["data"]]


@pytest.fixture(scope="module")
def env(model_factory, tmp_path_factory):
    bf16 = model_factory("qwen3", None, False)
    model = model_factory("qwen3", "auto_round", False)
    root = tmp_path_factory.mktemp("lora-root")
    paths = {f"a{i}": make_peft_adapter(bf16, str(root / f"a{i}"), r=r, targets=ALL7, seed=100 + i, b_std=0.1)
             for i, r in enumerate(RANKS)}
    flags = ["--enable-lora", "--max-model-len", "1024", "--lora-root", str(root), "--no-lora-autoload",
             "--lora-modules", *(f"a{i}={paths[f'a{i}']}" for i in range(4))]
    srv = ServerProcess(model, flags, root.parent / "server-main.log")
    try:
        e = Env(srv, model, paths)  # the offline engine builds while the server starts
        srv.wait_ready()
        yield e
    finally:
        srv.stop()


def _streamed_text(chunks: list) -> tuple[str, str | None]:
    text, finish = "", None
    for ch in chunks:
        for c in ch.choices:
            text += c.text if hasattr(c, "text") else (c.delta.content or "")
            finish = c.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("adapter", [None, "a0", "a1", "a2", "a3"])
def test_completions_and_chat_match_offline(env: Env, adapter: str | None) -> None:
    name, p, c = adapter or env.base, PROMPTS[0], env.client
    ref = env.ref(p, adapter)
    if adapter is not None:
        assert ref.token_ids != env.ref(p, None).token_ids  # the adapter really changes the output
    r = c.completions.create(model=name, prompt=p, max_tokens=MAX, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.text, ref.finish_reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens and r.model == name
    chunks = list(c.completions.create(model=name, prompt=p, max_tokens=MAX, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert _streamed_text(chunks) == (ref.text, ref.finish_reason)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[1]}]
    cref = env.ref(env.chat_ids(msgs), adapter)
    r = c.chat.completions.create(model=name, messages=msgs, max_tokens=MAX, temperature=0)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (cref.text, cref.finish_reason)
    assert r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(cref.prompt_token_ids), len(cref.token_ids))
    chunks = list(c.chat.completions.create(model=name, messages=msgs, max_tokens=MAX, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert _streamed_text(chunks) == (cref.text, cref.finish_reason)
    assert chunks[-1].usage.prompt_tokens == len(cref.prompt_token_ids)


def test_stop_strings_and_max_tokens(env: Env) -> None:
    p, c = PROMPTS[2], env.client
    text = env.ref(p, "a1", max_tokens=16).text
    k = next(k for k in range(2, len(text) - 1) if "\ufffd" not in text[k:k + 2] and text.find(text[k:k + 2]) == k)
    stop = text[k:k + 2]
    r = c.completions.create(model="a1", prompt=p, max_tokens=16, temperature=0, stop=[stop, "@@never@@"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text[:k], "stop")
    chunks = list(c.completions.create(model="a1", prompt=p, max_tokens=16, temperature=0, stop=stop, stream=True))
    assert _streamed_text(chunks) == (text[:k], "stop")
    r = c.completions.create(model="a1", prompt=p, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (3, "length")
    r = c.chat.completions.create(model="a1", messages=[{"role": "user", "content": p}], max_completion_tokens=2,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (2, "length")


def test_n_with_seed_is_reproducible(env: Env) -> None:
    p, c = PROMPTS[3], env.client
    kw = dict(model="a2", prompt=p, max_tokens=MAX, temperature=1.0, seed=1234, n=3)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    texts = [ch.text for ch in sorted(a.choices, key=lambda ch: ch.index)]
    assert texts == [ch.text for ch in sorted(b.choices, key=lambda ch: ch.index)]
    assert len(set(texts)) > 1  # choice i samples with seed + i
    assert texts == [env.ref(p, "a2", temperature=1.0, seed=1234 + i).text for i in range(3)]
    assert a.usage.prompt_tokens == len(env.ref(p, "a2").prompt_token_ids)  # once per prompt, not per choice
    assert a.usage.completion_tokens == sum(len(env.ref(p, "a2", temperature=1.0, seed=1234 + i).token_ids)
                                            for i in range(3))
    msgs = [{"role": "user", "content": p}]
    chunks = list(c.chat.completions.create(model="a2", messages=msgs, max_tokens=MAX, temperature=1.0, seed=9, n=2,
                                            stream=True))
    streamed = ["".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
                for i in range(2)]
    assert streamed == [env.ref(env.chat_ids(msgs), "a2", temperature=1.0, seed=9 + i).text for i in range(2)]


def test_logprobs(env: Env) -> None:
    p, c = PROMPTS[4], env.client
    ref = env.ref(p, "a0", logprobs=2)
    lp = c.completions.create(model="a0", prompt=p, max_tokens=MAX, temperature=0, logprobs=2).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-4)
    assert lp.tokens == [env.tok.decode([t]) for t in ref.token_ids]
    d = env.tok.decode  # distinct ids may decode alike (partial UTF-8 -> U+FFFD): the dict keys merge them
    assert [set(top) for top in lp.top_logprobs] == [{d([t]) for t, _ in x.top} | {d([x.token_id])} for x in ref.logprobs]
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    msgs = [{"role": "user", "content": p}]
    cref = env.ref(env.chat_ids(msgs), "a0", logprobs=2)
    r = c.chat.completions.create(model="a0", messages=msgs, max_tokens=MAX, temperature=0, logprobs=True,
                                  top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([x.logprob for x in cref.logprobs], abs=1e-4)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-5 for e in content)
    if not set(cref.token_ids) & set(env.tok.all_special_ids):
        joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
        assert joined == r.choices[0].message.content


def test_prompt_forms_and_echo(env: Env) -> None:
    c, base = env.client, env.base
    p1, p2 = PROMPTS[0], PROMPTS[5]
    r1, r2 = env.ref(p1, None), env.ref(p2, None)
    r = c.completions.create(model=base, prompt=[p1, p2], max_tokens=MAX, temperature=0)
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == [r1.text, r2.text]
    assert r.usage.prompt_tokens == len(r1.prompt_token_ids) + len(r2.prompt_token_ids)
    ids1, ids2 = env.tok.encode(p1), env.tok.encode(p2)
    assert c.completions.create(model=base, prompt=ids1, max_tokens=MAX, temperature=0).choices[0].text == r1.text
    r = c.completions.create(model=base, prompt=[ids1, ids2], max_tokens=MAX, temperature=0)
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == [r1.text, r2.text]
    r = c.completions.create(model=base, prompt=p1, max_tokens=MAX, temperature=0, echo=True)
    assert r.choices[0].text == p1 + r1.text
    chunks = list(c.completions.create(model=base, prompt=p1, max_tokens=MAX, temperature=0, echo=True, stream=True))
    assert _streamed_text(chunks)[0] == p1 + r1.text


def test_hot_load_then_unload(env: Env) -> None:
    p, c = PROMPTS[1], env.client
    assert "hot" not in env.model_ids()
    resp = env.http.post("/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": env.paths["a4"]})
    assert resp.status_code == 200, resp.text
    card = next(m for m in env.http.get("/v1/models").json()["data"] if m["id"] == "hot")
    assert card["parent"] == env.base and card["root"] == os.path.realpath(env.paths["a4"])
    assert c.completions.create(model="hot", prompt=p, max_tokens=MAX, temperature=0).choices[0].text == \
        env.ref(p, "a4").text
    assert env.http.post("/v1/unload_lora_adapter", json={"lora_name": "hot"}).status_code == 200
    assert "hot" not in env.model_ids()
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="hot", prompt=p, max_tokens=MAX, temperature=0)


def _lora_info(metrics: dict[str, float]) -> dict[str, str]:
    key = next(k for k in metrics if k.startswith("xpulora:lora_requests_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', key))


def test_64_concurrent_streams_while_loading_and_unloading(env: Env) -> None:
    combos = [(p, f"a{j}") for p in SHORT for j in range(4)]
    # Request 63 (adapter a3) is long, so it surely still runs when a3 is unloaded and a4 loaded.
    lengths = [400 if k == 63 else 8 for k in range(64)]
    refs = {(k % 16, n): env.ref(*combos[k % 16], max_tokens=n, ignore_eos=True).text  # each run alone
            for k, n in enumerate(lengths)}

    async def main() -> tuple[list, list[httpx.Response], int]:
        client = openai.AsyncOpenAI(base_url=env.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        first = [asyncio.Event() for _ in range(64)]

        async def one(k: int) -> tuple[str, str | None]:
            p, a = combos[k % 16]
            # logprobs=0 makes every token produce a chunk, so `first` fires as soon as a request runs.
            stream = await client.completions.create(model=a, prompt=p, max_tokens=lengths[k], temperature=0, stream=True,
                                                     logprobs=0, extra_body={"ignore_eos": True})
            chunks = []
            async for ch in stream:
                chunks.append(ch)
                first[k].set()
            return _streamed_text(chunks)

        tasks = [asyncio.create_task(one(k)) for k in range(64)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 120)  # all 64 are running
        pending = 0
        async with httpx.AsyncClient(base_url=env.url, headers=env.srv.headers, timeout=60) as http:
            async def unload() -> httpx.Response:
                nonlocal pending
                r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
                pending = int(not tasks[63].done())
                return r

            admin = await asyncio.gather(
                http.post("/v1/load_lora_adapter", json={"lora_name": "a4", "lora_path": env.paths["a4"]}), unload())
        return await asyncio.gather(*tasks), admin, pending

    results, admin, pending = asyncio.run(main())
    assert [r.status_code for r in admin] == [200, 200], [r.text for r in admin]
    assert pending  # a3 was unloaded (and a4 loaded) while a3's request 63 was streaming
    assert results == [(refs[k % 16, n], "length") for k, n in enumerate(lengths)]
    c, p = env.client, PROMPTS[0]
    assert c.completions.create(model="a4", prompt=p, max_tokens=MAX, temperature=0).choices[0].text == \
        env.ref(p, "a4").text
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="a3", prompt=p, max_tokens=MAX, temperature=0)
    m = env.srv.wait_idle()
    assert m["xpulora:kv_cache_usage_perc"] == 0.0 and m["xpulora:lora_adapter_unloads_total"] >= 1


def test_client_disconnect_frees_blocks(env: Env) -> None:
    before = env.srv.wait_idle().get('xpulora:request_success_total{finished_reason="abort"}', 0.0)
    # 1000 tokens take seconds even on a fast machine: both requests are cut while generating.
    body = {"model": "a0", "prompt": PROMPTS[2], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", env.url + "/v1/completions", json={**body, "stream": True}, headers=env.srv.headers,
                      timeout=60) as r:
        lines = r.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: {")) >= 2
        m = env.srv.metrics()
        assert m["xpulora:kv_cache_usage_perc"] > 0 and m["xpulora:num_requests_running"] == 1
        assert _lora_info(m) == {"running_lora_adapters": "a0", "waiting_lora_adapters": "", "max_lora": "4"}
    m = env.srv.wait_idle()  # the stream was closed mid-way: the request is aborted, its blocks freed
    assert m["xpulora:kv_cache_usage_perc"] == 0.0 and m["xpulora:num_requests_running"] == 0
    assert m['xpulora:request_success_total{finished_reason="abort"}'] == before + 1
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up while it is generating
        httpx.post(env.url + "/v1/completions", json=body, headers=env.srv.headers, timeout=1.0)
    m = env.srv.wait_idle()
    assert m["xpulora:kv_cache_usage_perc"] == 0.0 and m["xpulora:num_requests_running"] == 0
    assert m['xpulora:request_success_total{finished_reason="abort"}'] == before + 2
    assert m["xpulora:time_to_first_token_seconds_count"] > 0 and m["xpulora:prompt_tokens_total"] > 0


def test_served_log_has_ready_line(env: Env) -> None:
    log = Path(env.srv.log_path).read_text()
    assert f"xpulora ready: {env.url}/v1" in log and "curl " in log


def test_prefix_cache_hits_show_in_usage_and_metrics(env: Env) -> None:
    ids = list(range(50, 90))  # 40 tokens no other test sends: 2 full blocks of 16 can be hit
    kw = dict(model="a1", prompt=ids, max_tokens=MAX, temperature=0)
    first = env.client.completions.create(**kw)
    before = env.srv.wait_idle()
    second = env.client.completions.create(**kw)
    after = env.srv.wait_idle()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32 and second.choices[0].text == first.choices[0].text
    for name in ("xpulora:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"):
        assert after[name] - before[name] == 32
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == 40


def test_step_counters_in_metrics(env: Env) -> None:
    """The core's step totals: one request alone is one prefill step, then one decode step per further token."""
    ids = list(range(120, 157))  # 37 tokens no other test sends
    before = env.srv.wait_idle()
    r = env.client.completions.create(model="a2", prompt=ids, max_tokens=MAX, temperature=0,
                                      extra_body={"ignore_eos": True})
    after = env.srv.wait_idle()
    d = {k: after[f"xpulora:engine_{k}_total"] - before[f"xpulora:engine_{k}_total"]
         for k in ("steps", "step_tokens", "step_sequences", "mixed_steps", "step_seconds", "admitted",
                   "queue_seconds")}
    computed = len(ids) - r.usage.prompt_tokens_details.cached_tokens + MAX - 1  # the last token is never fed
    assert r.usage.completion_tokens == MAX
    assert d["steps"] == MAX and d["step_sequences"] == MAX and d["mixed_steps"] == 1, d
    assert d["step_tokens"] == computed and d["step_seconds"] > 0, d
    # admitted once, not once per step; its wait (receipt to first launch) is no longer than the whole request took
    assert d["admitted"] == 1 and 0 < d["queue_seconds"] < d["step_seconds"], d
    assert after["xpulora:api_output_seconds_total"] > before["xpulora:api_output_seconds_total"]


def test_startup_heap_frozen_and_gc_pauses_counted(env: Env) -> None:
    """Both processes froze their start-up objects out of garbage collection (engine.gc_pauses), and /metrics
    has each one's collection time and count (GcPauses itself: tests/unit/test_gc_pauses.py)."""
    for i in range(4):
        env.client.completions.create(model=env.base, prompt=list(range(200 + i, 230 + i)), max_tokens=MAX,
                                      temperature=0)
    after = env.srv.wait_idle()
    for proc in ("api", "engine_core"):
        key = f'{{process="{proc}"}}'
        assert after["xpulora:gc_frozen_objects" + key] > 10_000, (proc, after["xpulora:gc_frozen_objects" + key])
        assert "xpulora:gc_seconds_total" + key in after and "xpulora:gc_full_collections_total" + key in after
