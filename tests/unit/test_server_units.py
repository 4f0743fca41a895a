"""Server pieces that need no model: request validation, lora-root confinement, the demo setup."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine import AdapterPathForbiddenError, EngineConfig, LoRAConfig, ModelConfig, resolve_under_roots
from server.openai_protocol import ChatCompletionRequest, CompletionRequest, format_validation_errors


def _error(cls: type, **body: object) -> str:
    with pytest.raises(ValidationError) as e:
        cls.model_validate(body)
    return format_validation_errors(e.value.errors())


def test_requests_name_what_they_refuse() -> None:
    ok = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]], "presence_penalty": 0, "n": 2})
    assert ok.prompts() == [[1, 2], [3]] and ok.max_tokens == 16
    assert _error(CompletionRequest, model="m", prompt="x", zork=1, best_of=3) == \
        "'best_of' is not supported by this server (use n); unsupported field 'zork'"
    assert "field 'max_tokens'" in _error(CompletionRequest, model="m", prompt="x", max_tokens="5")
    assert "field 'echo'" in _error(CompletionRequest, model="m", prompt="x", echo=1)
    assert "'prompt' must be" in _error(CompletionRequest, model="m", prompt=[1, "a"])
    assert "'prompt' must be" in _error(CompletionRequest, model="m", prompt=[True])
    assert "'logit_bias' keys must be token ids" in _error(CompletionRequest, model="m", prompt="x",
                                                           logit_bias={"a": 1})
    assert "field 'frequency_penalty'" in _error(CompletionRequest, model="m", prompt="x", frequency_penalty="1")
    assert "field 'min_tokens'" in _error(CompletionRequest, model="m", prompt="x", min_tokens=-1)
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "logit_bias": {"5": 250, "6": -1}}
                                            ).logit_bias_pairs == ((5, 100.0), (6, -1.0))  # clamped as vLLM
    assert "missing field 'model'" in _error(CompletionRequest, prompt="x")
    assert "only allowed when 'stream'" in _error(CompletionRequest, model="m", prompt="x",
                                                  stream_options={"include_usage": True})
    assert "field 'n'" in _error(CompletionRequest, model="m", prompt="x", n=0)
    assert "field 'temperature'" in _error(CompletionRequest, model="m", prompt="x", temperature=float("inf"))
    assert "field 'seed'" in _error(CompletionRequest, model="m", prompt="x", seed=1 << 64)
    assert "field 'top_k'" in _error(CompletionRequest, model="m", prompt="x", top_k=1 << 40)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs, "tool_choice": "none"})
    assert chat.messages[0].text() == "a\nb" and chat.output_limit is None
    assert "'top_logprobs' requires" in _error(ChatCompletionRequest, model="m", messages=msgs, top_logprobs=1)
    assert "not both" in _error(ChatCompletionRequest, model="m", messages=msgs, max_tokens=1, max_completion_tokens=1)
    assert "tools.0.function" in _error(ChatCompletionRequest, model="m", messages=msgs, tools=[{"type": "function"}])
    assert "messages.0.role" in _error(ChatCompletionRequest, model="m", messages=[{"role": "robot", "content": "x"}])
    assert "unsupported field 'messages.0.tool_calls.0.extra'" in _error(
        ChatCompletionRequest, model="m", messages=[{"role": "assistant", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}, "extra": 1}]}])
    assert "'functions' is not supported" in _error(ChatCompletionRequest, model="m", messages=msgs, functions=[{}])


def test_lora_root_confinement(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    (outside / "b").mkdir(parents=True)
    os.symlink(outside / "b", root / "link")
    os.symlink(root / "a", root / "inner")  # a symlink that stays inside is fine
    real_root = os.path.realpath(root)
    assert resolve_under_roots(str(root / "a"), [str(root)]) == os.path.join(real_root, "a")
    assert resolve_under_roots("a", [str(outside), str(root)]) == os.path.join(real_root, "a")
    assert resolve_under_roots("inner", [str(root)]) == os.path.join(real_root, "a")
    assert resolve_under_roots("missing", [str(root)]) == os.path.join(real_root, "missing")
    for bad in (str(outside / "b"), f"{root}/../outside/b", "../outside/b", str(root / "link"), "link", "/", str(root)
                + "x"):
        with pytest.raises(AdapterPathForbiddenError):
            resolve_under_roots(bad, [str(root)])
    with pytest.raises(AdapterPathForbiddenError, match="--lora-root"):
        resolve_under_roots(str(root / "a"), [])


def test_demo_config_enables_lora_on_the_demo_adapters(tmp_path: Path) -> None:
    from server.cli import demo_config

    for name in ("upper", "reverse"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    cfg = demo_config(EngineConfig(ModelConfig("demo/model"), lora=LoRAConfig(lora_modules=(("upper", "/x"),))),
                       tmp_path)
    assert cfg.lora.enable_lora and cfg.lora.lora_roots == (str(tmp_path),)
    assert cfg.lora.lora_modules == (("upper", "/x"), ("reverse", str(tmp_path / "reverse")))
    assert cfg.parallel.device == "cpu"


def test_serve_without_demo_model_explains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import server.cli
    from server.app import run_server

    monkeypatch.setattr(server.cli, "DEMO_MODEL", tmp_path / "model")
    args = argparse.Namespace(model=str(tmp_path / "model"))
    assert run_server(args, EngineConfig(ModelConfig(str(tmp_path / "model")))) == 2
    assert "demo model is not built" in capsys.readouterr().out
