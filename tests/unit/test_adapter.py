"""engine.lora.adapter: PEFT folders built by peft itself -> validated (A, B*scale) tensors, and every refusal."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.lora import adapter as adapter_mod
from engine.lora.adapter import AdapterError, AdapterNotFoundError, LoRAAdapter, load_adapter
from tests.helpers import ALL7


def read_checksum(path: str | Path) -> str:
    """The documented adapter checksum, computed here from the files: sha256 over (8-byte little-endian
    length, bytes) of adapter_config.json then adapter_model.safetensors."""
    h = hashlib.sha256()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        data = (Path(path) / f).read_bytes()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()

peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
              pytest.mark.filterwarnings("ignore:The following alpha_pattern keys did not match")]
transformers = pytest.importorskip("transformers")

PFX = "base_model.model."


def _tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return transformers.Qwen3ForCausalLM(cfg).float().eval()


def target_shapes_of(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Every Linear of the base except the output head -> (in_features, out_features)."""
    return {n: (m.in_features, m.out_features) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"}


SHAPES = target_shapes_of(_tiny_model())


def build(tmp: Path, dirname: str, seed: int = 1, **lora_kwargs):
    """A real peft adapter with random non-zero A and B, saved as safetensors; returns (folder, peft model)."""
    model = _tiny_model()
    lora_kwargs.setdefault("target_modules", ALL7)
    pm = peft.get_peft_model(model, peft.LoraConfig(**lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    out = tmp / dirname
    pm.save_pretrained(str(out), safe_serialization=True)
    return out, pm


def peft_layers(pm) -> dict[str, torch.nn.Module]:
    """canonical module name -> peft LoRA layer."""
    return {n.removeprefix(PFX): m for n, m in pm.named_modules()
            if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})}


def assert_matches_peft(ad: LoRAAdapter, pm) -> None:
    layers = peft_layers(pm)
    assert set(ad.modules) == set(layers) and layers
    for n, layer in layers.items():
        mod = ad.modules[n]
        a_ref = layer.lora_A["default"].weight.detach().float()
        b_ref = layer.lora_B["default"].weight.detach().float() * layer.scaling["default"]
        assert mod.rank == layer.r["default"] == a_ref.shape[0]
        assert mod.a.dtype == mod.b.dtype == torch.float32 and mod.a.device.type == "cpu"
        assert mod.a.is_contiguous() and mod.b.is_contiguous()
        torch.testing.assert_close(mod.a, a_ref, rtol=0, atol=0)
        torch.testing.assert_close(mod.b, b_ref, rtol=1e-6, atol=0)
    assert ad.rank == max(m.rank for m in ad.modules.values())


def copy_with(src: Path, dst: Path, cfg_edit=None, tensors_edit=None) -> Path:
    """Copy an adapter folder, optionally editing its config dict and/or its tensor dict in place."""
    shutil.copytree(src, dst)
    if cfg_edit is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg_edit(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors_edit is not None:
        t = load_file(str(dst / "adapter_model.safetensors"))
        tensors_edit(t)
        save_file(t, str(dst / "adapter_model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def basic(tmp):
    """r=8, alpha=16, all seven projections."""
    return build(tmp, "basic", r=8, lora_alpha=16)


@pytest.fixture(scope="module")
def small(tmp):
    """r=4, alpha=8, q_proj and v_proj only: the base for most refusal tests."""
    return build(tmp, "small", seed=2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])[0]


Q0 = "model.layers.0.self_attn.q_proj"
KEY_A, KEY_B = f"{PFX}{Q0}.lora_A.weight", f"{PFX}{Q0}.lora_B.weight"


# ------------------------------------------------------------------------------------------------
# what loads, and equals peft


def test_basic_matches_peft_and_forward(basic):
    path, pm = basic
    ad = load_adapter("basic", str(path), SHAPES, max_rank=64)
    assert ad.name == "basic" and ad.path == os.path.realpath(path) and ad.alpha == 16
    assert len(ad.modules) == 2 * len(ALL7)
    assert_matches_peft(ad, pm)
    assert pm.peft_config["default"].lora_alpha / pm.peft_config["default"].r == 2.0  # plain alpha/r
    # the delta peft adds on one layer is x A^T (B*scale)^T
    layer = peft_layers(pm)["model.layers.1.mlp.down_proj"]
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        delta = layer(x) - layer.base_layer(x)
    m = ad.modules["model.layers.1.mlp.down_proj"]
    torch.testing.assert_close(x @ m.a.T @ m.b.T, delta, rtol=1e-4, atol=1e-5)
    assert ad.checksum == read_checksum(str(path))


def test_rslora_scale(tmp):
    path, pm = build(tmp, "rslora", seed=3, r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"])
    ad = load_adapter("rs", str(path), SHAPES, max_rank=64)
    assert_matches_peft(ad, pm)
    layer = peft_layers(pm)[Q0]
    assert layer.scaling["default"] == pytest.approx(8 / math.sqrt(16))  # not 8/16
    raw_b = load_file(str(path / "adapter_model.safetensors"))[KEY_B]
    torch.testing.assert_close(ad.modules[Q0].b, raw_b * (8 / 4), rtol=1e-6, atol=0)


def test_rank_and_alpha_pattern(tmp):
    # peft: the first key matching a whole dot-separated suffix wins. "q_proj" matches every q_proj; a full
    # name and a regex override single modules; "proj" and "self_attn" are fragments but not dot-suffixes,
    # so they match nothing (a search/endswith rule would apply them)
    path, pm = build(tmp, "patterns", seed=4, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                     rank_pattern={"q_proj": 4, "model.layers.1.mlp.down_proj": 12, r"layers\.0\.mlp\.down_\w+": 2},
                     alpha_pattern={"proj": 99, "self_attn": 77, r"layers\.1\.self_attn\.v_proj": 3, "down_proj": 24})
    ad = load_adapter("pat", str(path), SHAPES, max_rank=64)
    assert_matches_peft(ad, pm)
    ranks = {n: m.rank for n, m in ad.modules.items()}
    assert ranks == {"model.layers.0.self_attn.q_proj": 4, "model.layers.1.self_attn.q_proj": 4,
                     "model.layers.0.self_attn.v_proj": 8, "model.layers.1.self_attn.v_proj": 8,
                     "model.layers.0.mlp.down_proj": 2, "model.layers.1.mlp.down_proj": 12}
    scal = {n: layer.scaling["default"] for n, layer in peft_layers(pm).items()}
    assert scal["model.layers.1.self_attn.v_proj"] == pytest.approx(3 / 8)
    assert scal["model.layers.0.self_attn.v_proj"] == pytest.approx(16 / 8)
    assert scal["model.layers.1.mlp.down_proj"] == pytest.approx(24 / 12)
    assert ad.rank == 12


def test_overlapping_patterns_follow_the_saved_file_like_peft_reload(tmp):
    """With two keys matching one module, the first key IN THE FILE wins. peft writes the config with sorted
    keys, so this can differ from training time; PeftModel.from_pretrained (the oracle here) does the same."""
    path, pm = build(tmp, "overlap", seed=8, r=8, lora_alpha=16, target_modules=["q_proj"],
                     alpha_pattern={"q_proj": 4, r"layers\.1\.self_attn\.q_proj": 60})
    q1 = "model.layers.1.self_attn.q_proj"
    assert peft_layers(pm)[q1].scaling["default"] == pytest.approx(4 / 8)  # training time: "q_proj" first
    keys = list(json.loads((path / "adapter_config.json").read_text())["alpha_pattern"])
    assert keys == [r"layers\.1\.self_attn\.q_proj", "q_proj"]  # saved sorted
    reloaded = peft.PeftModel.from_pretrained(_tiny_model(), str(path))
    assert peft_layers(reloaded)[q1].scaling["default"] == pytest.approx(60 / 8)
    ad = load_adapter("ov", str(path), SHAPES, max_rank=8)
    assert_matches_peft(ad, reloaded)
    # the same overlap in rank_pattern cannot be reloaded by peft either; we refuse and say why
    path, _ = build(tmp, "overlap-r", seed=9, r=8, lora_alpha=16, target_modules=["q_proj"],
                    rank_pattern={"q_proj": 4, r"layers\.1\.self_attn\.q_proj": 6})
    with pytest.raises(RuntimeError, match="size mismatch"):
        peft.PeftModel.from_pretrained(_tiny_model(), str(path))
    with pytest.raises(AdapterError, match=r"q_proj: lora_A shape \[4, 256\].*expected \[6, 256\].*rank_pattern keys "
                                           r"\['layers.*q_proj', 'q_proj'\] all match this module"):
        load_adapter("ovr", str(path), SHAPES, max_rank=8)


def test_regex_target_modules_and_layers_to_transform(tmp):
    path, pm = build(tmp, "regex", seed=5, r=8, lora_alpha=8, target_modules=r".*\.layers\.1\.(self_attn\.(q|k)|mlp\.up)_proj")
    ad = load_adapter("rx", str(path), SHAPES, max_rank=8)
    assert set(ad.modules) == {"model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
                               "model.layers.1.mlp.up_proj"}
    assert_matches_peft(ad, pm)
    path2, pm2 = build(tmp, "ltt", seed=6, r=8, lora_alpha=8, target_modules=["o_proj"], layers_to_transform=[1])
    ad2 = load_adapter("ltt", str(path2), SHAPES, max_rank=8)
    assert set(ad2.modules) == {"model.layers.1.self_attn.o_proj"}
    assert_matches_peft(ad2, pm2)
    # a string is a regex that must match the WHOLE module name (peft: re.fullmatch), not a fragment
    p = copy_with(path, tmp / "regex-fragment", cfg_edit=lambda c: c.update(target_modules=r"layers\.1\.(self_attn\.(q|k)|mlp\.up)_proj"))
    with pytest.raises(AdapterError, match=r"'rx'.*model\.layers\.1\.mlp\.up_proj has LoRA tensors but is not targeted"):
        load_adapter("rx", str(p), SHAPES, max_rank=8)
    # a layer-0 tensor that layers_to_transform excludes is refused
    bad = copy_with(path2, tmp / "ltt-extra", tensors_edit=lambda t: t.update({
        f"{PFX}model.layers.0.self_attn.o_proj.lora_A.weight": torch.zeros(8, 256),
        f"{PFX}model.layers.0.self_attn.o_proj.lora_B.weight": torch.zeros(256, 8)}))
    with pytest.raises(AdapterError, match=r"'ltt'.*model\.layers\.0\.self_attn\.o_proj.*not targeted"):
        load_adapter("ltt", str(bad), SHAPES, max_rank=8)


def test_exclude_modules_and_all_linear(tmp, small):
    path, pm = build(tmp, "excl", seed=7, r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                     exclude_modules=["model.layers.0.self_attn.v_proj"])
    ad = load_adapter("ex", str(path), SHAPES, max_rank=8)
    assert "model.layers.0.self_attn.v_proj" not in ad.modules and len(ad.modules) == 3
    assert_matches_peft(ad, pm)
    p = copy_with(small, tmp / "excl-bad", cfg_edit=lambda c: c.update(exclude_modules=r".*layers\.0\.self_attn\.v_proj"))
    with pytest.raises(AdapterError, match=r"model\.layers\.0\.self_attn\.v_proj.*not targeted"):
        load_adapter("ex", str(p), SHAPES, max_rank=8)
    p = copy_with(small, tmp / "all-linear", cfg_edit=lambda c: c.update(target_modules="all-linear"))
    assert len(load_adapter("al", str(p), SHAPES, max_rank=8).modules) == 4


def test_key_namings(tmp, basic):
    path, pm = basic
    ref = load_adapter("basic", str(path), SHAPES, max_rank=64)

    def rename(fn):
        def edit(t):
            for k in list(t):
                t[fn(k)] = t.pop(k)
        return edit

    variants = {
        "vl": lambda k: k.replace("model.layers.", "model.language_model.layers."),
        "noprefix": lambda k: k.removeprefix(PFX),
        "segment": lambda k: k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight",
                                                                                            ".lora_B.default.weight"),
    }
    for tag, fn in variants.items():
        p = copy_with(path, tmp / f"names-{tag}", tensors_edit=rename(fn))
        if tag == "vl":
            assert all(".language_model.layers." in k for k in load_file(str(p / "adapter_model.safetensors")))
        ad = load_adapter(tag, str(p), SHAPES, max_rank=64)
        assert set(ad.modules) == set(ref.modules), tag
        for n in ref.modules:
            assert torch.equal(ad.modules[n].a, ref.modules[n].a) and torch.equal(ad.modules[n].b, ref.modules[n].b)
    # full module paths in target_modules, written in the vision-language spelling
    vl_names = sorted({k.removeprefix(PFX).rsplit(".lora_", 1)[0].replace("model.layers.", "model.language_model.layers.")
                       for k in load_file(str(path / "adapter_model.safetensors"))})
    p = copy_with(tmp / "names-vl", tmp / "names-vl-full", cfg_edit=lambda c: c.update(target_modules=vl_names))
    assert set(load_adapter("vlf", str(p), SHAPES, max_rank=64).modules) == set(ref.modules)
    # a rank_pattern written against the vision-language names (as peft saw them) still applies
    def vl_rank4(t):
        for k in list(t):
            v = t.pop(k)
            if ".1.self_attn.q_proj" in k:
                v = v[:4].contiguous() if "lora_A" in k else v[:, :4].contiguous()
            t[k.replace("model.layers.", "model.language_model.layers.")] = v
    p = copy_with(path, tmp / "names-vl-pattern", tensors_edit=vl_rank4,
                  cfg_edit=lambda c: c.update(rank_pattern={r"model\.language_model\.layers\.1\.self_attn\.q_proj": 4}))
    ad = load_adapter("vlp", str(p), SHAPES, max_rank=64)
    assert ad.modules["model.layers.1.self_attn.q_proj"].rank == 4 and ad.modules[Q0].rank == 8
    # both namings for one module at once: refused as a duplicate
    p = copy_with(path, tmp / "names-dup", tensors_edit=lambda t: t.update(
        {k.replace("model.layers.", "model.language_model.layers."): v.clone() for k, v in t.items() if Q0 in k}))
    with pytest.raises(AdapterError, match=r"'dup'.*q_proj: two lora_A"):
        load_adapter("dup", str(p), SHAPES, max_rank=64)


def test_bf16_adapter_read_as_float32(tmp, small):
    p = copy_with(small, tmp / "bf16", tensors_edit=lambda t: t.update({k: v.bfloat16() for k, v in t.items()}))
    ad = load_adapter("bf", str(p), SHAPES, max_rank=8)
    raw = load_file(str(p / "adapter_model.safetensors"))
    assert ad.modules[Q0].a.dtype == torch.float32
    torch.testing.assert_close(ad.modules[Q0].a, raw[KEY_A].float(), rtol=0, atol=0)
    torch.testing.assert_close(ad.modules[Q0].b, raw[KEY_B].float() * 2, rtol=0, atol=0)


def test_checksum_and_realpath(tmp, small):
    p = copy_with(small, tmp / "ck")
    link = tmp / "ck-link"
    os.symlink(p, link)
    ad = load_adapter("ck", str(link), SHAPES, max_rank=8)
    assert ad.path == str(p.resolve())
    c0 = read_checksum(str(p))
    assert ad.checksum == c0 == read_checksum(str(link)) and len(c0) == 64
    cfg = json.loads((p / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 9
    (p / "adapter_config.json").write_text(json.dumps(cfg))
    c1 = read_checksum(str(p))
    t = load_file(str(p / "adapter_model.safetensors"))
    t[KEY_B] = t[KEY_B] + 1
    save_file(t, str(p / "adapter_model.safetensors"))
    assert len({c0, c1, read_checksum(str(p))}) == 3
    assert load_adapter("ck", str(p), SHAPES, max_rank=8).checksum == read_checksum(str(p))


@pytest.mark.parametrize("name", ["a", "my-adapter_v1.2", "A" * 128, "-x", "_"])
def test_valid_names(small, name):
    assert load_adapter(name, str(small), SHAPES, max_rank=8).name == name


# ------------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "a b", "x" * 129, "../up", "é", None])
def test_invalid_names(small, name):
    with pytest.raises(AdapterError, match="invalid adapter name"):
        load_adapter(name, str(small), SHAPES, max_rank=8)


def test_missing_paths(tmp, small):
    with pytest.raises(AdapterNotFoundError, match=r"'gone'.*does not exist"):
        load_adapter("gone", str(tmp / "does-not-exist"), SHAPES, max_rank=8)
    with pytest.raises(AdapterNotFoundError, match=r"'f'.*not a directory"):
        load_adapter("f", str(small / "adapter_config.json"), SHAPES, max_rank=8)
    (tmp / "empty").mkdir()
    with pytest.raises(AdapterNotFoundError, match=r"'e'.*no adapter_model\.safetensors"):
        load_adapter("e", str(tmp / "empty"), SHAPES, max_rank=8)
    p = copy_with(small, tmp / "nocfg")
    (p / "adapter_config.json").unlink()
    with pytest.raises(AdapterNotFoundError, match=r"'n'.*no adapter_config\.json"):
        load_adapter("n", str(p), SHAPES, max_rank=8)
    p = copy_with(small, tmp / "noweights")
    (p / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterNotFoundError, match=r"'w'.*no adapter_model\.safetensors"):
        load_adapter("w", str(p), SHAPES, max_rank=8)


def test_pickled_bin_refused(tmp, small):
    p = copy_with(small, tmp / "pickled")
    torch.save(load_file(str(p / "adapter_model.safetensors")), str(p / "adapter_model.bin"))
    (p / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"'pk'.*pickled \.bin adapters are refused; save with "
                                           r"safe_serialization=True") as ei:
        load_adapter("pk", str(p), SHAPES, max_rank=8)
    assert not isinstance(ei.value, AdapterNotFoundError)  # 400, not 404


def test_invalid_json(tmp, small):
    p = copy_with(small, tmp / "badjson")
    (p / "adapter_config.json").write_text('{"r": 4, "lora_alpha": ')
    with pytest.raises(AdapterError, match=r"'bj'.*not valid JSON"):
        load_adapter("bj", str(p), SHAPES, max_rank=8)
    (p / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(AdapterError, match=r"'bj'.*JSON object"):
        load_adapter("bj", str(p), SHAPES, max_rank=8)


CONFIG_REFUSALS = [
    ({"peft_type": "IA3"}, r"peft_type 'IA3'.*only LORA"),
    ({"r": None}, r"required field 'r'"),
    ({"lora_alpha": None}, r"required field 'lora_alpha'"),
    ({"target_modules": None}, r"required field 'target_modules'"),
    ({"r": 0}, r"r must be a positive integer"),
    ({"lora_alpha": "big"}, r"lora_alpha must be a finite number"),
    ({"use_dora": True}, r"DoRA"),
    ({"bias": "all"}, r"bias='all'.*not supported"),
    ({"bias": "lora_only"}, r"bias='lora_only'"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save=\['lm_head'\]"),
    ({"fan_in_fan_out": True}, r"fan_in_fan_out"),
    ({"target_modules": ["q_proj", "v_proj", "lm_head"]}, r"target module 'lm_head' is not a LoRA-capable"),
    ({"target_modules": ["embed_tokens", "q_proj", "v_proj"]}, r"target module 'embed_tokens'"),
    ({"target_modules": "(q_proj"}, r"target_modules '\(q_proj' is not a valid regex"),
    ({"rank_pattern": {"q_proj": -1}}, r"rank_pattern\['q_proj'\] must be a positive integer"),
    ({"alpha_pattern": {"q_proj": "x"}}, r"alpha_pattern\['q_proj'\] must be a finite number"),
    ({"alora_invocation_tokens": [1, 2]}, r"activated LoRA"),
    ({"lora_bias": True}, r"lora_bias"),
    ({"use_qalora": True}, r"QA-LoRA"),
    ({"init_lora_weights": "pissa_niter_4"}, r"init_lora_weights='pissa_niter_4'.*modified base"),
    ({"init_lora_weights": "olora"}, r"init_lora_weights='olora'"),
]


@pytest.mark.parametrize("edit,pattern", CONFIG_REFUSALS, ids=["-".join(f"{k}={v}" for k, v in e.items())[:40]
                                                              for e, _ in CONFIG_REFUSALS])
def test_config_refusals(tmp, small, edit, pattern):
    def apply(c):
        for k, v in edit.items():
            if v is None:
                c.pop(k, None)
            else:
                c[k] = v
    p = copy_with(small, tmp / f"cfg-{abs(hash(json.dumps(edit)))}", cfg_edit=apply)
    with pytest.raises(AdapterError, match=rf"adapter 'cfg'.*{pattern}"):
        load_adapter("cfg", str(p), SHAPES, max_rank=8)


def test_untouched_config_fields_load(small):
    """Guard for the refusal table: the unedited copy loads (so each refusal comes from its edit)."""
    cfg = json.loads((small / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["use_dora"] is False and cfg["bias"] == "none"
    assert len(load_adapter("cfg", str(small), SHAPES, max_rank=8).modules) == 4


TENSOR_REFUSALS = [
    (lambda t: t.update({f"{PFX}model.embed_tokens.lora_embedding_A": torch.zeros(4, 128)}),
     r"tensor 'base_model\.model\.model\.embed_tokens\.lora_embedding_A': embedding LoRA"),
    (lambda t: t.update({f"{PFX}{Q0}.lora_magnitude_vector": torch.ones(256)}),
     r"q_proj\.lora_magnitude_vector': DoRA"),
    (lambda t: t.update({f"{PFX}{Q0}.lora_B.bias": torch.zeros(256)}), r"lora_B\.bias': bias tensors"),
    (lambda t: t.update({f"{PFX}model.norm.weight": torch.ones(256)}), r"'base_model\.model\.model\.norm\.weight': unexpected"),
    (lambda t: t.pop(KEY_B), rf"module {Q0} has no lora_B"),
    (lambda t: t.pop(KEY_A), rf"module {Q0} has no lora_A"),
    (lambda t: t.update({KEY_A: t[KEY_A][:, :128].contiguous()}), rf"module {Q0}: lora_A shape \[4, 128\] / lora_B shape \[256, 4\] != expected \[4, 256\] / \[256, 4\]"),
    (lambda t: t.update({KEY_B: torch.zeros(512, 4)}), rf"{Q0}: lora_A shape \[4, 256\] / lora_B shape \[512, 4\]"),
    (lambda t: t.update({KEY_A: torch.zeros(6, 256), KEY_B: torch.zeros(256, 6)}), r"\[6, 256\] / lora_B shape \[256, 6\] != expected \[4, 256\] / \[256, 4\]"),
    (lambda t: t.update({KEY_A: t[KEY_A].to(torch.int32)}), rf"{Q0}: lora_A has dtype I32"),
    (lambda t: t[KEY_A].__setitem__((1, 2), float("nan")), rf"{Q0}: lora_A contains NaN or inf"),
    (lambda t: t[KEY_B].__setitem__((3, 0), float("inf")), rf"{Q0}: lora_B contains NaN or inf"),
    (lambda t: t.update({f"{PFX}model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(4, 256),
                         f"{PFX}model.layers.0.self_attn.k_proj.lora_B.weight": torch.zeros(128, 4)}),
     r"model\.layers\.0\.self_attn\.k_proj has LoRA tensors but is not targeted"),
    (lambda t: t.update({f"{PFX}lm_head.lora_A.weight": torch.zeros(4, 256),
                         f"{PFX}lm_head.lora_B.weight": torch.zeros(128, 4)}),
     r"module lm_head is not a LoRA-capable module of the base"),
    (lambda t: t.update({f"{PFX}model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, 256),
                         f"{PFX}model.layers.7.self_attn.q_proj.lora_B.weight": torch.zeros(256, 4)}),
     r"module model\.layers\.7\.self_attn\.q_proj is not a LoRA-capable"),
]


@pytest.mark.parametrize("edit,pattern", TENSOR_REFUSALS, ids=[str(i) for i in range(len(TENSOR_REFUSALS))])
def test_tensor_refusals(tmp, small, edit, pattern):
    p = copy_with(small, tmp / f"tensors-{abs(hash(pattern))}", tensors_edit=edit)
    with pytest.raises(AdapterError, match=rf"adapter 'ts'.*{pattern}"):
        load_adapter("ts", str(p), SHAPES, max_rank=8)


def test_rank_pattern_mismatch_refused(tmp, small):
    p = copy_with(small, tmp / "rp-mismatch", cfg_edit=lambda c: c.update(rank_pattern={"v_proj": 2}))
    with pytest.raises(AdapterError, match=r"'rp'.*model\.layers\.0\.self_attn\.v_proj: lora_A shape \[4, 256\] / "
                                           r"lora_B shape \[128, 4\] != expected \[2, 256\] / \[128, 2\]"):
        load_adapter("rp", str(p), SHAPES, max_rank=8)


def test_rank_over_limit(tmp, small):
    def edit(t):
        for k in list(t):
            t.pop(k)
        t[KEY_A] = torch.randn(128, 256)
        t[KEY_B] = torch.randn(256, 128)
    p = copy_with(small, tmp / "r128", cfg_edit=lambda c: c.update(r=128, lora_alpha=128), tensors_edit=edit)
    with pytest.raises(AdapterError, match=r"^adapter 'x': module model\.layers\.0\.self_attn\.q_proj has rank 128 "
                                           r"> max_lora_rank 64$"):
        load_adapter("x", str(p), SHAPES, max_rank=64)
    assert load_adapter("x", str(p), SHAPES, max_rank=128).rank == 128
    # a rank_pattern may raise one module over the limit
    p = copy_with(small, tmp / "rp-over", cfg_edit=lambda c: c.update(rank_pattern={"layers.1.self_attn.q_proj": 16}),
                  tensors_edit=lambda t: t.update({
                      f"{PFX}model.layers.1.self_attn.q_proj.lora_A.weight": torch.randn(16, 256),
                      f"{PFX}model.layers.1.self_attn.q_proj.lora_B.weight": torch.randn(256, 16)}))
    with pytest.raises(AdapterError, match=r"model\.layers\.1\.self_attn\.q_proj has rank 16 > max_lora_rank 8"):
        load_adapter("rp", str(p), SHAPES, max_rank=8)


def test_scale_overflow_refused(tmp, small):
    p = copy_with(small, tmp / "overflow", cfg_edit=lambda c: c.update(lora_alpha=1e300))
    with pytest.raises(AdapterError, match=r"'ov'.*lora_alpha must be a finite number \(\|alpha\| <= 1e\+06\)"):
        load_adapter("ov", str(p), SHAPES, max_rank=8)
    # within the alpha limit, a huge (finite) lora_B value still overflows once scaled
    p = copy_with(small, tmp / "overflow-b", cfg_edit=lambda c: c.update(lora_alpha=1e6),
                  tensors_edit=lambda t: t[KEY_B].__setitem__((0, 0), 3e38))
    with pytest.raises(AdapterError, match=r"'ov'.*lora_B \* scale .* overflows"):
        load_adapter("ov", str(p), SHAPES, max_rank=8)


def test_matches_no_module(tmp, small):
    def wrong_prefix(t):
        for k in list(t):
            t[k.replace("model.layers.", "transformer.h.")] = t.pop(k)
    p = copy_with(small, tmp / "noprefix-match", tensors_edit=wrong_prefix)
    with pytest.raises(AdapterError, match=r"'wp'.*matches no module of the base model"):
        load_adapter("wp", str(p), SHAPES, max_rank=8)

    def empty(t):
        t.clear()
        t["__dummy__.lora_A.weight"] = torch.zeros(1, 1)  # save_file refuses an empty dict on some versions
    p = copy_with(small, tmp / "nothing", tensors_edit=empty)
    with pytest.raises(AdapterError, match=r"'wp'.*matches no module of the base model"):
        load_adapter("wp", str(p), SHAPES, max_rank=8)


def test_corrupt_safetensors(tmp, small):
    p = copy_with(small, tmp / "corrupt")
    data = (p / "adapter_model.safetensors").read_bytes()
    (p / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match=r"'cr'.*cannot read adapter_model\.safetensors"):
        load_adapter("cr", str(p), SHAPES, max_rank=8)


def test_header_checked_before_any_data_read(tmp, small, monkeypatch):
    """A wrong (here: large) declared shape is refused from the header alone: no tensor data is read."""
    real_open, reads = adapter_mod.safe_open, []

    class Spy:  # wraps safetensors.safe_open and records which tensors' DATA are read
        def __init__(self, *a, **kw):
            self._ctx = real_open(*a, **kw)

        def __enter__(self):
            self._f = self._ctx.__enter__()
            return self

        def __exit__(self, *exc):
            return self._ctx.__exit__(*exc)

        def keys(self):
            return self._f.keys()

        def get_slice(self, k):
            return self._f.get_slice(k)

        def get_tensor(self, k):
            reads.append(k)
            return self._f.get_tensor(k)

    big = f"{PFX}model.layers.1.self_attn.v_proj.lora_B.weight"
    p = copy_with(small, tmp / "hugeshape", tensors_edit=lambda t: t.update({big: torch.zeros(128, 1 << 16)}))
    monkeypatch.setattr(adapter_mod, "safe_open", Spy)
    with pytest.raises(AdapterError, match=r"v_proj: lora_A shape \[4, 256\] / lora_B shape \[128, 65536\]"):
        load_adapter("huge", str(p), SHAPES, max_rank=8)
    assert reads == []
    # the spy does see the data reads of a good adapter
    assert len(load_adapter("ok", str(small), SHAPES, max_rank=8).modules) == 4 and len(reads) == 8


def test_nothing_returned_on_late_failure(tmp, small):
    """The last module (sorted) is broken: the whole load fails rather than returning a partial adapter."""
    last = f"{PFX}model.layers.1.self_attn.v_proj.lora_B.weight"
    p = copy_with(small, tmp / "late", tensors_edit=lambda t: t[last].__setitem__((0, 0), float("nan")))
    with pytest.raises(AdapterError, match=r"model\.layers\.1\.self_attn\.v_proj: lora_B contains NaN"):
        load_adapter("late", str(p), SHAPES, max_rank=8)


# ------------------------------------------------------------------------------------------------
# hostile files (issue 22): bounded parsing, linear-time regexes, confinement, checksum-first re-reads

HOSTILE_CONFIGS = [
    (lambda c: "[" * 100_000 + "]" * 100_000, r"nests more than 32 levels"),
    (lambda c: json.dumps(c)[:-1] + ', "x": ' + "[" * 40 + "]" * 40 + "}", r"nests more than 32 levels"),
    (lambda c: json.dumps(c).replace('"lora_alpha": 8', '"lora_alpha": ' + "7" * 400), r"a number of 400 characters"),
    (lambda c: json.dumps(c).replace('"r": 4', '"r": ' + "7" * 5000), r"a number of 5000 characters"),
    (lambda c: json.dumps({**c, "r": 1 << 40}), r"r must be a positive integer \(at most 65536\)"),
    (lambda c: json.dumps({**c, "alpha_pattern": {"q_proj": 1e300}}), r"alpha_pattern\['q_proj'\] must be a finite"),
    (lambda c: json.dumps({**c, "layers_to_transform": [-1]}), r"layers_to_transform must be"),
    (lambda c: json.dumps({**c, "target_modules": "(" * 5000 + "q_proj" + ")" * 5000}), r"10006 characters"),
    (lambda c: json.dumps({**c, "target_modules": r"(q)\1_proj"}), r"not a valid regex.*RE2"),
    (lambda c: json.dumps({**c, "rank_pattern": {f"k{i}": 4 for i in range(1025)}}), r"1025 keys; at most 1024"),
    (lambda c: json.dumps({**c, "exclude_modules": [str(i) for i in range(4097)]}), r"4097 names"),
    (lambda c: json.dumps({**c, "rank_pattern": {f"[a-z]{{1000}}{i}": 4 for i in range(600)}}),
     r"compile to more than"),
]


@pytest.mark.parametrize("make,pattern", HOSTILE_CONFIGS, ids=[f"hostile{i}" for i in range(len(HOSTILE_CONFIGS))])
def test_hostile_configs_are_the_adapters_own_error(tmp_path, small, make, pattern):
    p = copy_with(small, tmp_path / "hostile")
    (p / "adapter_config.json").write_text(make(json.loads((p / "adapter_config.json").read_text())))
    with pytest.raises(AdapterError, match=rf"adapter 'h'.*{pattern}") as ei:
        load_adapter("h", str(p), SHAPES, max_rank=8)
    assert type(ei.value).__name__ not in str(ei.value) and "Error" not in str(ei.value)


@pytest.mark.timeout(60)
def test_catastrophic_regexes_match_in_linear_time(tmp, small):
    """Python's re never returns from (.*.*)*X against a module name; RE2 matches it in microseconds."""
    p = copy_with(small, tmp / "redos", cfg_edit=lambda c: c.update(
        target_modules=r"(.*.*)*X|.*\.(q|v)_proj", exclude_modules=r"(.*.*)*Y", rank_pattern={"(.*.*)*X": 2},
        alpha_pattern={r".{6}(.*)*X|.*v_proj": 16}))
    ad = load_adapter("redos", str(p), SHAPES, max_rank=8)
    ref = load_adapter("ref", str(small), SHAPES, max_rank=8)
    assert sorted(ad.modules) == sorted(ref.modules) and ad.rank == 4
    v0 = "model.layers.0.self_attn.v_proj"  # alpha 16 instead of 8 through the alpha_pattern regex
    torch.testing.assert_close(ad.modules[v0].b, ref.modules[v0].b * 2)
    torch.testing.assert_close(ad.modules[Q0].b, ref.modules[Q0].b)


def test_confined_to_the_roots_on_the_opened_files(tmp, small):
    root, outside = tmp / "root22", tmp / "outside22"
    root.mkdir()
    copy_with(small, outside / "evil")
    copy_with(small, root / "ok")
    os.symlink(outside / "evil", root / "escape")
    os.symlink(root / "ok", root / "inner")
    linked = copy_with(small, root / "linkedfile")
    (linked / "adapter_model.safetensors").unlink()
    os.symlink(outside / "evil" / "adapter_model.safetensors", linked / "adapter_model.safetensors")
    roots = [str(root)]
    assert load_adapter("a", str(root / "inner"), SHAPES, 8, roots).path == str((root / "ok").resolve())
    with pytest.raises(adapter_mod.AdapterPathForbiddenError, match="outside every --lora-root"):
        load_adapter("a", str(root / "escape"), SHAPES, 8, roots)
    with pytest.raises(adapter_mod.AdapterPathForbiddenError, match=r"adapter_model\.safetensors is a link to outside"):
        load_adapter("a", str(linked), SHAPES, 8, roots)
    assert load_adapter("a", str(root / "escape"), SHAPES, 8).path == str((outside / "evil").resolve())  # no roots
    fifo = copy_with(small, root / "fifo")
    (fifo / "adapter_config.json").unlink()
    os.mkfifo(fifo / "adapter_config.json")  # opening it blocking would hang the load forever
    with pytest.raises(AdapterError, match=r"adapter_config\.json in .* is not a regular file"):
        load_adapter("a", str(fifo), SHAPES, 8, roots)


def test_reread_compares_the_checksum_before_parsing(tmp, small):
    p = copy_with(small, tmp / "reread")
    ad = load_adapter("rr", str(p), SHAPES, 8)
    good = (p / "adapter_config.json").read_bytes()
    again = load_adapter("rr", str(p), SHAPES, 8, expect=ad.fingerprint)
    assert again.checksum == ad.checksum and sorted(again.modules) == sorted(ad.modules)
    (p / "adapter_config.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(AdapterError, match=r"'rr'.*changed on disk since the load") as ei:
        load_adapter("rr", str(p), SHAPES, 8, expect=ad.fingerprint)
    assert "nests" not in str(ei.value)  # refused on the checksum: never parsed
    (p / "adapter_config.json").write_bytes(good)
    with open(p / "adapter_model.safetensors", "r+b") as f:
        f.truncate(8 << 30)  # a huge sparse file: refused on its size, unread
    with pytest.raises(AdapterError, match=r"'rr'.*is now 8589934592 bytes"):
        load_adapter("rr", str(p), SHAPES, 8, expect=ad.fingerprint)
