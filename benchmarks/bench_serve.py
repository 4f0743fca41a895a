"""The server against the offline engine on the same model, adapters and request plan, in one run: what a
user gets over HTTP (a real `python -m server`, concurrent streaming clients) next to what `LLMEngine` does
with the same requests and the same number in flight. One JSON line per concurrency:

    server_tokens_per_s, offline_tokens_per_s, ratio (server / offline), ttft_s p50/p99, itl_s p50/p99
    (inter-token latency: the gaps between a stream's chunks), offline_ms_per_step; and bench_e2e's pure
    decode at the same batch on the same engine (decode_tokens_per_s, decode_ms_per_step): server_vs_decode
    and offline_step_vs_decode are the issue's two ratios (server tokens/s vs bench_e2e, loop step vs its);
    steady_vs_decode the first over the window in which all streams are open (no opening burst, no drain).
    ceiling_tokens_per_s (plan_ceiling, from pure decode at 1, c/4, c/2, 3c/4 and c rows): what the plan's
    opening and drain leave of pure decode to a server whose prompts cost nothing; server_vs_ceiling.
    prefill_us_per_token: the plan's opening burst (c prompts, one token each) at the idle offline engine, its
    last token's time over its prompt tokens (bench_burst's burst, the better of two); prompt_ceiling_tokens_per_s
    (prompt_ceiling): the ceiling with every prompt token costing that on top: what a server that computes the
    plan's prompts at the engine's best prefill rate reaches at most; server_vs_prompt_ceiling.
    server_core / offline_core: what the steps held on each side (rows and tokens per step, the share of mixed
    steps), the core's host ms per step inside core_step and that time over the wall (busy; the rest of a
    server's wall is the core loop waiting for or moving messages), and api_output_busy: the API process's
    receiver thread turning outputs into text, over the wall. idle: the core's time blocked on its inbox with
    nothing to run, over the wall (its counter reaches /metrics once per 0.1 s of idling: +-0.1 s).

Requests: token-id prompts of 16-64 tokens, greedy, ignore_eos, max_tokens between half and all of
--new-tokens, spread round-robin over the adapters and the base model (every (adapters+1)-th request).

    python benchmarks/bench_serve.py --layers 36 --adapters 32 --batches 32 64 --requests 256 --new-tokens 128 \
        --clients 4
    python benchmarks/bench_serve.py --quick          # tiny shapes on the CPU (smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import msgspec

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_burst import burst
from benchmarks.bench_e2e import emit, engine_config, model_args, ours, synchronous, write_model
from engine import LLMEngine, SamplingParams
from engine.gc_pauses import GcPauses
from tools.loadgen import percentile, sse_lines
from tools.serverlib import ServerProcess


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    model: str | None
    """Adapter name; None is the base model."""
    max_tokens: int


def plan(n: int, n_adapters: int, new_tokens: int, vocab: int, seed: int = 0) -> list[Req]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = i % (n_adapters + 1)
        out.append(Req([rng.randrange(vocab) for _ in range(rng.randint(16, 64))],
                       f"a{k}" if k < n_adapters else None, rng.randint(max(1, new_tokens // 2), new_tokens)))
    return out


def offline(e: LLMEngine, reqs: list[Req], concurrency: int, texts: list[str] | None = None) -> dict[str, float]:
    """The plan through the engine with at most `concurrency` requests in flight (a new one is added as one
    ends, as concurrent clients do); each request's text goes to texts[i] when given."""
    pending = list(enumerate(reqs))[::-1]
    steps = 0

    def add() -> None:
        i, r = pending.pop()
        e.add_request(str(i), r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True,
                                                       logprobs=0), r.model)

    for _ in range(min(concurrency, len(pending))):
        add()
    e.device.synchronize()
    c0 = msgspec.structs.replace(e.steps)
    hits0 = e.blocks.num_hits
    pauses = GcPauses().install()  # this process's collections (an offline engine's caller's heap is not frozen)
    t0 = time.perf_counter()
    while e.has_unfinished():
        for out in e.step():
            if texts is not None:
                texts[int(out.request_id)] += out.new_text
            if out.finished and pending:
                add()
        steps += 1
    e.device.synchronize()
    dt = time.perf_counter() - t0
    pauses.uninstall()
    tokens = sum(r.max_tokens for r in reqs)
    c = e.steps
    core = step_summary(c.steps - c0.steps, c.sequences - c0.sequences, c.tokens - c0.tokens, c.mixed - c0.mixed,
                        c.seconds - c0.seconds, dt)
    core |= {"gc_ms": round(1e3 * pauses.total_seconds, 1), "gc_full": pauses.collections[2],
             "prefix_hit_tokens": e.blocks.num_hits - hits0}
    return {"offline_tokens_per_s": tokens / dt, "offline_ms_per_step": 1e3 * dt / steps, "offline_steps": steps,
            "offline_core": core}


def plan_ceiling(reqs: list[Req], concurrency: int, ms_at: dict[int, float]) -> float:
    """Tokens/s of an ideal server on this plan: prompts cost nothing, an ended request's row is refilled in the
    next step, and a step of b rows costs pure decode at b rows (ms_at, measured; linear in between). What the
    plan's opening and drain allow against pure decode at full batch, whatever the serving path does."""
    batches = sorted(ms_at)

    def ms(b: int) -> float:
        hi = next(x for x in batches if x >= b)
        lo = max((x for x in batches if x <= b), default=hi)
        return ms_at[lo] if hi == lo else ms_at[lo] + (ms_at[hi] - ms_at[lo]) * (b - lo) / (hi - lo)

    pending = [r.max_tokens for r in reversed(reqs)]
    running = [pending.pop() for _ in range(min(concurrency, len(pending)))]
    tokens, wall_ms = 0, 0.0
    while running:
        tokens += len(running)
        wall_ms += ms(len(running))
        running = [t - 1 for t in running if t > 1]
        while len(running) < concurrency and pending:
            running.append(pending.pop())
    return 1e3 * tokens / wall_ms


def prompt_ceiling(reqs: list[Req], ceiling: float, s_per_token: float) -> float:
    """plan_ceiling's tokens/s with the plan's prompt tokens computed at s_per_token each, added to its wall."""
    generated = sum(r.max_tokens for r in reqs)
    return generated / (generated / ceiling + s_per_token * sum(len(r.prompt) for r in reqs))


def prefill_rate(e: LLMEngine, c: int, n_adapters: int, vocab: int) -> float:
    """Seconds per prompt token of a c-prompt burst of the plan's kind at the idle engine, the better of two."""
    names: list[str | None] = [*(f"a{i}" for i in range(n_adapters)), None]
    runs = [burst(e, c, names, vocab, 40_000 + 100 * r + c) for r in range(2)]
    return min(1e-3 * r["last_ms"] / sum(t for t, _ in r["steps"]) for r in runs)


def step_summary(steps: int, sequences: int, tokens: int, mixed: int, seconds: float, wall: float
                 ) -> dict[str, float]:
    """What a run's steps held and cost, from the engine's StepCounts (offline) or /metrics (server): rows and
    tokens per step, the mixed steps' share, host ms per step inside core_step, and that time over the wall."""
    n = max(steps, 1)
    return {"steps": steps, "rows_per_step": round(sequences / n, 2), "tokens_per_step": round(tokens / n, 2),
            "mixed_share": round(mixed / n, 3), "ms_per_step": round(1e3 * seconds / n, 3),
            "busy": round(seconds / wall, 3) if wall else 0.0}


@dataclass
class Stream:
    tokens: int = 0
    text: str = ""
    ttft: float | None = None
    seconds: float = 0.0
    """From the request's send to its stream's end (summed over streams / wall: the streams open on average)."""
    gaps: list[float] = field(default_factory=list)
    error: str | None = None
    start: float = 0.0
    """time.time() at the send (comparable across the client processes)."""

    def chunk_times(self) -> list[float]:
        if self.ttft is None:
            return []
        out = [self.start + self.ttft]
        for g in self.gaps:
            out.append(out[-1] + g)
        return out


async def one(client: httpx.AsyncClient, base: str, r: Req) -> Stream:
    s, t0 = Stream(start=time.time()), time.perf_counter()
    # logprobs=0: every token is a chunk. Without it a token with no text of its own sends nothing, and the
    # random checkpoints' tokenizer (420 ids) has no text for nearly every id of their 151936-id vocabulary:
    # TTFT and the chunk gaps would time the rare printable tokens, not the server.
    body = {"model": r.model or base, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0}
    last = t0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            s.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            return s
        async for line in sse_lines(resp):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                s.error = json.dumps(ev["error"])[:300]
            if ev.get("choices"):
                s.text += ev["choices"][0]["text"]
                now = time.perf_counter()
                if s.ttft is None:
                    s.ttft = now - t0
                else:
                    s.gaps.append(now - last)
                last = now
            if ev.get("usage"):
                s.tokens = ev["usage"]["completion_tokens"]
    s.seconds = time.perf_counter() - t0
    return s


async def _streams(url: str, headers: dict[str, str], base: str, reqs: list[Req], concurrency: int
                   ) -> tuple[list[Stream], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        async def bounded(r: Req) -> Stream:
            async with sem:
                return await one(client, base, r)

        t0 = time.perf_counter()
        streams = await asyncio.gather(*(bounded(r) for r in reqs))
        return list(streams), time.perf_counter() - t0


def _client(url: str, headers: dict[str, str], base: str, reqs: list[Req], concurrency: int
            ) -> tuple[list[Stream], float, float]:
    """One client process's share of the plan: its streams, the CPU seconds it used and its start (time.time())."""
    start = time.time()
    c0 = time.process_time()
    streams, _ = asyncio.run(_streams(url, headers, base, reqs, concurrency))
    return streams, time.process_time() - c0, start


async def _touch(url: str, headers: dict[str, str]) -> None:
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        (await client.get("/v1/models")).raise_for_status()


def _pid_after(seconds: float, url: str, headers: dict[str, str]) -> int:
    """Hold this worker `seconds`, after one request through the HTTP stack the streams use: its first use in a
    process (lazy imports, the connection machinery) cost tens of ms that a stream's TTFT would otherwise count."""
    asyncio.run(_touch(url, headers))
    time.sleep(seconds)
    return os.getpid()


def _start_workers(pool: ProcessPoolExecutor, n: int, url: str, headers: dict[str, str]) -> None:
    """Return once all n workers run, each with its HTTP client used once: a spawned worker imports this module
    (torch included, seconds), and a client that starts seconds after the others leaves the server's batch that
    much emptier."""
    pids: set[int] = set()
    while len(pids) < n:  # n tasks that each hold a worker 0.2 s land on n workers once all are up
        pids |= set(pool.map(_pid_after, [0.2] * n, [url] * n, [headers] * n))


_CORE = tuple(f"xpulora:engine_{n}_total" for n in ("steps", "step_sequences", "step_tokens", "mixed_steps",
                                                     "step_seconds", "admitted", "queue_seconds", "idle_seconds"))


def core_between(a: dict[str, float], b: dict[str, float], wall: float) -> dict[str, float | None]:
    """step_summary of the core's counters between two /metrics samples `wall` seconds apart, its idle share and
    the mean queue wait (ms) of the requests admitted between them."""
    steps, seqs, tokens, mixed, seconds, admitted, queue, idle = (b[k] - a[k] for k in _CORE)
    out: dict[str, float | None] = {**step_summary(round(steps), round(seqs), round(tokens), round(mixed), seconds,
                                                   wall)}
    out["idle"] = round(idle / wall, 3)
    out["queue_ms"] = round(1e3 * queue / admitted, 2) if admitted >= 1 else None
    return out


class MetricsPoller(threading.Thread):
    """The core's counters from /metrics every `period` s while a run goes on, stamped with time.time(), so that
    a window found afterwards (the steady state) gets its own step figures. Each /metrics holds the core's
    counters as of its last Outputs message (one per step): the samples lag the core by at most a step."""

    def __init__(self, srv: ServerProcess, period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.srv, self.period = srv, period
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period):
            m = self.srv.metrics()
            self.samples.append((time.time(), {k: m[k] for k in _CORE}))

    def at(self, t: float) -> dict[str, float]:
        """The counters at time t, interpolated linearly between the samples around it."""
        s = self.samples
        i = next((i for i, (ts, _) in enumerate(s) if ts >= t), len(s) - 1)
        if i == 0 or s[i][0] < t:
            return s[i][1]
        (ta, a), (tb, b) = s[i - 1], s[i]
        f = (t - ta) / (tb - ta)
        return {k: a[k] + f * (b[k] - a[k]) for k in _CORE}

    def window(self, t0: float, t1: float) -> dict[str, float | None]:
        """core_between the counters at t0 and t1 ({} without two samples)."""
        if len(self.samples) < 2 or t1 <= t0:
            return {}
        return core_between(self.at(t0), self.at(t1), t1 - t0)


def served(srv: ServerProcess, base: str, reqs: list[Req], concurrency: int, texts: list[str] | None = None,
           clients: int = 1) -> dict[str, object]:
    """The plan over HTTP with at most `concurrency` streams open, spread over `clients` processes (request i
    goes to client i % clients, each with concurrency / clients streams): one Python client parsing every SSE
    event of 64 fast streams can saturate its core, and then it, not the server, sets the latencies.
    client_cpu is the busiest client's CPU time over the wall time (near 1: the client was the limit);
    ttft_after_burst_s leaves out each stream's first request (the opening burst, which arrives at once), and
    ttft_burst_s has only those; steady_tokens_per_s the tokens/s while all `concurrency` streams stay open
    (after the burst's first tokens, until the first client's last send; steady_window_s long);
    client_start_s the latest client's start after the clock's; open_streams the streams open on average (each
    from its send to its end, over the wall: the most the server's steps can hold).
    text_mismatch counts the requests whose text differs from texts (the offline run's; informational: on a
    GPU a different batch composition can flip a near tie)."""
    clients = max(1, min(clients, concurrency))
    parts = [list(range(i, len(reqs), clients)) for i in range(clients)]
    streams: list[Stream] = [Stream()] * len(reqs)
    with ProcessPoolExecutor(clients, mp_context=mp.get_context("spawn")) as pool:
        _start_workers(pool, clients, srv.url, srv.headers)  # the workers start before the clock does
        m0 = srv.metrics()
        poller = MetricsPoller(srv)
        poller.start()
        t0, t0_wall = time.perf_counter(), time.time()
        futures = [pool.submit(_client, srv.url, srv.headers, base, [reqs[j] for j in idx],
                               max(1, concurrency // clients)) for idx in parts]
        done = [f.result() for f in futures]
        dt = time.perf_counter() - t0
        poller.done.set()
        poller.join()
        m1 = srv.metrics()  # every stream has ended: the core's last message, with its counters, has arrived
    core = core_between(m0, m1, dt)
    ttft_n = m1["xpulora:time_to_first_token_seconds_count"] - m0["xpulora:time_to_first_token_seconds_count"]
    core["api_ttft_ms"] = round(1e3 * (m1["xpulora:time_to_first_token_seconds_sum"]
                                       - m0["xpulora:time_to_first_token_seconds_sum"]) / ttft_n, 2) if ttft_n else None
    # prompt tokens served from the prefix cache (a run's prompts are its own: 0 unless a plan repeats)
    core["prefix_hit_tokens"] = int(m1["xpulora:prefix_cache_hits_total"] - m0["xpulora:prefix_cache_hits_total"])
    core["api_output_busy"] = round((m1["xpulora:api_output_seconds_total"] - m0["xpulora:api_output_seconds_total"])
                                    / dt, 3)
    for proc in ("api", "engine_core"):  # garbage-collection pauses in the run, each a stall of that process's loop
        key = f'{{process="{proc}"}}'
        core[f"gc_ms_{proc}"] = round(1e3 * (m1["xpulora:gc_seconds_total" + key]
                                             - m0["xpulora:gc_seconds_total" + key]), 1)
        core[f"gc_full_{proc}"] = int(m1["xpulora:gc_full_collections_total" + key]
                                      - m0["xpulora:gc_full_collections_total" + key])
    for idx, (part, _, _) in zip(parts, done):
        for j, st in zip(idx, part):
            streams[j] = st
    errors = [st.error for st in streams if st.error]
    wrong = sum(st.tokens != r.max_tokens for st, r in zip(streams, reqs) if not st.error)
    ttft = [st.ttft for st in streams if st.ttft is not None]
    # the opening burst: request i of a client with c streams is among its first requests for i < c; the rest
    # are sent once an earlier one has ended
    per_client = max(1, concurrency // clients)
    burst: list[float] = []
    steady: list[float] = []
    for idx in parts:
        for pos, j in enumerate(idx):
            if (t := streams[j].ttft) is not None:
                (burst if pos < per_client else steady).append(t)
    burst.sort()
    gaps = [g for st in streams for g in st.gaps]
    # Steady state: from the moment every stream of the opening burst has its first token (the batch is full)
    # to the first client's last send (from then on fewer streams stay open): tokens delivered in that window
    # over its length, the figure comparable to a decode loop that runs at the same batch throughout.
    firsts = [streams[j] for idx in parts for j in idx[:per_client]]
    w0 = max((st.start + st.ttft for st in firsts if st.ttft is not None), default=0.0)
    w1 = min(max(streams[j].start for j in idx) for idx in parts)
    in_window = sum(w0 <= t <= w1 for st in streams for t in st.chunk_times())
    # the client's side of a request's wait for a row: from a stream's end to the next send on the same client
    # (a client's semaphore hands a freed stream to its next request: its n-th later send follows its n-th end)
    client_gaps: list[float] = []
    for idx in parts:
        starts = sorted(streams[j].start for j in idx[per_client:])
        ends = sorted(streams[j].start + streams[j].seconds for j in idx)
        client_gaps += [s - e for s, e in zip(starts, ends)]
    return {"server_tokens_per_s": sum(st.tokens for st in streams) / dt, "clients": clients, "server_core": core,
            "client_cpu": round(max(cpu for _, cpu, _ in done) / dt, 3),
            "client_start_s": round(max(start for _, _, start in done) - t0_wall, 3),
            "open_streams": round(sum(st.seconds for st in streams) / dt, 2),
            "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99),
                       "mean": sum(ttft) / len(ttft) if ttft else None},
            "client_gap_ms": {"mean": round(1e3 * sum(client_gaps) / len(client_gaps), 2) if client_gaps else None,
                              "p99": round(1e3 * percentile(client_gaps, 99), 2) if client_gaps else None},
            "steady_core": poller.window(w0, w1),
            "ttft_after_burst_s": {"p50": percentile(steady, 50), "p99": percentile(steady, 99)},
            "ttft_burst_s": {"min": burst[0] if burst else None, "p50": percentile(burst, 50),
                             "max": burst[-1] if burst else None},
            "itl_s": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99)},
            "steady_window_s": round(max(w1 - w0, 0.0), 3),
            "steady_tokens_per_s": in_window / (w1 - w0) if w1 > w0 else None,
            "errors": len(errors), "wrong_length": wrong,
            "text_mismatch": None if texts is None else sum(st.text != t for st, t in zip(streams, texts)),
            "first_error": errors[0] if errors else None}


def server_flags(device: str, adapters: list[str], max_batch: int) -> list[str]:
    """The CLI form of bench_e2e.engine_config (the offline engine's configuration)."""
    flags = ["--device", device, "--dtype", "bfloat16" if device != "cpu" else "float32", "--max-model-len", "512",
             "--max-num-seqs", str(max_batch)]
    if device != "cpu":
        flags += ["--num-kv-blocks", "8192"]
    if adapters:
        flags += ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", "16",
                  "--lora-modules", *(f"a{i}={p}" for i, p in enumerate(adapters))]
    return flags


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(ap, [32, 64], [32], "/tmp/xpulora-serve")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--clients", type=int, default=1, help="client processes sharing the streams")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens per step, both sides (default: the engine's); e.g. 128 keeps a step of 64 decodes "
                         "and its prompt chunks inside the int4 GEMMs' 128-row bucket")
    ap.add_argument("--max-mixed-graph-tokens", type=int, default=None,
                    help="largest mixed-step graph, both sides (default: the engine's); the default step budget "
                         "follows it")
    a = ap.parse_args()
    device, s, _, path, adapters = write_model(a)  # --quick: tiny shapes, batches [1, 4], 2 adapters
    if a.quick:
        a.requests, a.new_tokens = 16, 8
    n = max(a.adapters)
    max_batch = max(a.batches)
    vocab = min(s.vocab, 1000)
    # Every run gets prompts of its own (seeded, the same on both sides): a plan served twice would find its
    # prompts in the prefix cache (on by default) the second time and skip their prefills.
    plans = {c: plan(a.requests, n, a.new_tokens, vocab, seed=c) for c in a.batches}
    warm_plans = {c: plan(2 * c, n, a.new_tokens, vocab, seed=10_000 + c) for c in a.batches}
    rows: dict[int, dict] = {}
    texts = {c: [""] * len(plans[c]) for c in a.batches}
    cfg = engine_config(path, adapters[:n], max_batch, device.type)
    flags = server_flags(device.type, adapters[:n], max_batch)
    if a.max_num_batched_tokens is not None:
        cfg = replace(cfg, scheduler=replace(cfg.scheduler, max_num_batched_tokens=a.max_num_batched_tokens))
        flags += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    if a.max_mixed_graph_tokens is not None:
        cfg = replace(cfg, max_mixed_graph_tokens=a.max_mixed_graph_tokens)
        flags += ["--max-mixed-graph-tokens", str(a.max_mixed_graph_tokens)]
    with LLMEngine(cfg) as e:
        # Warm-up: one request per adapter and the base, so that every adapter sits in its slot as in a server
        # that has run a while (first slot fills are measured apart: docs/PERFORMANCE.md).
        warm = plan(n + 1, n, a.new_tokens, vocab, seed=30_000)
        offline(e, warm, max_batch)
        for c in a.batches:
            reqs = plans[c]
            # Warm at this concurrency first: its first bursts compile kernel variants of new sizes (seconds of
            # Triton JIT inside a timed run otherwise), on both sides and in both modes.
            offline(e, warm_plans[c], c)
            rows[c] = offline(e, reqs, c, texts[c])
            # bench_e2e's pure decode at this batch, same engine: what the loop could reach without arrivals
            dec = ours(e, c, n, min(64, a.new_tokens))
            # and at fewer rows, for the plan's ceiling (its opening and drain run below full batch)
            ms_at = {b: ours(e, b, n, min(64, a.new_tokens))["ms_per_step"] for b in {1, c // 4, c // 2, 3 * c // 4}
                     if 0 < b < c} | {c: dec["ms_per_step"]}
            ceiling = plan_ceiling(reqs, c, ms_at)
            rate = prefill_rate(e, c, n, vocab)
            rows[c] |= {"decode_tokens_per_s": dec["tokens_per_s"], "decode_ms_per_step": dec["ms_per_step"],
                        "decode_ms_at": {str(b): round(v, 3) for b, v in sorted(ms_at.items())},
                        "ceiling_tokens_per_s": ceiling, "ceiling_vs_decode": ceiling / dec["tokens_per_s"],
                        "prefill_us_per_token": round(1e6 * rate, 2),
                        "prompt_ceiling_tokens_per_s": prompt_ceiling(reqs, ceiling, rate),
                        "prompt_ceiling_vs_decode": prompt_ceiling(reqs, ceiling, rate) / dec["tokens_per_s"],
                        "offline_step_vs_decode": rows[c]["offline_ms_per_step"] / dec["ms_per_step"],
                        "async_scheduling": e.async_scheduling}
            if a.sync_too:  # the same two runs with async scheduling off, on the same engine (prompts of its own)
                sync_reqs = plan(a.requests, n, a.new_tokens, vocab, seed=20_000 + c)
                off = synchronous(e, lambda c=c, r=sync_reqs: offline(e, r, c))
                dec_off = synchronous(e, lambda c=c: ours(e, c, n, min(64, a.new_tokens)))
                rows[c] |= {"sync_offline_tokens_per_s": off["offline_tokens_per_s"],
                            "sync_offline_ms_per_step": off["offline_ms_per_step"],
                            "sync_decode_tokens_per_s": dec_off["tokens_per_s"],
                            "sync_decode_ms_per_step": dec_off["ms_per_step"]}
            emit(case="offline", concurrency=c, **rows[c])  # kept should the server fail
    srv = ServerProcess(path, flags, Path(a.root) / "server.log")
    try:
        srv.wait_ready(timeout=600)
        base = httpx.get(srv.url + "/v1/models", headers=srv.headers, timeout=30).json()["data"][0]["id"]
        served(srv, base, warm, max_batch, clients=a.clients)  # warm-up, as offline
        failed = False
        for c in a.batches:
            served(srv, base, warm_plans[c], c, clients=a.clients)  # warm at this concurrency, as offline
            r = served(srv, base, plans[c], c, texts[c], a.clients)
            row = {"case": "serve", "concurrency": c, "requests": len(plans[c]), "adapters": n, **rows[c], **r}
            row["ratio"] = row["server_tokens_per_s"] / row["offline_tokens_per_s"]
            row["server_vs_decode"] = row["server_tokens_per_s"] / row["decode_tokens_per_s"]
            row["server_vs_ceiling"] = row["server_tokens_per_s"] / row["ceiling_tokens_per_s"]
            row["server_vs_prompt_ceiling"] = row["server_tokens_per_s"] / row["prompt_ceiling_tokens_per_s"]
            if row["steady_tokens_per_s"] is not None:
                row["steady_vs_decode"] = row["steady_tokens_per_s"] / row["decode_tokens_per_s"]
            failed |= bool(r["errors"] or r["wrong_length"])
            emit(**row)
    finally:
        srv.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
