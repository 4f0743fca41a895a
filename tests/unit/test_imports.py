"""Our top-level `kernels` package must not break transformers, which probes for Hugging Face's
`kernels` hub package of the same name."""

from __future__ import annotations

import subprocess
import sys


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_transformers_imports_next_to_our_kernels_package() -> None:
    proc = _python("import kernels, kernels.int4; import transformers; "
                   "from transformers import AutoModelForCausalLM, Qwen3ForCausalLM; "
                   "from transformers.utils import is_kernels_available; print(is_kernels_available())")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # transformers must not mistake our package for the Hugging Face hub's `kernels`.
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stdout


def test_server_path_does_not_import_auto_round() -> None:
    proc = _python("import sys, engine, server.cli; from engine import LLMEngine; "
                   "assert 'auto_round' not in sys.modules, 'auto_round imported'; "
                   "assert 'pandas' not in sys.modules, 'pandas imported'")
    assert proc.returncode == 0, proc.stderr[-2000:]
