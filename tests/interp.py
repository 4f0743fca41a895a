"""Run a snippet in a child Python with TRITON_INTERPRET=1 (the variable must be set before triton is
imported, so the kernels cannot run under the interpreter inside the test process itself)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


def run_under_interpreter(code: str, timeout: int = 300) -> None:
    """The snippet must print "ok" when its own checks pass."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
