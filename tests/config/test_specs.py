"""Presets load; bad YAML fails with one line naming the field and the value."""

from __future__ import annotations

import pytest
import yaml

from moestack.config import ConfigError, list_presets, load_model_spec, load_train_spec
from moestack.config.model_spec import PRESET_DIR


def test_presets_load():
    names = list_presets()
    assert {"tiny", "proxy", "kimi-k3", "kimi-k3.1-pro"} <= set(names)
    k3 = load_model_spec("kimi-k3")
    kinds = k3.layer_kinds()
    assert sum(k.mixer == "kda" for k in kinds) == 69 and sum(k.mixer == "mla" for k in kinds) == 24
    assert kinds[0].ffn == "dense" and all(k.ffn == "moe" for k in kinds[1:])
    assert k3.mla.indexer is None and load_model_spec("kimi-k3.1-pro").mla.indexer.top_k == 2048


def _write_variant(tmp_path, edit):
    data = yaml.safe_load((PRESET_DIR / "tiny.yaml").read_text())
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


BAD_CASES = [
    ("wrong type", lambda d: d["kda"].__setitem__("num_heads", "four"), ["kda.num_heads", "'four'"]),
    ("unknown key", lambda d: d.__setitem__("hidden_sise", 128), ["hidden_sise", "unknown key"]),
    ("nested unknown key", lambda d: d["moe"]["router"].__setitem__("topk", 3), ["moe.router.topk"]),
    ("top_k > experts", lambda d: d["moe"].__setitem__("top_k", 32), ["moe", "top_k (32)", "num_experts (16)"]),
    ("groups do not divide", lambda d: d["moe"]["router"].__setitem__("num_groups", 3), ["num_groups (3)"]),
    ("layer out of range", lambda d: d.__setitem__("full_attention_layers", [4, 9]), ["full_attention_layers", "[9]"]),
    ("missing section", lambda d: d.pop("mla"), ["mixer 'mla'", "missing"]),
    ("negative size", lambda d: d.__setitem__("hidden_size", -1), ["hidden_size", "-1"]),
    ("head dim too big", lambda d: d["kda"].__setitem__("head_dim", 512), ["kda.head_dim", "512"]),
    ("chunk not pow2", lambda d: d["kda"].__setitem__("chunk_size", 48), ["chunk_size", "48"]),
    ("latent wider than hidden", lambda d: d["moe"].__setitem__("latent_size", 1024), ["latent_size (1024)"]),
    ("missing field", lambda d: d.pop("vocab_size"), ["vocab_size", "Field required"]),
]


@pytest.mark.parametrize("label,edit,needles", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_model_yaml_one_line(tmp_path, label, edit, needles):
    path = _write_variant(tmp_path, edit)
    with pytest.raises(ConfigError) as info:
        load_model_spec(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert str(path) in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_gqa_heads_mismatch(tmp_path):
    def edit(d):
        d["attention"] = "gqa"
        d["gqa"] = {"num_heads": 6, "num_kv_heads": 4}

    with pytest.raises(ConfigError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        load_model_spec(_write_variant(tmp_path, edit))

    def edit2(d):
        d["attention"] = "gqa"
        d["gqa"] = {"num_heads": 3, "num_kv_heads": 1}

    with pytest.raises(ConfigError, match="set gqa.head_dim"):
        load_model_spec(_write_variant(tmp_path, edit2))


def test_not_yaml_and_unknown_preset(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_model_spec(p)
    with pytest.raises(ConfigError, match="neither a preset"):
        load_model_spec("no-such-model")


def test_train_spec_overrides_and_errors(tmp_path):
    spec = load_train_spec(None, {"optimizer.lr": 1e-4, "steps": 5})
    assert spec.optimizer.lr == 1e-4 and spec.steps == 5
    with pytest.raises(ConfigError, match=r"optimizer.lr: .*greater than 0.*\(got -1\)"):
        load_train_spec(None, {"optimizer.lr": -1})
    with pytest.raises(ConfigError, match="data.paths is empty"):
        load_train_spec(None, {"data.source": "text"})
    p = tmp_path / "t.yaml"
    p.write_text("steps: 10\nmicro_batch: 4\n")
    with pytest.raises(ConfigError, match="micro_batch: unknown key"):
        load_train_spec(p)
