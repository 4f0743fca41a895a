"""Deployment presets (configs/*.yaml) through the real --config code: every preset loads into an
EngineConfig, unknown keys and bad values fail naming the key, command-line flags win, and the demo
preset really serves the demo outputs documented in demo/README.md and the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from server.cli import DEMO_ADAPTERS, DEMO_MODEL, REPO_ROOT, build_engine_config, build_parser

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))
EXPECTED = {"demo-cpu.yaml", "qwen3-8b-int4-xpu.yaml", "qwen3.6-27b-int4-tp2-xpu.yaml", "qwen3-8b-int4-cuda.yaml"}
ONECCL_ENV = {"ZE_AFFINITY_MASK", "CCL_ATL_TRANSPORT", "CCL_ZE_IPC_EXCHANGE", "CCL_TOPO_FABRIC_VERTEX_CONNECTION_CHECK",
              "CCL_ENABLE_SYCL_KERNELS", "SYCL_UR_USE_LEVEL_ZERO_V2"}


def _parse(command: str, config: Path | str, *extra: str):
    argv = [command, "--config", str(config), *extra]
    a = build_parser(argv).parse_args(argv)
    if a.model is None:  # what `main` does: no model means the bundled demo
        a.model = str(DEMO_MODEL)
    return a


def _write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "preset.yaml"
    f.write_text(text)
    return f


def _fails(capsys: pytest.CaptureFixture[str], config: Path, *extra: str, command: str = "serve") -> str:
    with pytest.raises(SystemExit) as e:
        _parse(command, config, *extra)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_the_four_presets_exist() -> None:
    assert {c.name for c in CONFIGS} >= EXPECTED


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_preset_loads_into_an_engine_config(config: Path) -> None:
    data = yaml.safe_load(config.read_text())
    assert isinstance(data, dict) and "env" not in data  # environment variables live in comments only
    for command in ("serve", "generate") if "host" not in data and "port" not in data else ("serve",):
        extra = ("--requests", "in.jsonl") if command == "generate" else ()
        a = _parse(command, config, *extra)
        cfg = build_engine_config(a)
        for key, value in data.items():  # every key landed on its flag, with its value
            got = getattr(a, key.replace("-", "_"))
            assert got == value or got == [value], (key, got, value)
        assert cfg.lora.enable_lora == bool(data.get("enable-lora", False))
        if "model" not in data:
            assert cfg.model.path == str(DEMO_MODEL)


def test_tp2_preset_and_its_oneccl_comments() -> None:
    path = REPO_ROOT / "configs" / "qwen3.6-27b-int4-tp2-xpu.yaml"
    cfg = build_engine_config(_parse("serve", path))
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.parallel.device == "xpu"
    assert cfg.lora.enable_lora and cfg.lora.max_lora_rank == 64 and cfg.lora.max_loras >= 1
    assert cfg.model.max_model_len and cfg.lora.lora_roots == ("/adapters",)
    # One comment line per variable, each with its value and an explanation.
    lines = [ln for ln in path.read_text().splitlines() if ln.lstrip().startswith("#")]
    for var in ONECCL_ENV:
        hits = [ln for ln in lines if re.match(rf"#\s+{var}=\S+\s+#", ln.lstrip())]
        assert len(hits) == 1, (var, hits)
        assert re.search(rf"{var}=\S+\s+#\s*\w.{{30,}}", hits[0]), f"{var}: no explanation: {hits[0]}"
    assert "CCL_ATL_TRANSPORT=ofi" in path.read_text() and "CCL_ZE_IPC_EXCHANGE=sockets" in path.read_text()


def test_unknown_key_fails_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(capsys, _write(tmp_path, "max-loras: 2\nmax_lora: 4\n"))
    assert "unknown key 'max_lora'" in err and str(tmp_path / "preset.yaml") in err
    err = _fails(capsys, _write(tmp_path, "env:\n  CCL_ATL_TRANSPORT: ofi\n"))
    assert "unknown key 'env'" in err
    # `host` is a serve flag, not a generate one.
    err = _fails(capsys, _write(tmp_path, "host: 0.0.0.0\n"), "--requests", "x.jsonl", command="generate")
    assert "unknown key 'host'" in err


@pytest.mark.parametrize(("text", "message"), [
    ("max-loras: four\n", "key 'max-loras': expected an integer, got 'four'"),
    ("max-loras: 2.5\n", "key 'max-loras': expected an integer, got 2.5"),
    ("enable-lora: yes please\n", "key 'enable-lora': expected true or false, got 'yes please'"),
    ("dtype: half\n", "key 'dtype': 'half' is not one of auto, float32, bfloat16, float16"),
    ("gpu-memory-utilization: [0.9]\n", "key 'gpu-memory-utilization': expected a single value"),
    ("lora-modules: [reverse]\n", "key 'lora-modules': --lora-modules expects NAME=PATH, got 'reverse'"),
    ("- max-loras\n", "expected a mapping of flag names to values"),
    ("max-loras: [1\n", "not valid YAML"),
])
def test_bad_values_fail_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                        message: str) -> None:
    assert message in _fails(capsys, _write(tmp_path, text))


def test_missing_config_file_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "cannot read it" in _fails(capsys, tmp_path / "nope.yaml")


def test_values_are_converted_like_flags(tmp_path: Path) -> None:
    f = _write(tmp_path, "max_loras: '3'\ngpu_memory_utilization: 1\nlora-root: /adapters\n"
                         "lora-modules: {a: /x/a, b: /x/b}\nenable_lora: true\nno-lora-autoload: true\n"
                         "model: /models/m\nserved-model-name: 7\n")
    a = _parse("serve", f)
    assert a.max_loras == 3 and a.gpu_memory_utilization == 1.0 and isinstance(a.gpu_memory_utilization, float)
    assert a.lora_root == ["/adapters"] and a.lora_modules == [("a", "/x/a"), ("b", "/x/b")]
    assert a.enable_lora is True and a.no_lora_autoload is True and a.served_model_name == ["7"]  # one or more
    cfg = build_engine_config(a)
    assert cfg.model.served_model_name == "7" and cfg.model.extra_served_model_names == ()
    assert cfg.lora.lora_modules == (("a", "/x/a"), ("b", "/x/b")) and cfg.lora.lora_roots == ("/adapters",)
    assert cfg.lora.lora_autoload is False and cfg.model.path == "/models/m"
    a = _parse("serve", _write(tmp_path, "lora_modules: [a=/x/a, b=/x/b]\n"))
    assert a.lora_modules == [("a", "/x/a"), ("b", "/x/b")]


def test_command_line_flags_win(tmp_path: Path) -> None:
    f = _write(tmp_path, "model: /models/a\nmax-loras: 2\nlora-root: [/adapters]\nenable-lora: true\n"
                         "device: xpu\n")
    a = _parse("serve", f, "/models/b", "--max-loras", "5", "--lora-root", "/other", "--device=cpu")
    assert (a.model, a.max_loras, a.lora_root, a.device, a.enable_lora) == ("/models/b", 5, ["/other"], "cpu", True)
    a = _parse("serve", f, "--lora-r", "/abbrev")  # argparse's unambiguous abbreviation also wins
    assert a.lora_root == ["/abbrev"] and a.model == "/models/a" and a.max_loras == 2


def test_demo_preset_serves_the_documented_demo_outputs() -> None:
    from engine import LLMEngine, SamplingParams

    names = sorted(p.name for p in DEMO_ADAPTERS.iterdir() if (p / "adapter_config.json").is_file())
    assert names == ["reverse", "sort", "upper"]
    a = _parse("serve", REPO_ROOT / "configs" / "demo-cpu.yaml",
               "--lora-modules", *(f"{n}={DEMO_ADAPTERS / n}" for n in names), "--max-num-seqs", "4")
    with LLMEngine(build_engine_config(a)) as engine:
        assert engine.served_model_name == "model"  # README: the base is served under its folder name
        prompt = "words: cat ant moon fox =>"
        models = [None, "reverse", "upper", "sort"]
        out = engine.generate([prompt] * 4 + ["words: pig egg bee =>"],
                              SamplingParams(max_tokens=16, temperature=0), [*models, "reverse"])
    assert [r.text for r in out] == [" cat ant moon fox", " fox moon ant cat", " CAT ANT MOON FOX",
                                     " ant cat fox moon", " bee egg pig"]
