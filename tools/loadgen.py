"""The load generator behind benchmarks/load.py and tests/e2e/test_reliability.py: a request plan over
many adapters, concurrent and sequential runs over httpx (streaming and not, completions and chat), and a
report of throughput, TTFT, latency percentiles, errors, lost and truncated responses and every output that
differs from its sequential run. Also: copies of the demo adapters and a demo server to run against."""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from tools.serverlib import REPO, ServerProcess

DEMO = REPO / "demo"
WORDS = "ant bee cat dog egg fox gem hat ink jam key lamp moon nut owl pig".split()


# -- adapters and request plans ------------------------------------------------------------------------------
def make_adapters(out: Path, n: int, seed: int = 0, strength: float = 0.5) -> dict[str, str]:
    """n PEFT adapters a00.. in `out`: copies of the demo adapters (reverse, upper, sort in turn) with every
    lora_B entry scaled by (1 + strength * N(0, 1)), seeded per adapter: the task mostly survives and,
    with ignore_eos, each adapter's continuation differs, so serving one adapter's request with another's
    weights shows in the output."""
    import torch
    from safetensors.torch import load_file, save_file

    paths: dict[str, str] = {}
    for k in range(n):
        src = DEMO / "adapters" / ("reverse", "upper", "sort")[k % 3]
        dst = out / f"a{k:02d}"
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")
        tensors = load_file(str(src / "adapter_model.safetensors"))
        g = torch.Generator().manual_seed(seed * 1000 + k)
        for key, v in tensors.items():
            if "lora_B" in key:
                tensors[key] = (v.float() * (1 + strength * torch.randn(v.shape, generator=g))).to(v.dtype)
        save_file(tensors, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
        paths[dst.name] = str(dst)
    return paths


def demo_prompt(rng: random.Random) -> str:
    return "words: " + " ".join(rng.sample(WORDS, rng.randint(3, 6))) + " =>"


@dataclass(frozen=True)
class Spec:
    """One request of the plan."""

    index: int
    kind: str  # "cmpl" | "chat"
    model: str
    prompt: str
    max_tokens: int
    stream: bool
    ignore_eos: bool
    temperature: float = 0.0
    seed: int | None = None
    logprobs: int | None = None

    @property
    def key(self) -> tuple:
        """What decides the output (streaming does not)."""
        return (self.kind, self.model, self.prompt, self.max_tokens, self.ignore_eos, self.temperature, self.seed,
                self.logprobs)

    def body(self) -> dict[str, Any]:
        b: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                             "ignore_eos": self.ignore_eos, "stream": self.stream}
        if self.kind == "chat":
            b["messages"] = [{"role": "user", "content": self.prompt}]
            if self.logprobs is not None:
                b.update(logprobs=True, top_logprobs=self.logprobs)
        else:
            b["prompt"] = self.prompt
            if self.logprobs is not None:
                b["logprobs"] = self.logprobs
        if self.seed is not None:
            b["seed"] = self.seed
        if self.stream:
            b["stream_options"] = {"include_usage": True}
        return b

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


def build_plan(n: int, models: list[str], base: str, seed: int = 0, max_tokens: int = 24) -> list[Spec]:
    """n requests, spread round-robin over the adapters with every 10th on the base model; half streamed;
    a quarter chat; a fifth seeded sampling (temperature 0.8), the rest greedy; a third with ignore_eos
    (full length, so they run long and their continuation tells adapters apart); some with logprobs."""
    rng = random.Random(seed)
    specs: list[Spec] = []
    for i in range(n):
        model = base if i % 10 == 9 else models[(i - i // 10) % len(models)]  # every adapter in turn
        sampled = i % 5 == 3
        specs.append(Spec(
            index=i, kind="chat" if i % 4 == 1 else "cmpl", model=model, prompt=demo_prompt(rng),
            max_tokens=max_tokens if i % 3 == 0 else max(4, max_tokens // 2), stream=i % 2 == 0,
            ignore_eos=i % 3 == 0, temperature=0.8 if sampled else 0.0, seed=1000 + i if sampled else None,
            logprobs=2 if i % 7 == 0 else None))
    return specs


# -- running -------------------------------------------------------------------------------------------------
@dataclass
class Result:
    spec: Spec
    status: int | None = None
    error: str | None = None  # HTTP error body, stream error event, or transport failure
    lost: bool = False  # no response at all (transport error, timeout)
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    logprob_tokens: int | None = None
    done: bool = False  # streams: saw data: [DONE]
    ttft: float | None = None
    latency: float | None = None

    @property
    def output(self) -> tuple:
        return self.text, self.finish_reason, self.completion_tokens

    def truncation(self) -> str | None:
        """Why a successful-looking response is incomplete, else None."""
        s = self.spec
        if self.status != 200 or self.error is not None or self.lost:
            return None
        if s.stream and not self.done:
            return "stream ended without [DONE]"
        if self.finish_reason not in ("stop", "length"):
            return f"finish_reason {self.finish_reason!r}"
        if self.completion_tokens is None or self.completion_tokens < 1:
            return "no usage / no tokens"
        if self.finish_reason == "length" and self.completion_tokens != s.max_tokens:
            return f"finish_reason length after {self.completion_tokens} of {s.max_tokens} tokens"
        if s.ignore_eos and self.finish_reason != "length":
            return "ignore_eos request stopped early"
        if s.logprobs is not None and self.logprob_tokens != self.completion_tokens:
            return f"{self.logprob_tokens} logprob entries for {self.completion_tokens} tokens"
        return None


def _choice_text(spec: Spec, choice: dict[str, Any]) -> str:
    if spec.kind == "chat":
        return (choice.get("delta") or choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def _logprob_count(spec: Spec, choice: dict[str, Any]) -> int:
    lp = choice.get("logprobs")
    if not lp:
        return 0
    return len(lp.get("content") or []) if spec.kind == "chat" else len(lp.get("tokens") or [])


async def run_one(client: httpx.AsyncClient, spec: Spec, first_chunk: asyncio.Event | None = None) -> Result:
    """One request; first_chunk (streams) is set when the first text arrives."""
    r = Result(spec)
    t0 = time.perf_counter()
    try:
        if spec.stream:
            await _stream(client, spec, r, t0, first_chunk)
        else:
            resp = await client.post(spec.path, json=spec.body())
            r.status = resp.status_code
            data = resp.json()
            if resp.status_code != 200:
                r.error = json.dumps(data.get("error", data))[:500]
            else:
                ch = data["choices"][0]
                r.text, r.finish_reason = _choice_text(spec, ch), ch.get("finish_reason")
                r.completion_tokens = data.get("usage", {}).get("completion_tokens")
                r.logprob_tokens = _logprob_count(spec, ch) if spec.logprobs is not None else None
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, asyncio.TimeoutError) as e:
        r.lost, r.error = True, f"{type(e).__name__}: {e}"[:500]
    r.latency = time.perf_counter() - t0
    return r


_EOL = re.compile(r"\r\n|\r|\n")


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The body's lines as SSE splits them (CRLF, CR or LF). httpx's aiter_lines also splits on U+0085, U+2028,
    U+2029, ... which a JSON data line may hold unescaped (a random model's text does), and then the JSON of
    that chunk looks cut."""
    buf = ""
    async for text in resp.aiter_text():
        buf += text
        cut = len(buf) - buf.endswith("\r")  # a CR at the end may be the first half of a CRLF
        *lines, rest = _EOL.split(buf[:cut])
        buf = rest + buf[cut:]
        for line in lines:
            yield line
    if buf:
        yield buf.rstrip("\r")


async def _stream(client: httpx.AsyncClient, spec: Spec, r: Result, t0: float,
                  first_chunk: asyncio.Event | None) -> None:
    async with client.stream("POST", spec.path, json=spec.body()) as resp:
        r.status = resp.status_code
        if resp.status_code != 200:
            r.error = (await resp.aread()).decode(errors="replace")[:500]
            return
        lp = 0
        async for line in sse_lines(resp):
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                r.done = True
                continue
            ev = json.loads(payload)
            if "error" in ev:
                r.error = json.dumps(ev["error"])[:500]
                continue
            for ch in ev.get("choices") or []:
                piece = _choice_text(spec, ch)
                if piece and r.ttft is None:
                    r.ttft = time.perf_counter() - t0
                    if first_chunk is not None:
                        first_chunk.set()
                r.text += piece
                lp += _logprob_count(spec, ch)
                r.finish_reason = ch.get("finish_reason") or r.finish_reason
            if ev.get("usage"):
                r.completion_tokens = ev["usage"]["completion_tokens"]
        r.logprob_tokens = lp if spec.logprobs is not None else None


def client_for(url: str, headers: dict[str, str], concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    host = urlparse(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"refusing to load {url}: loopback only")
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s,
                             limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency))


async def run_load(url: str, headers: dict[str, str], specs: list[Spec], concurrency: int,
                   timeout_s: float = 600.0) -> tuple[list[Result], float]:
    """All specs with at most `concurrency` in flight; each bounded by timeout_s. -> (results, wall seconds)."""
    sem = asyncio.Semaphore(concurrency)
    async with client_for(url, headers, concurrency, timeout_s) as client:
        async def one(spec: Spec) -> Result:
            async with sem:
                try:
                    return await asyncio.wait_for(run_one(client, spec), timeout_s)
                except asyncio.TimeoutError:
                    return Result(spec, lost=True, error=f"no complete answer within {timeout_s} s")

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(s) for s in specs))
        return list(results), time.perf_counter() - t0


async def run_sequential(url: str, headers: dict[str, str], specs: list[Spec],
                         timeout_s: float = 600.0) -> dict[tuple, Result]:
    """Each distinct request alone, one after another, not streamed: the reference outputs."""
    refs: dict[tuple, Result] = {}
    async with client_for(url, headers, 1, timeout_s) as client:
        for s in specs:
            if s.key not in refs:
                single = Spec(**{**asdict(s), "stream": False})
                refs[s.key] = await asyncio.wait_for(run_one(client, single), timeout_s)
    return refs


# -- report --------------------------------------------------------------------------------------------------
def percentile(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs)) - 1))], 4)


@dataclass
class Report:
    requests: int
    wall_s: float
    ok: int = 0
    errors: int = 0
    lost: int = 0
    truncated: int = 0
    mismatched: int = 0
    reference_errors: int = 0
    output_tokens: int = 0
    req_per_s: float = 0.0
    tok_per_s: float = 0.0
    ttft_s: dict[str, float | None] = field(default_factory=dict)
    latency_s: dict[str, float | None] = field(default_factory=dict)
    adapters: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.ok == self.requests  # each result counts once: ok, or one of the failure kinds


def summarize(results: list[Result], wall_s: float, refs: dict[tuple, Result] | None) -> Report:
    rep = Report(requests=len(results), wall_s=round(wall_s, 3))
    for r in results:
        why = None
        if r.lost:
            rep.lost += 1
            why = f"lost: {r.error}"
        elif r.status != 200 or r.error is not None:
            rep.errors += 1
            why = f"HTTP {r.status}: {r.error}"
        elif (t := r.truncation()) is not None:
            rep.truncated += 1
            why = f"truncated: {t}"
        elif refs is not None:
            ref = refs[r.spec.key]
            if ref.status != 200 or ref.error is not None:
                rep.reference_errors += 1
                why = f"sequential run failed: {ref.error}"
            elif ref.output != r.output:
                rep.mismatched += 1
                why = f"differs from its sequential run: {r.output!r} != {ref.output!r}"
        if why is None:
            rep.ok += 1
        elif len(rep.failures) < 20:
            rep.failures.append(f"#{r.spec.index} {r.spec.model} {'stream' if r.spec.stream else 'plain'}: {why}")
        rep.output_tokens += r.completion_tokens or 0
    rep.req_per_s = round(len(results) / wall_s, 2) if wall_s else 0.0
    rep.tok_per_s = round(rep.output_tokens / wall_s, 1) if wall_s else 0.0
    ttft = [r.ttft for r in results if r.ttft is not None]
    lat = [r.latency for r in results if r.latency is not None and not r.lost]
    rep.ttft_s = {f"p{p}": percentile(ttft, p) for p in (50, 90, 99)} | {"max": percentile(ttft, 100)}
    rep.latency_s = {f"p{p}": percentile(lat, p) for p in (50, 90, 99)} | {
        "max": percentile(lat, 100), "mean": round(statistics.fmean(lat), 4) if lat else None}
    rep.adapters = len({r.spec.model for r in results})
    return rep


# -- the demo server -----------------------------------------------------------------------------------------
def start_demo_server(work: Path, n_adapters: int, max_loras: int,
                      env: dict[str, str] | None = None) -> tuple[ServerProcess, dict[str, str]]:
    """`python -m server` on the demo model with n copies of the demo adapters (ready when it returns)."""
    root = work / "adapters"
    paths = make_adapters(root, n_adapters)
    flags = ["--max-loras", str(max_loras), "--lora-root", str(root),
             "--lora-modules", *(f"{n}={p}" for n, p in paths.items())]
    srv = ServerProcess(str(DEMO / "model"), flags, work / "server.log", env)
    srv.wait_ready()
    return srv, paths
