"""Which token ids end a sequence: config.json's, the tokenizer's and generation_config.json's, together."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers import make_engine

DEMO = Path(__file__).resolve().parents[2] / "demo"


def _demo_copy(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    shutil.copytree(DEMO / "model", path)
    return path


def test_eos_ids_union_of_the_three_sources(tmp_path: Path) -> None:
    path = _demo_copy(tmp_path)
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == 393
    gen = json.loads((path / "generation_config.json").read_text())
    assert make_engine(str(path)).eos_ids == {393, 395}  # the demo's own: <|endoftext|> and <|im_end|>
    gen["eos_token_id"] = 7  # a single int, not a list
    (path / "generation_config.json").write_text(json.dumps(gen))
    engine = make_engine(str(path))
    assert engine.eos_ids == {393, 7} and engine.tokenizer.eos_token_id == 393


def test_eos_ids_without_a_generation_config(tmp_path: Path) -> None:
    path = _demo_copy(tmp_path)
    (path / "generation_config.json").unlink()
    assert make_engine(str(path)).eos_ids == {393}
