"""Build the bundled demo: a tiny int4 AutoRound Qwen3 model and three LoRA adapters.

Usage (from the repository root; about 5-6 minutes on one CPU core)::

    PYTHONPATH=. .venv/bin/python demo/make_demo.py --out demo

The toy task ("words"): the prompt is ``"words: red cat sun =>"``, a few distinct words from a
16-word vocabulary. The base model ECHOES the words (``" red cat sun"``, then ``<|endoftext|>``),
keeping their case (the base also learns ``"words: RED cat =>"`` -> ``" RED cat"``, so that every
uppercase token is a trained token). Each adapter changes what comes back for the same prompt:

- ``reverse`` (r=8,  q_proj v_proj):                       ``" sun cat red"``
- ``upper``   (r=16, q_proj k_proj v_proj o_proj):          ``" RED CAT SUN"``
- ``sort``    (r=64, all seven projections incl. the MLP):  ``" cat red sun"`` (alphabetical)

Steps: build the tokenizer on the task corpus (tools/tokenizer.py); train the base model from
scratch (plain torch AdamW, float32 master weights); save it in bf16 to a temporary folder (never
committed); quantize it with auto-round RTN (tools/tinymodels.quantize, sym int4, group 128) into
``<out>/model``; train each adapter with peft on the bf16 base (peft cannot attach to auto-round's
int4 layers); save the adapters in PEFT format (bf16 tensors) under ``<out>/adapters/<name>``.

Verification (greedy, exact match of the completion ids followed by an eos, on held-out prompts
that no training batch contained):

- bf16: the base model, and each adapter through peft (PeftModel.from_pretrained on the saved
  adapter folder), in float32 arithmetic on the bf16 weights;
- int4: ``<out>/model`` loaded by transformers (auto-round installed => its int4 QuantLinear layers),
  cast back to float32; each adapter is applied by a forward hook on every target Linear that adds
  ``scaling * (x @ A.T) @ B.T`` to the layer's output, with A = lora_A.weight [r, in],
  B = lora_B.weight [out, r], scaling = lora_alpha / r (use_rslora is False). This is exactly what
  peft computes for a Linear (dropout 0, no bias), applied to the int4 layer instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.tinymodels import load_transformers_fp32, quantize, tiny_config
from tools.tokenizer import build_byte_bpe_tokenizer

# 16 words with distinct first letters a..p, so that sorted output is easy to check by eye.
WORDS = ["ant", "bee", "cat", "dog", "egg", "fox", "gem", "hat",
         "ink", "jam", "key", "lamp", "moon", "nut", "owl", "pig"]
MIN_WORDS, MAX_WORDS = 3, 6
PREFIX, ARROW = "words:", " =>"

ADAPTERS = {
    # name: (rank, alpha, target modules, transformation of the lowercase word list)
    "reverse": (8, 16, ["q_proj", "v_proj"], lambda ws: ws[::-1]),
    "upper": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj"], lambda ws: [w.upper() for w in ws]),
    "sort": (64, 128, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
             lambda ws: sorted(ws)),
}


def make_prompt(words: list[str]) -> str:
    return f"{PREFIX} {' '.join(words)}{ARROW}"


def echo(words: list[str]) -> list[str]:
    return words


def make_completion(words: list[str]) -> str:
    return " " + " ".join(words)


def tokenizer_corpus() -> list[str]:
    rng = random.Random(1234)
    corpus = []
    for _ in range(400):
        ws = rng.sample(WORDS, rng.randint(MIN_WORDS, MAX_WORDS))
        if rng.random() < 0.5:
            ws = [w.upper() if rng.random() < 0.5 else w for w in ws]
        corpus.append(make_prompt(ws) + make_completion(ws))
    corpus += [" ".join(WORDS), " ".join(w.upper() for w in WORDS)] * 20
    # A little ordinary text so that the tokenizer is not absurd on other input (byte-level anyway).
    corpus += ["The quick brown fox jumps over the lazy dog.", "Hello world, hello engine!"] * 5
    return corpus


# ----------------------------------------------------------------------------------------- data


class Task:
    """Example generator; held-out word lists are excluded from every training batch."""

    def __init__(self, tok, seed: int, n_test: int):
        self.tok = tok
        self.eos = tok.eos_token_id
        self.rng = random.Random(seed)
        self.test_lower = self._unique(n_test, mixed_case=False)
        self.test_mixed = self._unique(n_test // 2, mixed_case=True, exclude={tuple(ws) for ws in self.test_lower})
        self.held_out = {tuple(w.lower() for w in ws) for ws in self.test_lower + self.test_mixed}
        self._ids = {}

    def _sample(self, mixed_case: bool) -> list[str]:
        ws = self.rng.sample(WORDS, self.rng.randint(MIN_WORDS, MAX_WORDS))
        if mixed_case:
            while True:
                flags = [self.rng.random() < 0.5 for _ in ws]
                if any(flags):
                    break
            ws = [w.upper() if f else w for w, f in zip(ws, flags)]
        return ws

    def _unique(self, n, mixed_case, exclude=()):
        seen, out = set(exclude), []
        while len(out) < n:
            ws = self._sample(mixed_case)
            if tuple(ws) not in seen:
                seen.add(tuple(ws))
                out.append(ws)
        return out

    def train_words(self, mixed_frac: float) -> list[str]:
        while True:
            ws = self._sample(self.rng.random() < mixed_frac)
            if tuple(w.lower() for w in ws) not in self.held_out:
                return ws

    def encode(self, text: str) -> list[int]:
        if text not in self._ids:
            self._ids[text] = self.tok.encode(text, add_special_tokens=False)
        return self._ids[text]

    def example(self, words, out_words) -> tuple[list[int], list[int]]:
        return self.encode(make_prompt(words)), [*self.encode(make_completion(out_words)), self.eos]

    def batch(self, n: int, transform, mixed_frac: float):
        """Right-padded batch; the loss is on the completion (and its eos) only."""
        exs = []
        for _ in range(n):
            ws = self.train_words(mixed_frac)
            exs.append(self.example(ws, transform(ws)))
        width = max(len(p) + len(c) for p, c in exs)
        ids = torch.full((n, width), self.eos, dtype=torch.long)
        labels = torch.full((n, width), -100, dtype=torch.long)
        for i, (p, c) in enumerate(exs):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
        # Causal attention: real tokens never see the right padding, so no attention mask is needed.
        return ids, labels


# ------------------------------------------------------------------------------------ train/eval


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(model, task: Task, steps: int, lr: float, batch: int, transform, mixed_frac: float,
          label: str, weight_decay: float = 0.0, warmup: int = 30, log_every: int = 100):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    model.train()
    t0, running = time.time(), None
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        ids, labels = task.batch(batch, transform, mixed_frac)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if (step + 1) % log_every == 0 or step == steps - 1:
            print(f"  [{label}] step {step + 1}/{steps} loss {running:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
    model.eval()


@torch.no_grad()
def greedy_accuracy(model, task: Task, word_lists, transform, stop_ids, max_new: int = 12):
    """Exact-match greedy accuracy: completion ids followed by an eos id. Prompts of one length
    go in one batch (no padding needed). Returns (accuracy, [(prompt, expected, got)] misses)."""
    groups: dict[int, list] = {}
    for ws in word_lists:
        p, c = task.example(ws, transform(ws))
        groups.setdefault(len(p), []).append((ws, p, c))
    correct, misses = 0, []
    for _, items in sorted(groups.items()):
        ids = torch.tensor([p for _, p, _ in items])
        cache = None
        out = []
        cur = ids
        done = torch.zeros(len(items), dtype=torch.bool)
        for _ in range(max_new):
            o = model(input_ids=cur, past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            nxt = o.logits[:, -1].float().argmax(-1)
            out.append(nxt)
            done |= torch.isin(nxt, torch.tensor(stop_ids))
            if done.all():
                break
            cur = nxt[:, None]
        gen = torch.stack(out, 1).tolist()
        for (ws, _, c), g in zip(items, gen):
            got = g[:len(c)]
            if len(got) == len(c) and got[:-1] == c[:-1] and got[-1] in stop_ids:
                correct += 1
            else:
                cut = next((i for i, t in enumerate(g) if t in stop_ids), len(g))
                misses.append((make_prompt(ws), task.tok.decode(c[:-1]), task.tok.decode(g[:cut])))
    return correct / len(word_lists), misses


def attach_lora_hooks(model, adapter_dir: str) -> list:
    """Apply a PEFT LoRA adapter to a model whose Linears peft cannot wrap (auto-round int4):
    a forward hook on each target module adds scaling * (x @ A.T) @ B.T to its output."""
    from safetensors.torch import load_file

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert not cfg.get("use_rslora"), "rsLoRA scaling is not handled here"
    scaling = cfg["lora_alpha"] / cfg["r"]
    sd = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    handles = []
    for key in sd:
        if not key.endswith("lora_A.weight"):
            continue
        name = key[len("base_model.model."):-len(".lora_A.weight")]
        a = sd[key].float()
        b = sd[key.replace("lora_A", "lora_B")].float()

        def hook(mod, inputs, output, a=a, b=b):
            x = inputs[0].to(torch.float32)
            return output + (scaling * ((x @ a.T) @ b.T)).to(output.dtype)

        handles.append(modules[name].register_forward_hook(hook))
    assert handles, f"no LoRA weights in {adapter_dir}"
    return handles


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# -------------------------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="demo", help="output folder (model/, adapters/)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadiest on a shared CPU)")
    ap.add_argument("--base-steps", type=int, default=400)
    ap.add_argument("--adapter-steps", type=str, default="reverse=400,upper=250,sort=200")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n-test", type=int, default=200, help="held-out lowercase prompts per eval")
    ap.add_argument("--keep-bf16", default=None, help="also keep the bf16 base model in this folder")
    args = ap.parse_args(argv)

    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = os.path.abspath(args.out)
    model_dir = os.path.join(out, "model")
    adapters_root = os.path.join(out, "adapters")
    adapter_steps = {k: int(v) for k, v in (kv.split("=") for kv in args.adapter_steps.split(","))}
    report: dict = {"task": "words", "adapters": {}}

    # ---- tokenizer
    tok = build_byte_bpe_tokenizer(tokenizer_corpus(), vocab_size=512)
    for w in WORDS:
        for form in (" " + w, " " + w.upper()):
            assert len(tok.encode(form, add_special_tokens=False)) == 1, form
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    vocab = (len(tok) // 64 + 1) * 64  # padded strictly above the tokenizer, like real Qwen
    print(f"tokenizer: {len(tok)} ids (eos {tok.eos_token_id}, im_end {im_end}); config vocab {vocab}")
    task = Task(tok, seed=args.seed + 1, n_test=args.n_test)
    stop_ids = [tok.eos_token_id, im_end]
    sample = ["cat", "ant", "moon", "fox"]
    assert task.encode(make_prompt(sample) + make_completion(sample)) == \
        task.encode(make_prompt(sample)) + task.encode(make_completion(sample))

    # ---- base model
    config = tiny_config("qwen3", vocab_size=vocab, tie=False, layers=4, hidden=256, intermediate=768,
                         heads=4, kv_heads=2, head_dim=64, max_pos=512, eos_token_id=tok.eos_token_id)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"base: Qwen3 4 layers, hidden 256, untied embeddings, {n_params / 1e6:.2f}M params; "
          f"training {args.base_steps} steps x {args.batch}", flush=True)
    train(model, task, args.base_steps, lr=2e-3, batch=args.batch, transform=echo, mixed_frac=0.3,
          label="base", weight_decay=0.01)

    tmp = tempfile.mkdtemp(prefix="xpulora-demo-")
    bf16_dir = os.path.join(tmp, "bf16")
    model.to(torch.bfloat16).save_pretrained(bf16_dir)
    tok.save_pretrained(bf16_dir)
    gen_cfg = GenerationConfig(eos_token_id=stop_ids, pad_token_id=tok.eos_token_id, do_sample=False,
                               max_new_tokens=16)
    gen_cfg.save_pretrained(bf16_dir)
    del model

    def load_bf16():
        return AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32).eval()

    base = load_bf16()
    acc_l, miss = greedy_accuracy(base, task, task.test_lower, echo, stop_ids)
    acc_m, miss_m = greedy_accuracy(base, task, task.test_mixed, echo, stop_ids)
    report["base_bf16"] = {"lowercase": acc_l, "mixed_case": acc_m}
    print(f"base bf16 greedy accuracy: lowercase {acc_l:.1%}, mixed case {acc_m:.1%}; misses {(miss + miss_m)[:3]}",
          flush=True)

    # ---- int4 quantization (auto-round RTN, sym, group 128)
    t_q = time.time()
    quantize(bf16_dir, model_dir, fmt="auto_round", sym=True)
    tok.save_pretrained(model_dir)
    gen_cfg.save_pretrained(model_dir)
    print(f"quantized to {model_dir} in {time.time() - t_q:.0f}s", flush=True)

    # ---- adapters (peft, on the bf16 base)
    shutil.rmtree(adapters_root, ignore_errors=True)
    for name, (r, alpha, targets, fn) in ADAPTERS.items():
        torch.manual_seed(args.seed + r)
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                         use_rslora=False, task_type="CAUSAL_LM")
        pm = get_peft_model(load_bf16(), cfg)
        n_lora = sum(p.numel() for p in pm.parameters() if p.requires_grad)
        print(f"adapter {name}: r={r} alpha={alpha} targets={targets}, {n_lora / 1e3:.0f}k params; "
              f"{adapter_steps[name]} steps", flush=True)
        train(pm, task, adapter_steps[name], lr=3e-3, batch=args.batch, transform=fn, mixed_frac=0.0,
              label=name)
        for n_, p in pm.named_parameters():
            if "lora_" in n_:
                p.data = p.data.to(torch.bfloat16)  # stored in bf16
        adir = os.path.join(adapters_root, name)
        pm.save_pretrained(adir, safe_serialization=True)
        del pm
        os.remove(os.path.join(adir, "README.md"))  # peft's empty model-card template
        acfg_path = os.path.join(adir, "adapter_config.json")
        with open(acfg_path) as f:
            acfg = json.load(f)
        acfg["base_model_name_or_path"] = "demo/model"  # was the temporary bf16 folder
        acfg["target_modules"] = sorted(acfg["target_modules"])  # peft writes a set: run-to-run order
        with open(acfg_path, "w") as f:
            json.dump(acfg, f, indent=2, sort_keys=True)
            f.write("\n")
        # Reload from disk, so the check covers the saved files.
        pm = PeftModel.from_pretrained(load_bf16(), adir).eval()
        torch.nn.Module.float(pm)
        acc, miss = greedy_accuracy(pm, task, task.test_lower, fn, stop_ids)
        report["adapters"][name] = {"r": r, "lora_alpha": alpha, "target_modules": targets,
                                    "steps": adapter_steps[name], "bf16": acc}
        print(f"  {name} bf16+peft greedy accuracy {acc:.1%}; misses {miss[:3]}", flush=True)
        del pm

    # ---- verification on the int4 model
    q = load_transformers_fp32(model_dir)
    qtype = type(q.model.layers[0].self_attn.q_proj).__name__
    acc_l, miss = greedy_accuracy(q, task, task.test_lower, echo, stop_ids)
    acc_m, miss_m = greedy_accuracy(q, task, task.test_mixed, echo, stop_ids)
    report["base_int4"] = {"lowercase": acc_l, "mixed_case": acc_m, "layer": qtype}
    print(f"base int4 ({qtype}) greedy accuracy: lowercase {acc_l:.1%}, mixed case {acc_m:.1%}; "
          f"misses {(miss + miss_m)[:3]}", flush=True)
    for name, (_, _, _, fn) in ADAPTERS.items():
        handles = attach_lora_hooks(q, os.path.join(adapters_root, name))
        acc, miss = greedy_accuracy(q, task, task.test_lower, fn, stop_ids)
        for h in handles:
            h.remove()
        report["adapters"][name]["int4"] = acc
        print(f"  {name} int4+hooks greedy accuracy {acc:.1%}; misses {miss[:3]}", flush=True)

    # ---- examples (greedy on int4), sizes, report
    examples = []
    for ws in (["cat", "ant", "moon", "fox"], ["pig", "egg", "bee"], ["owl", "jam", "dog", "hat", "key"]):
        row = {"prompt": make_prompt(ws), "base": make_completion(ws)}
        for name, (_, _, _, fn) in ADAPTERS.items():
            row[name] = make_completion(fn(ws))
        examples.append(row)
    report["examples_expected"] = examples
    report["tokenizer_size"] = len(tok)
    report["config_vocab_size"] = vocab
    report["sizes_bytes"] = {"model": dir_size(model_dir),
                             **{f"adapters/{n}": dir_size(os.path.join(adapters_root, n)) for n in ADAPTERS}}
    report["wall_time_s"] = round(time.time() - t_start, 1)
    if args.keep_bf16:
        shutil.rmtree(args.keep_bf16, ignore_errors=True)
        shutil.copytree(bf16_dir, args.keep_bf16)
    shutil.rmtree(tmp, ignore_errors=True)

    print("\n==== demo report ====")
    print(f"task: prompt {make_prompt(['cat', 'ant', 'moon'])!r}; base echoes, adapters transform; "
          f"{MIN_WORDS}-{MAX_WORDS} distinct words of {len(WORDS)}")
    print(f"tokenizer {len(tok)} ids, config vocab {vocab}; held-out prompts: {len(task.test_lower)} "
          f"lowercase, {len(task.test_mixed)} mixed case")
    b, q4 = report["base_bf16"], report["base_int4"]
    print(f"base   bf16 {b['lowercase']:.1%} (mixed case {b['mixed_case']:.1%})   "
          f"int4 {q4['lowercase']:.1%} (mixed case {q4['mixed_case']:.1%})")
    for name, a in report["adapters"].items():
        print(f"{name:7s} r={a['r']:<3d} bf16+peft {a['bf16']:.1%}   int4+hooks {a['int4']:.1%}   "
              f"targets {','.join(a['target_modules'])}")
    for k, v in report["sizes_bytes"].items():
        print(f"size {k}: {v / 1e6:.2f} MB")
    print(f"wall time {report['wall_time_s']:.0f}s")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
