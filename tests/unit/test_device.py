"""engine.device: a TP size the visible devices cannot hold fails at once with the reason."""

from __future__ import annotations

import pytest

from engine import ConfigError
from engine.device import check_tp_fits


def test_tp_larger_than_the_visible_devices_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size 2 needs 2 cuda devices; 1 visible"):
        check_tp_fits("cuda", 2, 1)
    check_tp_fits("cuda", 2, 2)
    check_tp_fits("xpu", 1, 1)
    check_tp_fits("cpu", 4, None)  # CPU ranks share the host


def test_lora_slots_stay_float32_on_the_cpu_only() -> None:
    """lora_dtype "auto": the model dtype on GPUs; float32 on the CPU, whose LoRA GEMMs are faster in it."""
    import torch

    from engine.device import Device

    assert Device("cpu").lora_dtype(torch.bfloat16) == torch.float32
    assert Device("cpu").lora_dtype(torch.float32) == torch.float32
    assert Device("cuda").lora_dtype(torch.bfloat16) == torch.bfloat16
    assert Device("xpu").lora_dtype(torch.float16) == torch.float16


def test_gdn_backend_without_fla_core_keeps_the_decode_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on a GPU: fla-core where installed; without it our Triton decode kernel (prompts on the reference);
    without Triton too, the reference. The CPU always takes the reference; an explicit name is kept."""
    import importlib.util

    from engine import device as dev_mod
    from engine.device import Device
    from kernels import triton_env

    installed = {"fla": True}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "fla" and installed["fla"]
                        else None if name == "fla" else find_spec(name, *a))
    usable = {"now": True}
    monkeypatch.setattr(triton_env, "usable", lambda: usable["now"])
    monkeypatch.setattr(dev_mod, "triton_env", triton_env)
    assert Device("cuda").gdn_backend("auto") == "fla"
    installed["fla"] = False
    assert Device("xpu").gdn_backend("auto") == "triton"
    usable["now"] = False
    assert Device("xpu").gdn_backend("auto") == "reference"
    assert Device("cpu").gdn_backend("auto") == "reference"
    assert Device("cpu").gdn_backend("triton") == "triton"
