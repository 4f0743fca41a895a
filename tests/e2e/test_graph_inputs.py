"""The captured-step runners' inputs on the CPU: DecodeGraphs and MixedGraphs fill their static buffers from a
step (padding rows, zero-length sequence slots, the scratch block, pending tokens under async scheduling, the
LoRA grouping) and replay what they captured. Graphs exist only on GPUs, so here each "graph" re-runs the
forward eagerly over the same static buffers and metadata the capture recorded, with the Triton attention and
LoRA kernels under the interpreter: what a replay computes from those buffers must equal the eager engine's
greedy outputs on mixed adapter batches with chunked prefill, also when the runner builds its graphs itself and
the default step budget follows them. (The captures themselves are checked on CUDA by
benchmarks/gpu_engine_check.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interp import run_under_interpreter

REPO = Path(__file__).resolve().parents[2]

CODE = r'''
import torch
from pathlib import Path
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import CacheConfig, KernelConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.device import Device
from engine.forward_context import forward_context
from engine.graph_runner import DecodeGraphs, MixedGraphs, _Graphs
from engine.lora.punica import TritonLoRABatch

DEMO = Path(REPO) / "demo"
ADAPTERS = tuple((n, str(DEMO / "adapters" / n)) for n in ("reverse", "upper", "sort"))


class EagerReplay:
    """A graph stand-in: replay() runs the forward and what the runner adds to it (DecodeGraphs: the lm_head
    into its shared logits buffer and the greedy ids) over the static buffers with the capture's context."""

    def __init__(self, g, size, ctx, outs):
        self.g, self.size, self.ctx, self.outs = g, size, ctx, outs

    def replay(self):
        with torch.inference_mode(), forward_context(self.ctx):
            h = self.g.model(self.g.input_ids[:self.size], self.g.positions[:self.size])
            for out, new in zip(self.outs, self.g._outputs(h, self.size)):
                out.copy_(new)


def capture(self, size, with_lora, pool):
    info = TritonLoRABatch.build([0] * size, self.lora_slots, self.device.torch_device) if with_lora else None
    ctx = self._context(size, info)
    with torch.inference_mode(), forward_context(ctx):
        outs = tuple(t.clone() for t in self._outputs(self.model(self.input_ids[:size], self.positions[:size]), size))
    return EagerReplay(self, size, ctx, outs), outs, info


_Graphs._capture = capture
Device.graph_pool = lambda self: None


def engine(max_loras=2, budget=24, max_mixed=512):
    return LLMEngine(EngineConfig(
        ModelConfig(str(DEMO / "model"), dtype="float32", max_model_len=128),
        cache=CacheConfig(num_blocks=64),
        parallel=ParallelConfig(device="cpu"),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
        lora=LoRAConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=64, lora_modules=ADAPTERS),
        kernels=KernelConfig(attention="triton", lora="triton"), async_scheduling=True, max_mixed_graph_tokens=max_mixed))


def with_graphs(e):
    r = e.runner
    assert r.kernels.attention == "triton" and r.lora_impl is TritonLoRABatch
    for a in r.attn_layers:  # the scratch block the graphs' padding rows write (the GPU runner allocates it)
        a.k_cache = torch.cat([a.k_cache, torch.zeros_like(a.k_cache[:1])])
        a.v_cache = torch.cat([a.v_cache, torch.zeros_like(a.v_cache[:1])])
    bs, n = r.kv.block_size, r.kv.num_blocks
    r.graphs = DecodeGraphs(r.model, r.device, [1, 2, 4, 8], 128 // bs, bs, n, e.config.lora.max_loras, None)
    r.mixed = MixedGraphs(r.model, r.device, [16, 32], 8, 128 // bs, bs, n, e.config.lora.max_loras)
    return e


words = "cat ant moon fox owl jam dog hat pig egg bee sun".split()
prompts = ["words: " + " ".join(words[(i + j) % 12] for j in range(2 + i % 6)) + " =>" for i in range(10)]
models = [None, "reverse", "upper", "sort"] * 3
params = [SamplingParams(max_tokens=6 + i % 5, temperature=0.0, ignore_eos=i % 3 == 0) for i in range(10)]
with engine() as e:
    want = [r.token_ids for r in e.generate(prompts, params, models[:10])]
with with_graphs(engine()) as e:
    got = [r.token_ids for r in e.generate(prompts, params, models[:10])]
    decode, mixed = e.runner.graphs.replays, e.runner.mixed.replays
assert decode > 0 and mixed > 0, (decode, mixed)
assert got == want, (got, want)

# Rows that do not take the graph's argmax as it is sample from the graph's logits: seeded temperature and
# top-k sampling, logprobs, a logit bias, min_tokens, mixed with plain greedy rows in the same decode steps.
kinds = [dict(temperature=0.0), dict(temperature=0.9, seed=7), dict(temperature=0.0, logprobs=2),
         dict(temperature=0.7, top_k=5, seed=3, logprobs=1), dict(temperature=0.0, logit_bias=((11, 3.0),)),
         dict(temperature=0.0, min_tokens=5)]
params2 = [SamplingParams(max_tokens=6, ignore_eos=True, **kinds[i % len(kinds)]) for i in range(10)]
with engine() as e:
    want2 = e.generate(prompts, params2, models[:10])
with with_graphs(engine()) as e:
    got2 = e.generate(prompts, params2, models[:10])
    assert e.runner.graphs.replays > 0
assert [r.token_ids for r in got2] == [r.token_ids for r in want2], ([r.token_ids for r in got2],
                                                                      [r.token_ids for r in want2])
for g, w in zip(got2, want2):
    assert (g.logprobs is None) == (w.logprobs is None)
    for a, b in zip(g.logprobs or [], w.logprobs or []):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4, (a, b)
        assert [t for t, _ in a.top] == [t for t, _ in b.top], (a, b)

# The runner building its own graphs (captures stubbed as above) with the default step budget, which then
# follows the largest mixed-step graph: every step of the batch replays a graph, none runs eagerly.
Device.supports_graphs = property(lambda self: True)
with engine(budget=None, max_mixed=32) as e:
    assert e.runner.mixed.sizes == [16, 32], e.runner.mixed.sizes
    assert e.config.scheduler.max_num_batched_tokens == e.scheduler.budget == 32
    got = [r.token_ids for r in e.generate(prompts, params, models[:10])]
    replays = e.runner.graphs.replays + e.runner.mixed.replays
    assert e.runner.mixed.replays > 0 and replays == e.steps.steps, (replays, e.steps.steps)
assert got == want, (got, want)
print("ok", decode, mixed)
'''


@pytest.mark.slow
def test_graph_runners_inputs_equal_the_eager_step() -> None:
    run_under_interpreter(f"REPO = {str(REPO)!r}\n" + CODE, timeout=600)
