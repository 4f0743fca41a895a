"""Run a snippet in a child Python with TRITON_INTERPRET=1 (the variable must be set before triton is
imported, so the kernels cannot run under the interpreter inside the test process itself)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


def interpreter_skip_reason() -> str | None:
    """Why the Triton interpreter cannot run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    import numpy

    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 5):
        # triton/runtime/interpreter.py (3.6) indexes with int(<1-element array>), which numpy 2.5 refuses
        # ("only 0-dimensional arrays can be converted to Python scalars"); hosts with numpy 2.5 run the
        # compiled kernels' tests instead (the device image has it; the CPU test machine does not).
        return f"the Triton interpreter fails with numpy {numpy.__version__} (int() of a 1-element array)"
    return None


def run_under_interpreter(code: str, timeout: int = 300) -> None:
    """The snippet must print "ok" when its own checks pass."""
    reason = interpreter_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
