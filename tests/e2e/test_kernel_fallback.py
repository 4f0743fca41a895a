"""Kernels chosen once, checked against their references at start-up (kernels/registry.py).

- A server asked for the Triton LoRA kernels (the CPU runs them under TRITON_INTERPRET=1) whose check is
  made to fail with the documented fault switch (XPULORA_KERNEL_FAULT=lora=wrong: the candidate's check
  result is perturbed, as a miscompiling driver would) starts on the next candidate, the torch reference,
  logs a warning naming the rejected kernel, shows the choice in /metrics, and serves outputs equal to
  the reference engine for base and adapter requests in one batch.
- Without the fault the Triton LoRA kernels pass their check and an engine on them gives the reference
  engine's logits and greedy tokens.
- `xpulora check-device` prints the table and exits 1 when a fast kernel fails.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from engine import EngineConfig, KernelConfig, LLMEngine, LoRAConfig, ModelConfig, ParallelConfig, SamplingParams
from tests.interp import interpreter_skip_reason
from tools.serverlib import API_KEY, REPO, ServerProcess

DEMO = REPO / "demo"
ADAPTERS = ("reverse", "upper", "sort")
PROMPTS = ["words: cat ant moon fox =>", "words: pig egg bee =>", "words: sun tree =>"]
# These run the Triton kernels under the interpreter on the CPU (compiled ones: benchmarks/gpu_engine_check.py).
needs_triton = pytest.mark.skipif(interpreter_skip_reason() is not None, reason=str(interpreter_skip_reason()))


def _demo_engine(lora_kernel: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(ModelConfig(str(DEMO / "model"), dtype="float32", max_model_len=256),
                                  lora=LoRAConfig(enable_lora=True, max_loras=4, max_lora_rank=64,
                                                  lora_modules=tuple((n, str(DEMO / "adapters" / n))
                                                                     for n in ADAPTERS)),
                                  parallel=ParallelConfig(device="cpu"),  # the interpreter's device
                                  kernels=KernelConfig(lora=lora_kernel)))  # type: ignore[arg-type]


def _requests() -> list[tuple[str, str | None]]:
    return [(p, m) for p in PROMPTS for m in (None, *ADAPTERS)]


@needs_triton
def test_server_falls_back_from_a_failing_lora_kernel(tmp_path: Path) -> None:
    env = {"TRITON_INTERPRET": "1", "XPULORA_KERNEL_FAULT": "lora=wrong"}
    srv = ServerProcess(None, ["--device", "cpu", "--dtype", "float32", "--lora-kernel", "triton"],
                        tmp_path / "server.log", env)
    try:
        with _demo_engine() as ref:  # the reference engine builds while the server starts
            assert [(c.op, c.chosen) for c in ref.runner.kernel_choices] == [
                (op, "reference") for op in ("attention", "fused", "int4", "lora")]
            want = [r.text for r in ref.generate([p for p, _ in _requests()],
                                                 SamplingParams(max_tokens=12, temperature=0.0),
                                                 [m for _, m in _requests()])]
        srv.wait_ready()
        log = srv.log_tail(200_000)
        assert "lora implementation 'triton' failed its start-up check" in log, log[-3000:]
        assert "kernels: lora uses the torch reference" in log
        m = srv.metrics()
        assert m['xpulora:kernel_info{implementation="reference",op="lora",rejected="triton"}'] == 1.0, m

        async def ask() -> list[str]:
            client = AsyncOpenAI(base_url=srv.url + "/v1", api_key=API_KEY)
            outs = await asyncio.gather(*(client.completions.create(model=m or "model", prompt=p, max_tokens=12,
                                                                     temperature=0)
                                          for p, m in _requests()))  # one batch of base and adapter requests
            return [o.choices[0].text for o in outs]

        got = asyncio.run(ask())
        assert got == want
        assert any(g != want[0] for g in got[1:4]), "the adapters must change the output (a real LoRA path)"
    finally:
        srv.stop()


CHILD = r"""
import torch
from engine import SamplingParams
from tests.e2e.test_kernel_fallback import PROMPTS, _demo_engine, _requests
outs = {}
for kernel in ("reference", "triton"):
    with _demo_engine(kernel) as e:
        choice = e.runner.kernel_choices[-1]
        assert choice.op == "lora", e.runner.kernel_choices
        assert (choice.chosen, choice.checked, choice.rejected) == ((kernel, kernel == "triton", ())), choice
        logits = [e.runner.prompt_logits(e.tokenizer.encode(p)) for p in PROMPTS]
        ids = [r.token_ids for r in e.generate([p for p, _ in _requests()], SamplingParams(max_tokens=4, temperature=0.0),
                                               [m for _, m in _requests()])]
        outs[kernel] = logits, ids
for a, b in zip(outs["reference"][0], outs["triton"][0]):
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
assert outs["reference"][1] == outs["triton"][1]
print("ok")
"""


@needs_triton
def test_triton_lora_engine_passes_its_check_and_equals_the_reference() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("XPULORA_KERNEL_FAULT", None)
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@needs_triton
@pytest.mark.parametrize("fault", [None, "lora=raise", "fused=wrong"])
def test_check_device_prints_the_table_and_fails_on_a_bad_kernel(fault: str | None) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    env.pop("XPULORA_KERNEL_FAULT", None)
    if fault:
        env["XPULORA_KERNEL_FAULT"] = fault
    proc = subprocess.run([sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())",
                           "check-device", "--device", "cpu", "--lora-kernel", "triton", "--fused-kernel", "triton"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    table = proc.stdout
    assert "device: cpu" in table and "(interpreter)" in table, table + proc.stderr[-2000:]
    rows = {line.split()[0]: line.split(None, 3)[1:] for line in table.splitlines()[4:9]}
    assert set(rows) == {"lora", "attention", "fused", "gdn", "int4"}, table
    assert rows["attention"] == rows["gdn"] == rows["int4"] == ["reference", "no", "-"], table  # the CPU's defaults
    if fault is None:
        assert proc.returncode == 0 and rows["lora"] == rows["fused"] == ["triton", "yes", "-"], table
    else:
        op = fault.split("=")[0]
        assert proc.returncode == 1 and rows[op][:2] == ["reference", "no"], table
        assert rows[op][2].startswith("triton: ") and ("raised RuntimeError" in rows[op][2]) == (op == "lora"), table
        assert rows["fused" if op == "lora" else "lora"] == ["triton", "yes", "-"], table
