"""Adapter churn behind benchmarks/churn.py and tests/e2e/test_reliability.py: load/unload cycles (the same
name reloaded with other weights, and always-new names) while background requests run, with the server's
RSS and open file descriptors sampled for a leak check. benchmarks/churn.py's docstring says what each
cycle checks."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.loadgen import Result, Spec, client_for, run_one

PROBE = "words: cat ant moon fox =>"
VERSIONS = ("a00", "a03", "a02", "a05")  # two reverse-like, two sort-like (2.5 MB) copies: distinct weights
STABLE = ("reverse", "upper", "sort")  # the demo's own adapters, never unloaded


@dataclass
class ChurnReport:
    cycles: int
    wall_s: float = 0.0
    loads: int = 0
    unloads: int = 0
    stale_weights: int = 0  # a (re)loaded name answered with other weights
    wrong_output: int = 0
    unexpected_failures: int = 0  # a request/load/unload that should have worked did not
    not_refused_after_unload: int = 0
    inflight_checked: int = 0
    inflight_running_at_unload: int = 0
    inflight_failures: int = 0
    background_ok: int = 0
    background_failures: int = 0
    rss_mib: dict[str, float] = field(default_factory=dict)
    fds: dict[str, int] = field(default_factory=dict)
    threads: dict[str, int] = field(default_factory=dict)
    rss_growth_mib: float = 0.0
    failures: list[str] = field(default_factory=list)

    def fail(self, kind: str, msg: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.failures) < 20:
            self.failures.append(msg)

    def passed(self, rss_tolerance_mib: float) -> bool:
        bad = (self.stale_weights or self.wrong_output or self.unexpected_failures or self.not_refused_after_unload
               or self.inflight_failures or self.background_failures)
        return not bad and self.rss_growth_mib <= rss_tolerance_mib


def _spec(model: str, max_tokens: int = 16, stream: bool = False, prompt: str = PROBE) -> Spec:
    return Spec(index=0, kind="cmpl", model=model, prompt=prompt, max_tokens=max_tokens, stream=stream,
                ignore_eos=True)


def _ok(r: Result) -> bool:
    return r.status == 200 and r.error is None and not r.lost and r.truncation() is None


class Churn:
    def __init__(self, url: str, headers: dict[str, str], paths: dict[str, str], pid: int, base: str) -> None:
        self.url, self.headers, self.paths, self.base = url, headers, paths, base
        self.proc = psutil.Process(pid)
        self.refs: dict[str, tuple] = {}  # version or stable model -> (text, finish, tokens) of PROBE, 16 tokens
        self.long_refs: dict[str, tuple] = {}  # version -> output of the 32-token streamed probe

    def sample(self) -> tuple[float, int, int]:
        procs = [self.proc, *self.proc.children(recursive=True)]
        rss = sum(p.memory_info().rss for p in procs) / 2**20
        return round(rss, 1), self.proc.num_fds(), self.proc.num_threads()

    async def _admin(self, c: httpx.AsyncClient, op: str, name: str, path: str | None = None) -> httpx.Response:
        body = {"lora_name": name} | ({"lora_path": path} if path else {})
        return await c.post(f"/v1/{op}_lora_adapter", json=body)

    async def references(self, c: httpx.AsyncClient) -> None:
        for m in (self.base, *STABLE):
            self.refs[m] = (await run_one(c, _spec(m))).output
        for v in VERSIONS:
            name = f"ref-{v}"
            assert (await self._admin(c, "load", name, self.paths[v])).status_code == 200
            self.refs[v] = (await run_one(c, _spec(name))).output
            self.long_refs[v] = (await run_one(c, _spec(name, 32))).output
            assert (await self._admin(c, "unload", name)).status_code == 200
        outs = [self.refs[v] for v in VERSIONS]
        if len(set(outs)) != len(outs):  # otherwise a stale-weights check could not see anything
            raise SystemExit(f"the version adapters give equal outputs on the probe: {outs}")

    async def background(self, c: httpx.AsyncClient, rep: ChurnReport, stop: asyncio.Event, k: int) -> None:
        models = (self.base, *STABLE)
        i = k
        while not stop.is_set():
            m = models[i % len(models)]
            i += 1
            r = await run_one(c, _spec(m))
            if _ok(r) and r.output == self.refs[m]:
                rep.background_ok += 1
            else:
                rep.fail("background_failures", f"background {m}: {r.status} {r.error} {r.output}")

    async def cycle(self, c: httpx.AsyncClient, i: int, rep: ChurnReport) -> None:
        same = i % 2 == 0
        name = "same" if same else f"new{i}"
        version = VERSIONS[(i // 2) % len(VERSIONS)]
        prev = VERSIONS[(i // 2 - 1) % len(VERSIONS)] if same and i >= 2 else None
        r = await self._admin(c, "load", name, self.paths[version])
        if r.status_code != 200:
            rep.fail("unexpected_failures", f"cycle {i}: load {name} -> {r.status_code} {r.text[:200]}")
            return
        rep.loads += 1
        out = await run_one(c, _spec(name))
        if not _ok(out):
            rep.fail("unexpected_failures", f"cycle {i}: request on {name} failed: {out.status} {out.error}")
        elif out.output != self.refs[version]:
            stale = prev is not None and out.output == self.refs[prev]
            rep.fail("stale_weights" if stale else "wrong_output",
                     f"cycle {i}: {name} ({version}) answered {out.output!r}, expected {self.refs[version]!r}"
                     + (f" (the previous load's {prev})" if stale else ""))
        inflight: asyncio.Task[Result] | None = None
        if i % 10 == 0:  # a long stream that is running when the adapter is unloaded
            started = asyncio.Event()
            inflight = asyncio.create_task(run_one(c, _spec(name, 32, stream=True), started))
            await asyncio.wait([inflight, asyncio.create_task(started.wait())], return_when=asyncio.FIRST_COMPLETED)
        r = await self._admin(c, "unload", name)
        if inflight is not None and not inflight.done():
            rep.inflight_running_at_unload += 1
        if r.status_code != 200:
            rep.fail("unexpected_failures", f"cycle {i}: unload {name} -> {r.status_code} {r.text[:200]}")
        else:
            rep.unloads += 1
        gone = await run_one(c, _spec(name))
        if gone.status != 404:
            rep.fail("not_refused_after_unload", f"cycle {i}: {name} after unload -> {gone.status} {gone.error}")
        if inflight is not None:
            res = await inflight
            rep.inflight_checked += 1
            if not _ok(res) or res.output != self.long_refs[version]:
                rep.fail("inflight_failures", f"cycle {i}: stream on {name} across its unload: {res.status} "
                                              f"{res.error} {res.output!r} != {self.long_refs[version]!r}")

    async def run(self, cycles: int, background: int, timeout_s: float) -> ChurnReport:
        rep = ChurnReport(cycles=cycles)
        warm_at = min(50, max(1, cycles // 10))
        async with client_for(self.url, self.headers, background + 4, timeout_s) as c:
            await self.references(c)
            stop = asyncio.Event()
            bg = [asyncio.create_task(self.background(c, rep, stop, k)) for k in range(background)]
            t0 = time.perf_counter()
            try:
                for i in range(cycles):
                    if i == warm_at:
                        rep.rss_mib["warm"], rep.fds["warm"], rep.threads["warm"] = self.sample()
                    elif i and i % 100 == 0:
                        rep.rss_mib[f"cycle{i}"] = self.sample()[0]
                    await asyncio.wait_for(self.cycle(c, i, rep), timeout_s)
            finally:
                stop.set()
                await asyncio.gather(*bg, return_exceptions=True)
            rep.wall_s = round(time.perf_counter() - t0, 2)
            await _idle(c)
            rep.rss_mib["end"], rep.fds["end"], rep.threads["end"] = self.sample()
        rep.rss_mib.setdefault("warm", rep.rss_mib["end"])
        rep.rss_growth_mib = round(rep.rss_mib["end"] - rep.rss_mib["warm"], 1)
        return rep


async def _idle(c: httpx.AsyncClient, timeout_s: float = 30.0) -> None:
    """Until nothing runs or waits: the end sample must not count a request still in flight."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = (await c.get("/metrics")).text
        if all(re.search(rf"^xpulora:{name}(\{{[^}}]*\}})? 0\.0$", text, re.M)
               for name in ("num_requests_running", "num_requests_waiting")):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the server did not go idle within {timeout_s} s")


def run_churn(url: str, headers: dict[str, str], paths: dict[str, str], pid: int, cycles: int,
              background: int = 2, timeout_s: float = 120.0) -> ChurnReport:
    base = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    return asyncio.run(Churn(url, headers, paths, pid, base).run(cycles, background, timeout_s))
