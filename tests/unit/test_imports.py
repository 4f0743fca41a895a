"""Import rules: our top-level `kernels` package must not break transformers (which probes for Hugging
Face's `kernels` hub package of the same name), and the server uses only what `engine` exports."""

from __future__ import annotations

import ast
import pathlib
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


def test_the_api_process_modules_import_neither_torch_nor_the_model_code() -> None:
    """What `xpulora serve` imports in the API process (the CLI, the app, the engine client and what the
    engine package exports eagerly) loads no torch and no model code: those live in the engine core."""
    proc = _python("import sys, server.cli, server.app, engine; from engine import EngineClient, SamplingParams, "
                   "DEVICE_CHOICES; heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith("
                   "('engine.models', 'engine.layers', 'engine.llm_engine', 'engine.model_runner', 'kernels.int4'))); "
                   "assert not heavy, heavy; print(DEVICE_CHOICES)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = _python("import sys, engine; engine.LLMEngine; assert 'torch' in sys.modules")  # still there, on use
    assert proc.returncode == 0, proc.stderr[-2000:]


_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _server_reach_ins(source: str) -> list[str]:
    """What DESIGN.md's import rule forbids in server code: importing an engine submodule, or reaching
    through the engine client into an LLMEngine behind it (`<...>.engine.engine`)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("engine."):
            bad.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            bad += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("engine.")]
        elif isinstance(node, ast.Attribute) and node.attr == "engine":
            inner = node.value
            if (isinstance(inner, ast.Name) and inner.id == "engine") or (
                    isinstance(inner, ast.Attribute) and inner.attr == "engine"):
                bad.append(f"line {node.lineno}: .engine.engine")
    return bad


def test_the_rule_checker_finds_reach_ins() -> None:
    source = ("from engine.protocol import RequestError\nimport engine.config\n"
              "def f(self, engine):\n    return engine.engine.lora, self.engine.engine.config\n")
    assert len(_server_reach_ins(source)) == 4
    assert _server_reach_ins("from engine import EngineClient\nx = request.app.state.engine.served\n") == []


def test_server_uses_only_what_engine_exports() -> None:
    bad = {str(p.relative_to(_ROOT)): found for p in sorted((_ROOT / "server").rglob("*.py"))
           if (found := _server_reach_ins(p.read_text()))}
    assert not bad, f"server code must use only `from engine import ...` names: {bad}"


def test_engine_errors_live_in_the_leaf_errors_module() -> None:
    import engine.errors

    elsewhere = [f"{p.relative_to(_ROOT)}:{node.lineno} {node.name}" for p in sorted((_ROOT / "engine").rglob("*.py"))
                 if p.name != "errors.py" for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, ast.ClassDef) and any(
                     isinstance(b, ast.Name) and b.id.endswith(("Error", "Exception")) for b in node.bases)]
    assert not elsewhere, f"engine error classes belong in engine/errors.py: {elsewhere}"
    leaf = ast.parse((_ROOT / "engine" / "errors.py").read_text())
    imports = [n for n in leaf.body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert all(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in imports)
    classes = [c for c in vars(engine.errors).values() if isinstance(c, type) and issubclass(c, Exception)]
    assert len(classes) >= 17
