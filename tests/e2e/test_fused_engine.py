"""The engine with the Triton fused ops (kernels.fused) and Triton attention, whose KV write is one of them,
gives the logits and greedy tokens of the same engine on the torch references: the committed demo model
(Qwen3 int4: per-head q/k norms, full rotary) and a tiny Qwen3.5 hybrid (zero-centred norms, partial rotary,
gated query heads strided inside the fused projection, their output gate; its Gated DeltaNet on kernels.gdn_triton:
decode steps' conv, recurrence with its gating (decode_out), gated norm and [b | a] projection
(kernels.skinny_triton), prompts' gating and gated norm; each kernel counted). It runs under the Triton
interpreter in a child process; on a GPU, benchmarks/gpu_engine_check.py makes the same comparison with compiled
kernels.
With adapters (the demo's three over mixed batches, Triton LoRA), the wrapped layers after a norm or the activation
join their shrink to that launch (kernels.lora_prologue, counted so that the case cannot pass by falling back);
greedy tokens equal the engine on the torch references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interp import interpreter_skip_reason
from tools.tinymodels import make_qwen35_model

REPO = Path(__file__).resolve().parents[2]

CHECK = r"""
import sys, torch
from engine import KernelConfig, SamplingParams
from kernels import fused_triton, gdn_triton, skinny_triton
from tests.helpers import count_calls, make_engine
path, hybrid, prompts = sys.argv[1], sys.argv[2] == "1", [[5, 17, 42, 9, 100, 3, 77], [7, 7, 250, 31]]
kinds = ["decode_out_triton", "conv_decode_triton", "gated_rms_norm_triton", "gating_triton"]
calls = count_calls(gdn_triton, kinds)
skinny = count_calls(skinny_triton, ["skinny_linear_triton"])  # the [b | a] projection's decode rows
gates = count_calls(fused_triton, ["sigmoid_gate_triton"])  # gated attention's output gate
out = {}
for backend in ("reference", "triton"):
    with make_engine(path, max_num_seqs=4, kernels=KernelConfig(fused=backend, attention=backend, gdn=backend),
                     device="cpu") as e:
        logits = [e.runner.prompt_logits(p) for p in prompts]
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        out[backend] = logits, [r.token_ids for r in e.generate(prompts, params)]
for ref, got in zip(out["reference"][0], out["triton"][0]):
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
assert out["reference"][1] == out["triton"][1], out
# The hybrid's steps ran the Gated DeltaNet kernels (its start-up check calls each once too), the dense model none.
calls.update(skinny)
calls.update(gates)
assert all((calls[k] > 4) == hybrid for k in kinds + ["skinny_linear_triton", "sigmoid_gate_triton"]), calls
print("ok", calls)
"""


LORA_CHECK = r"""
import sys, torch
from pathlib import Path
from engine import KernelConfig, SamplingParams
from kernels import lora_config, lora_prologue
from tests.helpers import count_calls
lora_config.CONFIG_OVERRIDES["prologue"] = 32  # the default, whatever the environment says
from tests.helpers import make_lora_engine
calls = count_calls(lora_prologue, ["norm_shrink", "act_shrink"])
demo = Path(sys.argv[1])
adapters = {n: str(demo / "adapters" / n) for n in ("reverse", "upper", "sort")}
prompts = [[5, 17, 42, 9, 100, 3, 77], [7, 7, 250, 31], [12, 13, 14], [99, 98, 97, 96, 95]]
names = ["reverse", None, "sort", "upper"]
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
out = {}
for backend in ("reference", "triton"):
    with make_lora_engine(str(demo / "model"), adapters, max_loras=3, max_num_seqs=4, device="cpu",
                          kernels=KernelConfig(fused=backend, attention=backend, lora=backend)) as e:
        out[backend] = [r.token_ids for r in e.generate(prompts, params, names)]
assert out["reference"] == out["triton"], out
assert calls["norm_shrink"] > 0 and calls["act_shrink"] > 0, calls
print("ok", calls)
"""


@pytest.mark.skipif(interpreter_skip_reason() is not None, reason=str(interpreter_skip_reason()))
def test_fused_triton_lora_engine_equals_reference() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", LORA_CHECK, str(REPO / "demo")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.skipif(interpreter_skip_reason() is not None, reason=str(interpreter_skip_reason()))
@pytest.mark.parametrize("model", ["demo", "qwen35"])
def test_fused_triton_engine_equals_reference(model: str, tmp_path: Path) -> None:
    path = str(REPO / "demo" / "model") if model == "demo" else make_qwen35_model(str(tmp_path / "m"), vision=False)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CHECK, path, str(int(model == "qwen35"))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
