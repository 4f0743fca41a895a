"""Independent references: transformers (+ auto-round for int4 folders), run in float32."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from engine.protocol import SamplingParams


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, prompt_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt_ids])).logits[0].float()


def load_hf_dequantized(path: str) -> torch.nn.Module:
    """transformers model (float32) whose quantized linears hold the dense weights that auto-round's
    own torch QuantLinear computes from the checkpoint tensors (x @ I through its forward). Used for
    packings that auto-round's transformers integration cannot load without extra kernel packages."""
    import json
    import os

    from auto_round_extension.torch.qlinear_torch import QuantLinear as QLinearV2
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear as QLinearV1
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tools.tinymodels import force_transformers_torch_gdn

    force_transformers_torch_gdn()
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    qc = raw.pop("quantization_config")
    cls = QLinearV1 if qc["packing_format"] == "auto_round:auto_gptq" else QLinearV2
    state = load_file(os.path.join(path, "model.safetensors"))
    if raw.get("model_type") == "qwen3_5":  # vision-language export: keep the language model only
        from transformers import Qwen3_5TextConfig

        config = Qwen3_5TextConfig(**{k: v for k, v in raw["text_config"].items() if k != "model_type"})
        state = {k.replace("model.language_model.", "model."): v for k, v in state.items()
                 if not k.startswith(("model.visual.", "mtp."))}
    else:
        config = AutoConfig.for_model(**raw)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    dense: dict[str, torch.Tensor] = {}
    for name in [k[: -len(".qweight")] for k in state if k.endswith(".qweight")]:
        qw = state[f"{name}.qweight"]
        bits = int(qc.get("bits", 4))
        k, n = qw.shape[0] * 32 // bits, qw.shape[1]
        q = cls(bits, qc["group_size"], k, n, bias=False)
        q.qweight.copy_(qw)
        q.qzeros.copy_(state[f"{name}.qzeros"])
        q.scales = state[f"{name}.scales"].float()
        with torch.no_grad():
            dense[f"{name}.weight"] = q(torch.eye(k)).t().contiguous()
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            state.pop(f"{name}.{suffix}", None)
    state.update(dense)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


# -- sampling: transformers' logits processors in vLLM's order (formulas where transformers has none) ----------
def sampling_processed(logits: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int],
                       eos: tuple[int, ...]) -> torch.Tensor:
    """One row's logits after min_tokens, logit_bias, repetition penalty (transformers' processors) and the
    presence / frequency penalties (OpenAI's formula: logit -= count * frequency + (count > 0) * presence)."""
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    ids = torch.tensor([prompt + out])
    x = logits.float().unsqueeze(0).clone()
    stops = [*(() if p.ignore_eos else eos), *p.stop_token_ids]
    if p.min_tokens and stops:
        x = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, stops)(ids, x)
    if p.logit_bias:
        x = SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias})(ids, x)
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[-1]).float()
    return x[0] - counts * p.frequency_penalty - (counts > 0).float() * p.presence_penalty


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from: transformers' warpers in vLLM's order (temperature,
    min-p, top-k, top-p)."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    chain = LogitsProcessorList([TemperatureLogitsWarper(p.temperature)])
    if p.min_p > 0:
        chain.append(MinPLogitsWarper(p.min_p))
    if p.top_k > 0:
        chain.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        chain.append(TopPLogitsWarper(p.top_p))
    x = chain(torch.zeros(1, 1, dtype=torch.long), logits.float().unsqueeze(0).clone())
    return torch.softmax(x, dim=-1)[0]


def inverse_cdf_pick(probs: torch.Tensor, p: SamplingParams, u: float) -> int:
    """The token a draw u in [0, 1) selects under the sampler's documented rule: the first token whose
    cumulative mass exceeds u * total, in descending-probability order for truncating rows (min-p / top-k /
    top-p), in vocabulary order otherwise."""
    if p.top_k > 0 or p.top_p < 1 or p.min_p > 0:
        order = torch.sort(probs, descending=True, stable=True).indices
    else:
        order = torch.arange(probs.shape[-1])
    cdf = torch.cumsum(probs[order].double(), 0)
    return int(order[int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=probs.shape[-1] - 1))])
