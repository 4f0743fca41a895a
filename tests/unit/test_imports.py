"""Our top-level `kernels` package must not break transformers, which probes for Hugging Face's
`kernels` hub package of the same name."""

from __future__ import annotations

import subprocess
import sys


def test_transformers_imports_next_to_our_kernels_package() -> None:
    code = ("import kernels, kernels.int4; import transformers; "
            "from transformers import AutoModelForCausalLM, Qwen3ForCausalLM; "
            "from transformers.utils import is_kernels_available; print(is_kernels_available())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_server_path_does_not_import_auto_round() -> None:
    code = ("import sys, engine, server.cli; from engine import LLMEngine; "
            "assert 'auto_round' not in sys.modules, 'auto_round imported'; "
            "assert 'pandas' not in sys.modules, 'pandas imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
