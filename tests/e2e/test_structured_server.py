"""Structured output, tool calls and reasoning through a real `python -m server` and the real openai client,
on a copy of the CPU demo (its tokenizer given Qwen3's <think> / <tool_call> tokens and a Qwen3-style
template with tools) serving the base model and two adapters. The demo model knows no JSON: every valid
output below is the grammar's doing, checked with jsonschema / re, concurrently across base + adapters."""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tools.serverlib import API_KEY, REPO, ServerProcess

# Qwen3's template, its tool-calling parts included (system + <tools>, assistant tool_calls, tool responses);
# `think_open` makes the generation prompt open the think block, as Qwen3.5's does.
QWEN3_TOOLS_TEMPLATE = r"""{%- if tools %}{{- '<|im_start|>system\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
{%- elif message.role == "assistant" %}{{- '<|im_start|>' + message.role + '\n' + message.content }}
{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}
{%- if (loop.first and message.content) or (not loop.first) %}{{- '\n' }}{%- endif %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}{%- endfor %}{%- endif %}{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- if think_open is defined and think_open %}{{- '<think>\n' }}{%- endif %}{%- endif %}"""

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                   "ok": {"type": "boolean"}},
                  "required": ["age", "ok"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MODELS = ("model", "reverse", "upper")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    model = root / "model"
    shutil.copytree(REPO / "demo" / "model", model)
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])  # ids 396..399 < 448 (padded vocab)
    tok.chat_template = QWEN3_TOOLS_TEMPLATE
    tok.save_pretrained(str(model))
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048  # the tools prompt is ~800 byte-level tokens (RoPE has no length limit)
    (model / "config.json").write_text(json.dumps(cfg))
    adapters = [f"{n}={REPO / 'demo' / 'adapters' / n}" for n in ("reverse", "upper")]
    s = ServerProcess(str(model), ["--enable-lora", "--lora-modules", *adapters, "--max-model-len", "1536",
                                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                   "--reasoning-parser", "qwen3"], root / "server.log")
    try:
        s.wait_ready()
        s.tok = AutoTokenizer.from_pretrained(str(model))
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        s.aclient = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        yield s
    finally:
        s.stop()


def _json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}


def test_json_schema_base_and_two_adapters_in_one_concurrent_batch(srv) -> None:
    async def one(model: str, i: int, stream: bool) -> list[tuple[str, str]]:
        kw = dict(model=model, max_tokens=200, temperature=1.0, seed=i, n=2)
        fmt = _json_format(SCHEMA)
        if i % 3 == 2:  # chat too, with reasoning off (the grammar starts at once)
            msgs = [{"role": "user", "content": f"describe pet {i}"}]
            if stream:
                got: dict[int, list[str]] = {0: [], 1: []}
                done: dict[int, str] = {}
                async for ch in await srv.aclient.chat.completions.create(messages=msgs, stream=True, response_format=fmt,
                                                                          extra_body=NO_THINK, **kw):
                    for c in ch.choices:
                        got[c.index].append(c.delta.content or "")
                        if c.finish_reason:
                            done[c.index] = c.finish_reason
                return [("".join(got[k]), done[k]) for k in (0, 1)]
            r = await srv.aclient.chat.completions.create(messages=msgs, response_format=fmt, extra_body=NO_THINK, **kw)
            return [(c.message.content, c.finish_reason) for c in r.choices]
        if stream:
            got, done = {0: [], 1: []}, {}
            async for ch in await srv.aclient.completions.create(prompt=f"words: cat ant {i} =>", stream=True,
                                                                 extra_body={"response_format": fmt}, **kw):
                for c in ch.choices:
                    got[c.index].append(c.text)
                    if c.finish_reason:
                        done[c.index] = c.finish_reason
            return [("".join(got[k]), done[k]) for k in (0, 1)]
        r = await srv.aclient.completions.create(prompt=f"words: cat ant {i} =>", extra_body={"response_format": fmt},
                                                 **kw)
        return [(c.text, c.finish_reason) for c in r.choices]

    async def main() -> list[list[tuple[str, str]]]:
        return await asyncio.gather(*(one(m, i, i % 2 == 1) for i in range(6) for m in MODELS))

    outs = [o for group in asyncio.run(main()) for o in group]
    assert len(outs) == 36
    for text, reason in outs:
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in outs}) > 6  # sampled, not one answer repeated


def test_regex_choice_and_json_object(srv) -> None:
    for m in MODELS:
        r = srv.client.completions.create(model=m, prompt="words: pig egg =>", max_tokens=30, temperature=1.0, seed=3,
                                          n=3, extra_body={"structured_outputs": {"regex": r"[a-z]{2,5}-[0-9]{3}"}})
        assert all(re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", c.text) and c.finish_reason == "stop" for c in r.choices)
        r = srv.client.chat.completions.create(model=m, messages=[{"role": "user", "content": "pick"}], max_tokens=10,
                                               temperature=1.0, n=4, extra_body={
                                                   "structured_outputs": {"choice": ["yes", "no", "maybe"]}, **NO_THINK})
        assert all(c.message.content in ("yes", "no", "maybe") for c in r.choices)
    r = srv.client.completions.create(model="model", prompt="words: a =>", max_tokens=300, temperature=0.7, seed=1,
                                      extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:
        assert r.choices[0].text.startswith("{")


@pytest.mark.parametrize(("body", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "nope"),
    ({"structured_outputs": {"regex": "a("}}, "unclosed group"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "undefined_rule"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern"),
    ({"structured_outputs": {"choice": ["a"]}, "min_tokens": 3}, "min_tokens cannot be combined"),
])
def test_invalid_constraints_are_400_and_the_server_keeps_serving(srv, body, words) -> None:
    r = httpx.post(srv.url + "/v1/completions", headers=srv.headers, timeout=60,
                   json={"model": "model", "prompt": "words: a =>", "max_tokens": 4, **body})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert srv.client.completions.create(model="upper", prompt="words: a =>", max_tokens=4).choices[0].text


def _check_call(call, tool: dict) -> None:
    assert call.type == "function" and call.id and call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("model", ["model", "reverse"])
def test_named_tool_choice_returns_a_valid_call_streamed_and_not(srv, model) -> None:
    kw = dict(model=model, messages=[{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER, TIME],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=120,
              temperature=1.0, seed=5, extra_body=NO_THINK)
    r = srv.client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not msg.content and len(msg.tool_calls) == 1, msg
    _check_call(msg.tool_calls[0], WEATHER)
    calls: dict[int, dict] = {}
    finish = None
    for ch in srv.client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            for d in c.delta.tool_calls or ():
                e = calls.setdefault(d.index, {"id": "", "name": "", "args": ""})
                e["id"] += d.id or ""
                e["name"] += (d.function.name or "") if d.function else ""
                e["args"] += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["args"]), WEATHER["function"]["parameters"])


def test_required_tool_choice_calls_one_of_the_tools(srv) -> None:
    r = srv.client.chat.completions.create(
        model="upper", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=200, temperature=1.0, seed=2, n=3, extra_body=NO_THINK)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)


def test_template_with_tools_equals_transformers(srv) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "21 C"}, {"role": "user", "content": "and time?"}]
    r = httpx.post(srv.url + "/tokenize", headers=srv.headers, timeout=60,
                   json={"messages": messages, "tools": [WEATHER, TIME], "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    oracle_msgs = json.loads(json.dumps(messages))
    oracle_msgs[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "c"}  # as vLLM hands it over
    text = srv.tok.apply_chat_template(oracle_msgs, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True)
    assert "<tools>" in text and "<tool_response>" in text
    assert r.json()["tokens"] == srv.tok.encode(text, add_special_tokens=False)


def test_reasoning_split_streamed_and_whole_with_the_grammar_after_think(srv) -> None:
    """The prompt opens <think> (as Qwen3.5's does): a bias on </think> makes the model close it after some
    free reasoning; the answer after </think> follows the regex, the reasoning does not."""
    close = srv.tok.convert_tokens_to_ids("</think>")
    kw = dict(model="model", messages=[{"role": "user", "content": "think"}], max_tokens=200, temperature=1.0,
              seed=11, logit_bias={str(close): 12},
              extra_body={"structured_outputs": {"regex": "(yes|no)"}, "chat_template_kwargs": {"think_open": True}})
    r = srv.client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    assert c.message.reasoning_content and "</think>" not in c.message.reasoning_content
    assert c.message.content in ("yes", "no")
    parts = {"reasoning": "", "content": ""}
    for ch in srv.client.chat.completions.create(stream=True, **kw):
        for d in ch.choices:
            parts["reasoning"] += getattr(d.delta, "reasoning_content", None) or ""
            parts["content"] += d.delta.content or ""
    assert parts == {"reasoning": c.message.reasoning_content, "content": c.message.content}
    off = srv.client.chat.completions.create(model="model", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=8, temperature=0, extra_body=NO_THINK)
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_grammar_compile_time_and_cache_hits_in_metrics(srv) -> None:
    before = srv.metrics()
    body = {"structured_outputs": {"regex": "[a-c]{1,4}x[0-9]"}}  # a pattern no other test uses
    for _ in range(3):
        srv.client.completions.create(model="model", prompt="words: a =>", max_tokens=8, extra_body=body)
    after = srv.metrics()
    delta = {k: after[k] - before.get(k, 0.0) for k in ("xpulora:grammar_compiles_total",
                                                         "xpulora:grammar_cache_hits_total")}
    assert delta == {"xpulora:grammar_compiles_total": 1, "xpulora:grammar_cache_hits_total": 2}
    assert after["xpulora:grammar_compile_seconds_total"] > before.get("xpulora:grammar_compile_seconds_total", 0)
