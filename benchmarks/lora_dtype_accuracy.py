"""How much fp8 adapter storage (`--lora-dtype fp8`) changes outputs: greedy agreement and logprobs against
the model-dtype adapters and against peft + transformers (float32).

    python benchmarks/lora_dtype_accuracy.py                        # the demo model and its three adapters, CPU
    python benchmarks/lora_dtype_accuracy.py --dtype bfloat16        # a bf16 engine (the GPU's dtype) on the CPU

For every prompt x adapter: greedy continuations of --new-tokens with each --lora-dtypes (the first is the
reference), then teacher-forced logits of one common sequence (prompt + the reference's continuation) from
each engine and from peft over the int4 model's dequantized weights (transformers, float32). One JSON line
per lora dtype:
  greedy_same_seqs    continuations identical to the reference lora dtype's (count / total)
  greedy_same_tokens  tokens equal to the reference's up to the first difference of each continuation
  lp_max/mean_vs_peft |logprob - peft's logprob| of the common sequence's tokens at the continuation's
                      positions: max and mean; lp_vocab_max_vs_peft: max over the whole vocabulary there
  lp_*_vs_ref         the same against the reference lora dtype's engine
  adapter_effect      max |peft logit - base model logit| at those positions (what the adapters change)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import CacheConfig, EngineConfig, LLMEngine, LoRAConfig, ModelConfig, SamplingParams  # noqa: E402


def engine_for(model: str, adapters: dict[str, str], dtype: str, lora_dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(
        ModelConfig(model, dtype=dtype, max_model_len=256),  # type: ignore[arg-type]
        cache=CacheConfig(num_blocks=256, enable_prefix_caching=False),
        lora=LoRAConfig(enable_lora=True, max_loras=len(adapters), max_lora_rank=64,
                        lora_modules=tuple(adapters.items()), lora_dtype=lora_dtype)))  # type: ignore[arg-type]


def teacher_forced(llm: LLMEngine, ids: list[int], adapter: str | None) -> torch.Tensor:
    """log-softmax of the engine's logits at every position of ids (float32, CPU)."""
    slot = -1
    if adapter is not None:
        assert llm.lora is not None
        aid = llm.lora.resolve(adapter)
        assert aid is not None
        got = llm.lora.acquire_slot(aid)
        assert got is not None
        slot, needs_load = got
        if needs_load:
            llm.runner.load_lora(slot, llm.lora.adapter(aid))
    try:
        return torch.log_softmax(llm.runner.prompt_logits(ids, lora_slot=slot).float().cpu(), dim=-1)
    finally:
        if adapter is not None:
            llm.lora.release_slot(aid)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO / "demo" / "model"))
    p.add_argument("--adapter", action="append", default=None, metavar="NAME=PATH",
                   help="default: the demo's reverse, sort and upper")
    p.add_argument("--prompts", default=str(REPO / "demo" / "prompts.jsonl"))
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--lora-dtypes", nargs="+", default=["auto", "fp8"])
    p.add_argument("--no-peft", action="store_true", help="skip the peft oracle")
    args = p.parse_args(argv)
    adapters = dict(a.split("=", 1) for a in args.adapter) if args.adapter else {
        n: str(REPO / "demo" / "adapters" / n) for n in ("reverse", "sort", "upper")}
    with open(args.prompts) as f:
        prompts = list(dict.fromkeys(json.loads(line)["prompt"] for line in f if line.strip()))
    cases = [(pr, n) for pr in prompts for n in adapters]
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engines = {ld: engine_for(args.model, adapters, args.dtype, ld) for ld in args.lora_dtypes}
    outs = {ld: llm.generate([c[0] for c in cases], greedy, [c[1] for c in cases]) for ld, llm in engines.items()}
    ref_ld = args.lora_dtypes[0]
    seqs = [r.prompt_token_ids + r.token_ids for r in outs[ref_ld]]
    starts = [len(r.prompt_token_ids) for r in outs[ref_ld]]
    lps = {ld: [teacher_forced(llm, ids, n) for ids, (_, n) in zip(seqs, cases)] for ld, llm in engines.items()}
    peft_lp: list[torch.Tensor] | None = None
    effect = None
    if not args.no_peft:
        from peft import PeftModel

        from tests.oracle import hf_logits, load_hf_dequantized

        peft_lp, eff = [], 0.0
        base = load_hf_dequantized(args.model)
        for name, path in adapters.items():
            oracle = PeftModel.from_pretrained(load_hf_dequantized(args.model), path).eval()
            for i, (ids, (_, n)) in enumerate(zip(seqs, cases)):
                if n != name:
                    continue
                logits = hf_logits(oracle, ids)
                with torch.inference_mode():
                    eff = max(eff, float((logits - hf_logits(base, ids))[starts[i] - 1:-1].abs().max()))
                peft_lp.append((i, torch.log_softmax(logits, dim=-1)))
        peft_lp = [lp for _, lp in sorted(peft_lp, key=lambda t: t[0])]
        effect = round(eff, 3)

    def diffs(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float, float]:
        """(max, mean) |logprob diff| of the sequence's own next tokens, max |logprob diff| over the vocab."""
        tok, full = [], 0.0
        for la, lb, ids, s in zip(a, b, seqs, starts):
            nxt = torch.tensor(ids[s:])
            rows = torch.arange(s - 1, len(ids) - 1)
            tok.append((la[rows, nxt] - lb[rows, nxt]).abs())
            full = max(full, float((la[rows] - lb[rows]).abs().max()))
        t = torch.cat(tok)
        return round(float(t.max()), 5), round(float(t.mean()), 6), round(full, 4)

    for ld in args.lora_dtypes:
        same_seq = sum(a.token_ids == b.token_ids for a, b in zip(outs[ld], outs[ref_ld]))
        same_tok = 0
        for a, b in zip(outs[ld], outs[ref_ld]):
            for x, y in zip(a.token_ids, b.token_ids):
                if x != y:
                    break
                same_tok += 1
        rec = dict(bench="lora_dtype_accuracy", model=Path(args.model).name, dtype=args.dtype, lora_dtype=ld,
                   reference=ref_ld, cases=len(cases), new_tokens=args.new_tokens,
                   greedy_same_seqs=f"{same_seq}/{len(cases)}",
                   greedy_same_tokens=f"{same_tok}/{sum(len(r.token_ids) for r in outs[ref_ld])}")
        mx, mean, full = diffs(lps[ld], lps[ref_ld])
        rec.update(lp_max_vs_ref=mx, lp_mean_vs_ref=mean, lp_vocab_max_vs_ref=full)
        if peft_lp is not None:
            mx, mean, full = diffs(lps[ld], peft_lp)
            rec.update(lp_max_vs_peft=mx, lp_mean_vs_peft=mean, lp_vocab_max_vs_peft=full, adapter_effect=effect)
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
