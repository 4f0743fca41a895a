"""Independent references: transformers (+ auto-round for int4 folders), run in float32."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


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
