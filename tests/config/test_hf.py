"""HF config.json adapters: every public config maps to a valid ModelSpec, every key is mapped or ignored, and bad
or unknown fields fail with one line naming them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from moestack.config import ConfigError, ModelSpec, load_model_spec
from moestack.config.base import dump_yaml
from moestack.config.hf import hf_config_to_spec, is_hf_config, load_hf_config, quantized_categories

DATA = Path(__file__).parent.parent / "data" / "hf_configs"
CONFIGS = sorted(p.name for p in DATA.glob("*.json"))


def _cfg(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_all_families_have_a_public_config():
    families = {load_hf_config(DATA / n).model_type for n in CONFIGS}
    assert families == {
        "kimi_k3", "kimi_linear", "deepseek_v3", "kimi_k2", "deepseek_v32", "qwen3_moe", "qwen3_next", "mixtral",
        "nemotron_h",
    }


@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip_and_every_key_accounted_for(tmp_path, name):
    imp = load_hf_config(DATA / name)
    spec = imp.spec
    # round-trip: plain data -> validation -> same spec; YAML file -> load_model_spec -> same spec
    assert ModelSpec.model_validate(spec.model_dump()) == spec
    path = tmp_path / "spec.yaml"
    dump_yaml(spec, path)
    assert load_model_spec(path) == spec
    # every top-level key is mapped or ignored, none both, ignored ones listed once
    top = lambda names: {n.split(".")[0] for n in names}  # noqa: E731
    cfg = _cfg(name)
    assert top(imp.mapped) | top(imp.ignored) == set(cfg)
    assert not set(imp.mapped) & set(imp.ignored)
    assert len(imp.ignored) == len(set(imp.ignored))
    assert spec.family == imp.model_type


def test_kimi_k3_matches_the_preset():
    imp = load_hf_config(DATA / "kimi-k3.config.json")
    preset = load_model_spec("kimi-k3")
    skip = {"name", "family"}
    got = {k: v for k, v in imp.spec.model_dump().items() if k not in skip}
    want = {k: v for k, v in preset.model_dump().items() if k not in skip}
    assert got == want
    assert imp.spec.attn_res_block_size == 12 and "text_config.attn_res_block_size" in imp.mapped
    assert imp.spec.build_support_errors() == []  # Attention Residuals are built; the quantization block is a note
    # the multimodal wrapper: text_config keys are mapped under their dotted names, the vision tower is counted
    assert "text_config.routed_expert_hidden_size" in imp.mapped
    assert "text_config.temperature" in imp.ignored and "media_placeholder_token_id" in imp.ignored
    assert 0.40e9 < imp.extras.vision_params < 0.50e9
    assert quantized_categories(imp.extras.quantization) == {"routed_experts"}


def test_deepseek_v3_mapping():
    spec = load_hf_config(DATA / "deepseek-v3.config.json").spec
    assert spec.dense_layers == [1, 2, 3] and spec.full_attention_layers == list(range(1, 62))
    r = spec.moe.router
    assert (r.score, r.num_groups, r.topk_groups, r.selection_bias) == ("sigmoid", 8, 4, True)
    assert r.scaling_factor == 2.5 and r.renormalize and r.seq_aux_loss_coef == 0.001
    assert spec.moe.shared_intermediate_size == 2048 and spec.mtp_layers == 1
    assert spec.mla.use_rope and not spec.mla.output_gate and spec.mla.indexer is None
    assert spec.mla.rope_scaling.type == "yarn" and spec.mla.rope_scaling.factor == 40
    assert spec.activation == "swiglu" and spec.norm_eps == 1e-6
    assert spec.build_support_errors() == []  # YaRN on MLA is built (moestack/model/rope.py)


def test_deepseek_v32_indexer_and_kimi_k2():
    v32 = load_hf_config(DATA / "deepseek-v3.2-exp.config.json").spec
    ix = v32.mla.indexer
    assert (ix.num_heads, ix.head_dim, ix.top_k) == (64, 128, 2048)
    k2 = load_hf_config(DATA / "kimi-k2-instruct.config.json").spec
    assert k2.mla.num_heads == 64 and k2.moe.num_experts == 384 and k2.dense_layers == [1]
    assert k2.moe.router.num_groups == 1 and k2.moe.router.scaling_factor == 2.827 and k2.mtp_layers == 0


def test_kimi_linear_mapping():
    spec = load_hf_config(DATA / "kimi-linear-48b-a3b-instruct.config.json").spec
    k = spec.kda
    assert (k.num_heads, k.head_dim, k.gate, k.gate_rank, k.output_gate_rank) == (32, 128, "kimi_linear", 128, 128)
    assert spec.full_attention_layers == [4, 8, 12, 16, 20, 24, 27]
    m = spec.mla
    assert m.q_lora_rank is None and not m.use_rope and not m.output_gate
    assert spec.moe.latent_size is None and spec.moe.router.scaling_factor == 2.446
    assert spec.max_seq_len == 1048576 and spec.build_support_errors() == []


def test_qwen_and_mixtral_mapping():
    q3 = load_hf_config(DATA / "qwen3-30b-a3b.config.json").spec
    assert q3.attention == "gqa" and q3.gqa.qk_norm and q3.gqa.num_kv_heads == 4 and q3.gqa_head_dim == 128
    assert q3.moe.router.score == "softmax" and not q3.moe.router.selection_bias and q3.moe.router.renormalize
    assert q3.dense_layers == [] and q3.dense_mlp is None and q3.moe.num_shared_experts == 0
    nxt = load_hf_config(DATA / "qwen3-next-80b-a3b.config.json").spec
    k = nxt.kda
    assert (k.num_heads, k.value_heads, k.decay, k.output_gate_act, k.gate_rank) == (16, 32, "head", "silu", None)
    assert nxt.full_attention_layers == list(range(4, 49, 4))
    assert nxt.gqa.output_gate and nxt.gqa.rope_fraction == 0.25 and nxt.gqa_head_dim == 256
    assert nxt.moe.shared_expert_gate and nxt.moe.shared_intermediate_size == 512
    assert nxt.build_support_errors() == ["not supported: moe.shared_expert_gate"]
    mx = load_hf_config(DATA / "mixtral-8x7b-v0.1.config.json").spec
    assert (mx.moe.num_experts, mx.moe.top_k, mx.moe.expert_intermediate_size) == (8, 2, 14336)
    assert mx.moe.router.renormalize and mx.gqa.rope_theta == 1e6 and mx.build_support_errors() == []


def test_nemotron_h_is_profile_only():
    spec = load_hf_config(DATA / "nemotron-3-super-120b-a12b.config.json").spec
    kinds = spec.layer_kinds()
    assert sum(k.mixer == "mamba2" for k in kinds) == 40 and sum(k.mixer == "gqa" for k in kinds) == 8
    assert sum(k.ffn == "moe" for k in kinds) == 40 and all((k.mixer == "none") == (k.ffn != "none") for k in kinds)
    assert spec.moe.latent_size == 1024 and not spec.moe.latent_norm and spec.activation == "relu2"
    assert not spec.gqa.use_rope and spec.mtp_pattern == "*E"
    with pytest.raises(ConfigError, match="not supported: mamba layers") as info:
        spec.check_buildable()
    assert "\n" not in str(info.value)


def test_nemotron_3_nano_loads_as_published():
    """The Nano config publishes expand 2 with mamba_num_heads * mamba_head_dim = 4096 != 2 * 2688: the modeling
    code sizes the mixer by the heads and never reads expand, so expand is ignored (not an error); its
    time_step_limit [0.0, Infinity] clamps nothing. Sizes: Nemotron 3 Nano report, 31.6B total, 3.2B active
    (3.6B with the embeddings)."""
    from moestack.planner.profile import profile_model

    imp = load_hf_config(DATA / "nemotron-3-nano-30b-a3b.config.json")
    assert "expand" in imp.ignored and "time_step_limit" in imp.ignored and "mamba_num_heads" in imp.mapped
    spec = imp.spec
    assert (spec.mamba2.num_heads, spec.mamba2.head_dim, spec.hidden_size) == (64, 64, 2688)
    kinds = spec.layer_kinds()
    assert [sum(k.mixer == m for k in kinds) for m in ("mamba2", "gqa")] == [23, 6]
    assert sum(k.ffn == "moe" for k in kinds) == 23 and spec.moe.latent_size is None and spec.mtp_layers == 0
    p = profile_model(spec, 4096)
    assert p.total_params == 31_577_937_344 and round(p.total_params / 1e8) == 316
    assert round(p.activated_params / 1e8) == 32 and round((p.activated_params + p.embedding_params) / 1e8) == 36


def test_nemotron_time_step_limit():
    """The hub's Nemotron 3 Super BF16 config carries time_step_limit [0.0, Infinity] (the transcription here,
    from the NVFP4 release, lacks it): accepted and ignored; a finite clamp changes every SSM step: rejected."""
    cfg = _cfg("nemotron-3-super-120b-a12b.config.json")
    cfg["time_step_limit"] = json.loads("[0.0, Infinity]")
    imp = hf_config_to_spec(cfg)
    assert "time_step_limit" in imp.ignored
    assert imp.spec == load_hf_config(DATA / "nemotron-3-super-120b-a12b.config.json").spec.model_copy(
        update={"name": imp.spec.name})
    cfg["time_step_limit"] = [0.0, 10.0]
    with pytest.raises(ConfigError, match=r"time_step_limit: a finite dt clamp is not modelled.*\[0.0, 10.0\]"):
        hf_config_to_spec(cfg)


def test_qwen3_next_activated_count_convention():
    """moestack's activated count: every parameter one token's forward multiplies through, except the input
    embedding (a lookup): Qwen3-Next's 36 Gated DeltaNet + 12 gated-attention layers (10 routed experts, the shared
    expert and its gate, the attention output gate inside q_proj) = 3.253B, plus the final norm and the LM head
    0.311B = 3.564B. The
    config has no MTP layer. The model card's "3B activated" is the decoder layers alone (no embedding, no head),
    3.25B rounded; Qwen3-30B-A3B's "3.3B" instead counts embedding and head (tested in test_profile.py)."""
    from moestack.planner.profile import profile_model

    spec = load_hf_config(DATA / "qwen3-next-80b-a3b.config.json").spec
    p = profile_model(spec, 4096)
    assert spec.mtp_layers == 0 and p.mtp_params == 0
    decoder = sum(lp.activated_params for lp in p.layers)
    assert decoder + p.final_norm_params + p.head_params == p.activated_params == 3_563_764_480
    assert p.head_params == p.embedding_params == 151936 * 2048
    assert round(decoder / 1e9) == 3 and abs(decoder - 3.2527e9) < 1e6


def test_architectures_fallback_and_directory(tmp_path):
    cfg = _cfg("mixtral-8x7b-v0.1.config.json")
    del cfg["model_type"]
    assert hf_config_to_spec(cfg).model_type == "mixtral"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(_cfg("qwen3-30b-a3b.config.json")))
    imp = load_hf_config(tmp_path / "m")
    assert imp.spec.name == "m" and imp.model_type == "qwen3_moe"
    assert is_hf_config(tmp_path / "m" / "config.json") and not is_hf_config(DATA / "README.md")


def _edit(name, fn):
    cfg = copy.deepcopy(_cfg(name))
    fn(cfg)
    return cfg


BAD = [
    ("unknown field", "deepseek-v3.config.json", lambda c: c.__setitem__("use_magic", 1), ["use_magic", "unknown"]),
    ("nested unknown", "kimi-k3.config.json", lambda c: c["text_config"]["linear_attn_config"].__setitem__("x", 1),
     ["text_config.linear_attn_config.x"]),
    ("mla bias", "deepseek-v3.config.json", lambda c: c.__setitem__("attention_bias", True), ["attention_bias"]),
    ("sliding window", "qwen3-30b-a3b.config.json", lambda c: c.__setitem__("use_sliding_window", True),
     ["use_sliding_window", "True"]),
    ("activation", "mixtral-8x7b-v0.1.config.json", lambda c: c.__setitem__("hidden_act", "gelu"),
     ["hidden_act", "'gelu'"]),
    ("scoring", "kimi-k2-instruct.config.json", lambda c: c.__setitem__("scoring_func", "sparsemax"),
     ["scoring_func", "sparsemax"]),
    ("dropout", "mixtral-8x7b-v0.1.config.json", lambda c: c.__setitem__("attention_dropout", 0.1),
     ["attention_dropout", "0.1"]),
    ("layer overlap", "kimi-linear-48b-a3b-instruct.config.json",
     lambda c: c["linear_attn_config"]["kda_layers"].append(4), ["kda_layers"]),
    ("missing", "qwen3-next-80b-a3b.config.json", lambda c: c.pop("linear_num_value_heads"),
     ["linear_num_value_heads", "missing"]),
    ("model type", "mixtral-8x7b-v0.1.config.json",
     lambda c: (c.__setitem__("model_type", "llama"), c.__setitem__("architectures", ["LlamaForCausalLM"])),
     ["'llama'", "supported"]),
    ("spec check", "deepseek-v3.config.json", lambda c: c.__setitem__("num_experts_per_tok", 512),
     ["top_k (512)", "deepseek_v3 adapter"]),
    ("rope type", "kimi-k2-instruct.config.json", lambda c: c["rope_scaling"].__setitem__("type", "ntk"),
     ["rope_scaling"]),
]


@pytest.mark.parametrize("label,name,edit,needles", BAD, ids=[b[0] for b in BAD])
def test_bad_configs_fail_with_one_line(label, name, edit, needles):
    with pytest.raises(ConfigError) as info:
        hf_config_to_spec(_edit(name, edit), source=name)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(name), msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_ignored_fields_change_nothing():
    """Flipping every ignored key (token ids, dtype, generation settings) leaves the spec unchanged."""
    name = "kimi-k3.config.json"
    base = load_hf_config(DATA / name)
    cfg = _cfg(name)
    for dotted in base.ignored:
        if dotted.startswith("vision_config"):
            continue
        node = cfg
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = "changed" if isinstance(node[leaf], str) else 12345
    assert hf_config_to_spec(cfg, name=base.spec.name).spec == base.spec


def test_readme_names_every_config():
    readme = (DATA / "README.md").read_text()
    for name in CONFIGS:
        assert name in readme, name
