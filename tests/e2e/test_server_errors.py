"""Every error path of the HTTP API (DESIGN.md §9 status codes, JSON error bodies), after each of which
the server still answers correctly; autoload on first use; 503 when the waiting queue is full; SIGTERM
drains in-flight streams and exits 0 (last test: it stops this module's server)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest

from engine import SamplingParams
from tests.helpers import ALL7, make_lora_engine
from tools.serverlib import ServerProcess
from tools.tinymodels import make_peft_adapter

PROMPT = "hello world engine"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def ctx(model_factory, tmp_path_factory):
    bf16 = model_factory("qwen3", None, False)
    model = model_factory("qwen3", "auto_round", False)
    top = tmp_path_factory.mktemp("errors")
    root, outside = top / "root", top / "outside"
    good = make_peft_adapter(bf16, str(root / "good"), r=8, targets=["q_proj", "v_proj"], seed=3, b_std=0.1)
    auto = make_peft_adapter(bf16, str(root / "auto1"), r=8, targets=ALL7, seed=5, b_std=0.1)
    make_peft_adapter(bf16, str(root / "big"), r=32, targets=["q_proj"], seed=4)
    make_peft_adapter(bf16, str(outside / "evil"), r=8, targets=["q_proj"], seed=6)
    for bad in ("badcfg", "norank", "corrupt"):
        shutil.copytree(good, root / bad)
    (root / "badcfg" / "adapter_config.json").write_text("{not json")
    cfg = json.loads((root / "good" / "adapter_config.json").read_text())
    (root / "norank" / "adapter_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "r"}))
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    os.symlink(outside / "evil", root / "escape")
    flags = ["--enable-lora", "--max-lora-rank", "16", "--max-model-len", "1024", "--max-num-seqs", "2",
             "--max-waiting-requests", "2", "--lora-root", str(root), "--lora-modules", f"good={good}"]
    srv = ServerProcess(model, flags, top / "server-errors.log")
    try:
        engine = make_lora_engine(model, {"good": good, "auto1": auto}, max_lora_rank=16, max_model_len=1024)
        refs = {n: engine.generate([PROMPT], GREEDY, [n])[0].text for n in (None, "good", "auto1")}
        srv.wait_ready()
        http = httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60)
        base = http.get("/v1/models").json()["data"][0]["id"]
        yield {"srv": srv, "http": http, "root": root, "outside": outside, "refs": refs, "base": base}
    finally:
        srv.stop()


def _complete(ctx: dict, model: str | None) -> httpx.Response:
    body = {"model": model or ctx["base"], "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    return ctx["http"].post("/v1/completions", json=body)


def _still_fine(ctx: dict) -> None:
    for name in (None, "good"):
        r = _complete(ctx, name)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ctx["refs"][name], r.text


def _cases(root: Path, outside: Path) -> list[tuple[str, str, dict, int, str]]:
    """(path, kind, payload, status, text in the message); kind "json" sends payload, "raw" sends its body."""
    def load(name: str, path: str | Path) -> dict:
        return {"lora_name": name, "lora_path": str(path)}

    def cmpl(**kw: object) -> dict:
        return {"model": "BASE", "prompt": PROMPT, "max_tokens": 4, **kw}

    chat = {"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return [
        ("/v1/completions", "json", cmpl(model="nope"), 404, "'nope' does not exist"),
        ("/v1/chat/completions", "json", {**chat, "model": "nope"}, 404, "'nope' does not exist"),
        ("/v1/load_lora_adapter", "json", load("m1", root / "missing"), 404, "does not exist"),
        ("/v1/load_lora_adapter", "json", load("m2", outside / "evil"), 403, "outside every --lora-root"),
        ("/v1/load_lora_adapter", "json", load("m3", f"{root}/../outside/evil"), 403, "outside every --lora-root"),
        ("/v1/load_lora_adapter", "json", load("m4", root / "escape"), 403, "outside every --lora-root"),
        ("/v1/load_lora_adapter", "json", load("m5", "../outside/evil"), 403, "outside every --lora-root"),
        ("/v1/load_lora_adapter", "json", load("m6", root / "big"), 400, "max_lora_rank 16"),
        ("/v1/load_lora_adapter", "json", load("m7", root / "badcfg"), 400, "m7"),
        ("/v1/load_lora_adapter", "json", load("m8", root / "norank"), 400, "m8"),
        ("/v1/load_lora_adapter", "json", load("m9", root / "corrupt"), 400, "m9"),
        ("/v1/load_lora_adapter", "json", load("good", root / "auto1"), 400, "already loaded"),
        ("/v1/load_lora_adapter", "json", load("../x", root / "auto1"), 400, "invalid adapter name"),
        ("/v1/load_lora_adapter", "json", load("BASE", root / "auto1"), 400, "base model"),
        ("/v1/load_lora_adapter", "json", {"lora_name": 1, "lora_path": "x"}, 400, "lora_name"),
        ("/v1/unload_lora_adapter", "json", {"lora_name": "never"}, 404, "'never' is not loaded"),
        ("/v1/unload_lora_adapter", "json", {"lora_name": "BASE"}, 400, "base model"),
        ("/v1/completions", "raw", {"body": b'{"model": "x", "prompt": '}, 400, "malformed JSON"),
        ("/v1/chat/completions", "raw", {"body": b"[1, 2"}, 400, "malformed JSON"),
        ("/v1/completions", "json", cmpl(max_tokens="5"), 400, "max_tokens"),
        ("/v1/completions", "json", cmpl(prompt=5), 400, "'prompt' must be"),
        ("/v1/completions", "json", cmpl(temperature="hot"), 400, "temperature"),
        ("/v1/chat/completions", "json", {**chat, "messages": "hi"}, 400, "messages"),
        ("/v1/completions", "json", cmpl(max_tokens=0), 400, "max_tokens must be an integer >= 1"),
        ("/v1/completions", "json", cmpl(max_tokens=1025), 400, "max_model_len 1024"),
        ("/v1/chat/completions", "json", {**chat, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", "json", cmpl(prompt=""), 400, "empty"),
        ("/v1/completions", "json", cmpl(prompt=[]), 400, "empty"),
        ("/v1/chat/completions", "json", {**chat, "messages": []}, 400, "messages"),
        ("/v1/completions", "json", cmpl(best_of=2), 400, "best_of"),
        ("/v1/completions", "json", cmpl(frobnicate=1), 400, "'frobnicate'"),
        ("/v1/completions", "json", cmpl(logit_bias={"100000": 5}), 400, "logit_bias has out-of-vocabulary"),
        ("/v1/completions", "json", cmpl(presence_penalty=2.5), 400, "presence_penalty must be in [-2, 2]"),
        ("/v1/completions", "json", cmpl(repetition_penalty=0), 400, "repetition_penalty must be greater than zero"),
        ("/v1/completions", "json", cmpl(min_p=-0.1), 400, "min_p must be in [0, 1]"),
        ("/v1/completions", "json", cmpl(min_tokens=9, max_tokens=4), 400, "min_tokens must be less than or equal"),
        ("/v1/completions", "json", cmpl(suffix="x"), 400, "suffix"),
        ("/v1/completions", "json", cmpl(echo=True, logprobs=1), 400, "echo"),
        ("/v1/chat/completions", "json", {**chat, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
        ("/v1/chat/completions", "json", {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
         '"auto" tool choice requires --enable-auto-tool-choice'),
        ("/v1/chat/completions", "json", {**chat, "response_format": {"type": "xml"}}, 400, "response_format.type"),
        ("/v1/completions", "json", cmpl(structured_outputs={"regex": "("}), 400, "invalid regex"),
        ("/v1/chat/completions", "json", {**chat, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", "json", {**chat, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/chat/completions", "json",
         {**chat, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400, "images"),
    ]


def test_error_paths_then_still_serving(ctx: dict) -> None:
    http, base = ctx["http"], ctx["base"]
    models_before = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert models_before == [base, "good"]
    for path, kind, payload, status, text in _cases(ctx["root"], ctx["outside"]):
        if kind == "raw":
            r = http.post(path, content=payload["body"], headers={"Content-Type": "application/json"})
        else:
            r = http.post(path, json=json.loads(json.dumps(payload).replace('"BASE"', json.dumps(base))))
        case = f"{path} {payload}"
        assert r.status_code == status, (case, r.text)
        err = r.json()["error"]
        assert text in err["message"] and err["code"] == status and err["type"], (case, err)
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == models_before, case  # nothing registered
        _still_fine(ctx)


def test_auth(ctx: dict) -> None:
    url = ctx["srv"].url
    body = {"model": ctx["base"], "prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 401
    for open_path in ("/health", "/metrics", "/version"):
        assert httpx.get(url + open_path).status_code == 200
    _still_fine(ctx)


def test_autoload_on_first_use_loads_once(ctx: dict) -> None:
    srv = ctx["srv"]
    loads = srv.metrics()["xpulora:lora_adapter_loads_total"]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, headers=srv.headers, timeout=60) as http:
            body = {"model": "auto1", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(4)))

    rs = asyncio.run(burst())
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    assert {r.json()["choices"][0]["text"] for r in rs} == {ctx["refs"]["auto1"]}
    assert srv.metrics()["xpulora:lora_adapter_loads_total"] == loads + 1
    card = next(m for m in ctx["http"].get("/v1/models").json()["data"] if m["id"] == "auto1")
    assert card["parent"] == ctx["base"] and card["root"] == os.path.realpath(ctx["root"] / "auto1")
    for name, code in (("escape", 404), ("missing", 404), ("big", 400)):  # out of the root / no folder / invalid
        r = _complete(ctx, name)
        assert r.status_code == code and r.json()["error"]["code"] == code, r.text
    assert ctx["http"].post("/v1/unload_lora_adapter", json={"lora_name": "auto1"}).status_code == 200
    _still_fine(ctx)


def test_full_waiting_queue_answers_503(ctx: dict) -> None:
    srv = ctx["srv"]
    # Long enough to still run when the 5th request comes; all four are aborted at the end.
    body = {"model": "good", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    streams = [httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=srv.headers, timeout=60)
               for _ in range(4)]
    opened, readers = [], []  # keep the line iterators: a dropped one closes its connection
    try:
        for s in streams[:2]:  # --max-num-seqs 2: these two run
            opened.append(s.__enter__())
            readers.append(opened[-1].iter_lines())
            assert next(readers[-1]).startswith("data: {")
        for s in streams[2:]:  # these two wait
            opened.append(s.__enter__())
            assert opened[-1].status_code == 200
        assert srv.wait_metrics(lambda m: m["xpulora:num_requests_waiting"] == 2)["xpulora:num_requests_waiting"] == 2
        r = _complete(ctx, None)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
        assert "overloaded" in r.json()["error"]["message"]
    finally:
        for s in streams[: len(opened)]:
            s.__exit__(None, None, None)  # disconnect: all four are aborted
    assert srv.wait_idle()["xpulora:kv_cache_usage_perc"] == 0.0
    _still_fine(ctx)


def test_sigterm_finishes_in_flight_and_exits_0(ctx: dict) -> None:
    srv = ctx["srv"]
    body = {"model": "good", "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=srv.headers, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        srv.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 30  # finished, not cut
    assert srv.proc.wait(60) == 0, srv.log_tail()
    with pytest.raises(httpx.TransportError):
        httpx.get(srv.url + "/health", timeout=2)
