"""A vLLM user's requests, flags and probes against a real `python -m server` (real openai client, httpx):
the model given after `--lora-root` is served (not the demo), several served names, the JSON
`--lora-modules` form, Qwen3's `chat_template_kwargs: {"enable_thinking": false}` rendered as transformers
renders it (the oracle), add_generation_prompt / continue_final_message / echo, /tokenize and /detokenize
round trips, /ping, load_inplace, an explicit unload winning over load-on-first-use, and the vllm: metric
names with the model_name label."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.helpers import ALL7
from tools.serverlib import API_KEY, ServerProcess
from tools.tinymodels import make_peft_adapter

# Qwen3's generation prompt: with enable_thinking false the template writes an empty think block, so the
# model answers without thinking (ChatML otherwise, as tools/tokenizer.py's template).
QWEN3_LIKE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world fox"}]
PROMPT = "the quick brown fox jumps over"


class Env:
    def __init__(self, srv: ServerProcess, model: str, paths: dict[str, str]) -> None:
        self.srv, self.model, self.paths = srv, model, paths
        self.tok = AutoTokenizer.from_pretrained(model)
        self.client = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120)

    def complete(self, model: str, prompt: str | list[int] = PROMPT, max_tokens: int = 8) -> str:
        return self.client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                              temperature=0).choices[0].text

    def oracle(self, **kw) -> list[int]:
        text = self.tok.apply_chat_template(MESSAGES, tokenize=False, **kw)
        return self.tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def env(model_factory, tmp_path_factory):
    base = model_factory("qwen3", None, False)
    model = str(tmp_path_factory.mktemp("qwen3-think") / "qwen3-think")
    shutil.copytree(base, model)
    with open(f"{model}/chat_template.jinja", "w") as f:
        f.write(QWEN3_LIKE_TEMPLATE)
    root = tmp_path_factory.mktemp("lora-root")
    paths = {n: make_peft_adapter(base, str(root / n), r=8, targets=ALL7, seed=s, b_std=0.2)
             for n, s in (("a0", 1), ("a1", 2))}
    j1 = json.dumps({"name": "j1", "path": paths["a0"], "base_model_name": "alias"})
    # The model comes LAST, after --lora-root: it must be served, not taken as a second root.
    flags = ["--served-model-name", "base", "alias", "--enable-lora", "--max-model-len", "512",
             "--lora-modules", j1, "--lora-root", str(root), model]
    srv = ServerProcess(None, flags, root.parent / "server-vllm-compat.log")
    try:
        srv.wait_ready()
        yield Env(srv, model, paths)
    finally:
        srv.stop()


def test_the_model_after_lora_root_is_served_with_every_name(env: Env) -> None:
    cards = env.http.get("/v1/models").json()["data"]
    by_id = {c["id"]: c for c in cards}
    assert [c["id"] for c in cards][:2] == ["base", "alias"]
    assert by_id["base"]["root"] == env.model and by_id["alias"]["root"] == env.model  # not the demo
    assert by_id["j1"]["parent"] == "base" and by_id["j1"]["root"] == env.paths["a0"]
    out = {m: env.client.completions.create(model=m, prompt=PROMPT, max_tokens=8, temperature=0) for m in ("base", "alias")}
    assert out["base"].choices[0].text == out["alias"].choices[0].text and out["alias"].model == "alias"
    with pytest.raises(openai.NotFoundError):
        env.complete("model")  # the folder name is not a served name once names are given


def test_enable_thinking_false_renders_as_transformers_does(env: Env) -> None:
    no_think, think = env.oracle(add_generation_prompt=True, enable_thinking=False), env.oracle(add_generation_prompt=True)
    assert no_think != think and "</think>" in env.tok.decode(no_think)  # the two renderings really differ
    for kwargs, want in (({"enable_thinking": False}, no_think), (None, think), ({"enable_thinking": True}, think)):
        body = {"model": "base", "messages": MESSAGES, **({"chat_template_kwargs": kwargs} if kwargs else {})}
        got = env.http.post("/tokenize", json=body).json()
        assert got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] == 512
        r = env.client.chat.completions.create(model="alias", messages=MESSAGES, max_tokens=6, temperature=0,
                                               extra_body={"chat_template_kwargs": kwargs} if kwargs else None)
        assert r.usage.prompt_tokens == len(want)
        # The reply is the completion of exactly these prompt ids (the rendered prompt reached the engine).
        assert r.choices[0].message.content == env.complete("base", want, max_tokens=6)


def test_template_options(env: Env) -> None:
    msgs = [*MESSAGES, {"role": "assistant", "content": "fox over"}]
    body = {"model": "base", "messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    want = env.tok.encode(env.tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True),
                          add_special_tokens=False)
    assert env.http.post("/tokenize", json=body).json()["tokens"] == want
    assert env.tok.decode(want).endswith("fox over")
    plain = env.http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert plain == env.oracle(add_generation_prompt=False)
    # echo: the reply starts with the continued assistant message, streamed or not
    chat = {**body, "echo": True, "max_tokens": 5, "temperature": 0}
    r = env.http.post("/v1/chat/completions", json=chat).json()
    tail = env.complete("base", want, max_tokens=5)
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "fox over" + tail}
    stream = env.client.chat.completions.create(model="base", messages=msgs, stream=True, max_tokens=5, temperature=0,
                                                extra_body={"echo": True, "add_generation_prompt": False,
                                                            "continue_final_message": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "fox over" + tail
    for bad, field in (({"continue_final_message": True}, "continue_final_message"),
                       ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                       ({"chat_template_kwargs": "x"}, "chat_template_kwargs")):
        for route in ("/tokenize", "/v1/chat/completions"):
            resp = env.http.post(route, json={"model": "base", "messages": MESSAGES, **bad})
            assert resp.status_code == 400 and field in resp.json()["error"]["message"], (route, resp.text)


def test_tokenize_detokenize_round_trip(env: Env) -> None:
    text = "hello world café 🚀 <|im_end|>"
    got = env.http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    ids = env.tok.encode(text)
    assert got["tokens"] == ids and got["count"] == len(ids) and got["token_strs"] == env.tok.convert_ids_to_tokens(ids)
    assert env.http.post("/tokenize", json={"model": "j1", "prompt": text}).json()["token_strs"] is None
    assert env.http.post("/detokenize", json={"model": "alias", "tokens": ids}).json() == {"prompt": text}
    assert env.http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    vocab = env.http.post("/detokenize", json={"tokens": [0, 10**6]})
    assert vocab.status_code == 400 and "outside the vocabulary" in vocab.json()["error"]["message"]
    for route, body in (("/tokenize", {"model": "nope", "prompt": "x"}), ("/detokenize", {"model": "nope", "tokens": [1]})):
        assert env.http.post(route, json=body).status_code == 404
        assert httpx.post(env.srv.url + route, json=body).status_code == 401  # the key guards the tokenizer too
    both = env.http.post("/tokenize", json={"prompt": "x", "messages": MESSAGES})
    assert both.status_code == 400 and "unsupported field 'prompt'" in both.json()["error"]["message"]


def test_ping(env: Env) -> None:
    for method in ("GET", "POST"):
        r = httpx.request(method, env.srv.url + "/ping")  # no key needed, like /health
        assert r.status_code == 200 and r.json() == {"status": "healthy"}


def test_load_inplace_replaces_with_a_new_identity(env: Env) -> None:
    a0, a1 = env.complete("j1"), None
    r = env.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": env.paths["a0"]})
    assert r.status_code == 200 and env.complete("x") == a0
    dup = env.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": env.paths["a1"]})
    assert dup.status_code == 400 and "already loaded" in dup.json()["error"]["message"]
    r = env.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": env.paths["a1"],
                                                     "load_inplace": True})
    assert r.status_code == 200
    a1 = env.complete("x")
    assert a1 != a0  # the adapters differ, and x now serves the new one
    assert {c["id"]: c["root"] for c in env.http.get("/v1/models").json()["data"]}["x"] == env.paths["a1"]
    bad = env.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "missing", "load_inplace": True})
    assert bad.status_code == 404 and env.complete("x") == a1  # a failed reload leaves the old one serving
    assert env.http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200


def test_an_explicit_unload_wins_over_load_on_first_use(env: Env) -> None:
    first = env.complete("a1")  # load on first use (autoload is on)
    assert "a1" in [c["id"] for c in env.http.get("/v1/models").json()["data"]]
    assert env.http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 200
    for _ in range(2):
        with pytest.raises(openai.NotFoundError):
            env.complete("a1")
    assert "a1" not in [c["id"] for c in env.http.get("/v1/models").json()["data"]]
    assert env.http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": "a1"}).status_code == 200
    assert env.complete("a1") == first


def test_metrics_carry_vllm_names_and_the_model_name(env: Env) -> None:
    env.complete("j1")
    env.complete("base")
    m = env.srv.wait_metrics(lambda m: m.get("xpulora:num_requests_running") == 0)
    text = httpx.get(env.srv.url + "/metrics").text
    samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert samples and all('model_name="base"' in ln for ln in samples), [ln for ln in samples if "model_name" not in ln]
    full = env.srv.metrics(keep_model_name=True)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert full[f'vllm:{name}{{model_name="base"}}'] == full[f'xpulora:{name}{{model_name="base"}}']
    assert m["vllm:prompt_tokens_total"] == m["xpulora:prompt_tokens_total"] > 0
    assert m["vllm:generation_tokens_total"] == m["xpulora:generation_tokens_total"] >= 16
    assert m['vllm:request_success_total{finished_reason="length"}'] >= 2
    assert m["vllm:time_to_first_token_seconds_count"] == m["xpulora:time_to_first_token_seconds_count"] >= 2
    assert m["vllm:e2e_request_latency_seconds_count"] >= 2 and "vllm:inter_token_latency_seconds_count" in m
    assert "vllm:num_preemptions_total" in m and not any(k.startswith("vllm:lora_adapter_loads") for k in m)
    info = [ln for ln in samples if ln.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="4"' in info[0] and 'running_lora_adapters=""' in info[0]
    assert 'waiting_lora_adapters=""' in info[0] and float(info[0].split()[-1]) > 1.7e9  # a timestamp
    for typ in ("gauge vllm:num_requests_waiting", "counter vllm:prompt_tokens", "histogram vllm:e2e_request_latency"):
        kind, name = typ.split()
        assert re.search(rf"^# TYPE {name}\S* {kind}$", text, re.M), typ


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(env: Env) -> None:
    kw = dict(model="a0", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    plain = env.client.completions.create(**kw).choices[0]
    by_id = env.client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in by_id.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in by_id.logprobs.tokens) and len(ids) == 8
    assert by_id.text == plain.text == env.tok.decode(ids)
    assert [env.tok.decode([i]) for i in ids] == plain.logprobs.tokens
    assert by_id.logprobs.text_offset == plain.logprobs.text_offset  # offsets still count text
    for t, top in zip(by_id.logprobs.tokens, by_id.logprobs.top_logprobs):
        assert t in top and all(k.startswith("token_id:") for k in top)
    chunks = env.client.completions.create(**kw, stream=True, extra_body={"return_tokens_as_token_ids": True})
    assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] \
        == by_id.logprobs.tokens
    chat = env.client.chat.completions.create(model="a0", messages=MESSAGES, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=1,
                                              extra_body={"return_tokens_as_token_ids": True}).choices[0]
    cids = [int(e.token.removeprefix("token_id:")) for e in chat.logprobs.content]
    assert env.tok.decode(cids) == chat.message.content
    assert all(e.top_logprobs[0].token.startswith("token_id:") for e in chat.logprobs.content)
