"""Exact profile: published parameter counts, the built model's own parameter count, Megatron-LM's FLOP formula
(and a published TFLOP/s figure), the KDA / DSA terms, and the `moestack profile` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moestack.cli.profile import profile
from moestack.config import ConfigError, ModelSpec, load_model_spec
from moestack.config.base import dump_yaml
from moestack.model.transformer import build_model
from moestack.planner.profile import _causal_keys, load_any_model, load_any_model_spec, profile_model

HF = Path(__file__).parent.parent / "data" / "hf_configs"


def _prof(model: str, seq_len: int = 4096):
    spec, extras = load_any_model(model if not model.endswith(".json") else HF / model)
    return spec, profile_model(spec, seq_len, extras)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# ------------------------------------------------------------------------------------------ published counts


def test_kimi_k3_published_size():
    # arXiv:2607.24653 Table 1: 2.78T total / 104.2B activated; MODEL.md counts 2,779.48B / 104.19B from the config
    for model in ("kimi-k3", "kimi-k3.config.json"):
        _, p = _prof(model)
        assert _rel(p.total_params, 2779.5e9) < 0.005 and _rel(p.total_params, 2779.48e9) < 1e-4
        assert _rel(p.activated_params, 104.2e9) < 0.005 and _rel(p.activated_params, 104.19e9) < 1e-4
    # KDA mixer (MODEL.md: 443.7M per K3 KDA layer) + dense MLP + 2 norms + 2 Attention-Residual mixes (2 x 2d)
    first = _prof("kimi-k3")[1].layers[0]
    assert first.mixer == "kda" and first.params - 3 * 7168 * 33792 - 2 * 7168 - 4 * 7168 == 443_740_384


def test_kimi_k3_attention_residuals_in_the_count():
    """K3's Attention Residuals: two mixes per layer (norm weight [d] + proj [1, d] each) and the output mix, 2.68M
    parameters, all activated. The published 2.78T / 104.2B round both counts alike (README, "Adaptation and
    planning"): 2,779.484B / 104.190B with them, 2,779.482B / 104.187B without."""
    spec = load_model_spec("kimi-k3")
    with_ar, without = profile_model(spec, 4096), profile_model(spec.model_copy(update={"attn_res_block_size": None}),
                                                                 4096)
    d = spec.hidden_size
    assert with_ar.total_params - without.total_params == 93 * 4 * d + 2 * d == 2_680_832
    assert with_ar.activated_params - without.activated_params == 2_680_832
    assert with_ar.total_params == 2_779_484_393_568 and with_ar.activated_params == 104_189_530_208
    for p in (with_ar, without):
        assert round(p.total_params / 1e10) == 278 and round(p.activated_params / 1e8) == 1042
    # 8 blocks of 12 layers (the last partial) + the embedding: the output mix reads 9 sources
    assert spec.attn_res_blocks_before(93) + 1 == 9
    mixes = sum(sum(spec.attn_res_sources(i)) for i in range(93)) + 9
    assert with_ar.fwd_flops_per_token - without.fwd_flops_per_token == pytest.approx(4 * d * mixes, rel=1e-12)


def test_deepseek_v3_published_size():
    # README_WEIGHTS.md: main model 671B; 36.6B activated incl. the 0.9B output head (the "37B" headline is this
    # figure rounded); the MTP module adds 11.5B unique parameters beyond the shared embedding and head
    _, p = _prof("deepseek-v3.config.json")
    assert _rel(p.total_params, 671e9) < 0.005
    assert _rel(p.activated_params, 36.6e9) < 0.005 and round(p.activated_params / 1e9) == 37
    assert 11.5e9 < p.mtp_params < 11.7e9  # 11.5B transformer layer + eh_proj 0.1B + norms
    # the "685B" HF checkpoint stores the MTP module with its own copies of the embedding and the head (plus
    # ~0.04B of fp8 block scales): 684.5B of weights
    assert _rel(p.total_params + p.mtp_params + p.embedding_params + p.head_params, 685e9) < 0.005


def test_kimi_k2_and_kimi_linear_published_size():
    # Kimi K2: ~1.03T total, "32B activated": the exact count is 31.69B (excluding the input embedding, as
    # everywhere here); the headline rounds it (with the embedding it would be 32.86B)
    _, k2 = _prof("kimi-k2-instruct.config.json")
    assert _rel(k2.total_params, 1.03e12) < 0.005
    assert round(k2.activated_params / 1e9) == 32 and _rel(k2.activated_params, 31.69e9) < 1e-3
    _, kl = _prof("kimi-linear-48b-a3b-instruct.config.json")
    assert _rel(kl.total_params, 49.1e9) < 0.005 and round(kl.activated_params / 1e9) == 3


def test_exact_counts_of_other_families():
    # Nemotron 3 Super safetensors header: BF16 weights 123,611,012,096 including the MTP module 2,942,324,736
    spec, p = _prof("nemotron-3-super-120b-a12b.config.json")
    assert p.total_params == 123_611_012_096 - 2_942_324_736 and p.mtp_params == 2_942_324_736
    _, q = _prof("qwen3-next-80b-a3b.config.json")
    assert q.total_params == 79_674_391_296
    # Mistral and Qwen publish "active" counts that include the input embedding
    _, mx = _prof("mixtral-8x7b-v0.1.config.json")
    assert _rel(mx.total_params, 46.7e9) < 0.005 and _rel(mx.activated_params + mx.embedding_params, 12.9e9) < 0.005
    _, q3 = _prof("qwen3-30b-a3b.config.json")
    assert _rel(q3.total_params, 30.5e9) < 0.005 and _rel(q3.activated_params + q3.embedding_params, 3.3e9) < 0.02


# ------------------------------------------------------------------------------------------ vs the built model


def _buildable(spec: ModelSpec) -> ModelSpec:
    """Drop the features the builder lacks but that do not change parameter shapes (rope scaling)."""
    upd = {}
    if spec.mla is not None and spec.mla.rope_scaling is not None:
        upd["mla"] = spec.mla.model_copy(update={"rope_scaling": None})
    return spec.model_copy(update=upd)


BUILD_CASES = ["tiny", "proxy", "kimi-k3", "kimi-k3.1-pro", "deepseek-v3.2-exp.config.json",
               "kimi-linear-48b-a3b-instruct.config.json", "qwen3-30b-a3b.config.json", "mixtral-8x7b-v0.1.config.json"]


@pytest.mark.parametrize("model", BUILD_CASES)
def test_params_match_the_built_model(model):
    spec, _ = load_any_model(model if not model.endswith(".json") else HF / model)
    spec = _buildable(spec)
    spec.check_buildable()
    net = build_model(spec, "meta")
    prof = profile_model(spec, 1024)
    assert sum(t.numel() for t in net.parameters()) == prof.total_params
    for lp, block in zip(prof.layers, net.layers.values(), strict=True):
        assert sum(t.numel() for t in block.parameters()) == lp.params, lp.index
        # activated = all but the (E - top_k) routed experts a token skips
        skipped = 0
        if lp.ffn == "moe":
            e = block.ffn.experts
            per_expert = (e.w_gate_up.numel() + e.w_down.numel()) // spec.moe.num_experts
            skipped = (spec.moe.num_experts - spec.moe.top_k) * per_expert
        assert lp.activated_params == lp.params - skipped, lp.index
    head = net.lm_head.weight.numel()
    final = sum(t.numel() for m in (net.norm, net.out_res) if m is not None for t in m.parameters())
    assert prof.final_norm_params == final  # with Attention Residuals: the final norm and the output mix
    assert prof.activated_params == sum(lp.activated_params for lp in prof.layers) + head + final
    assert (net.out_res is not None) == (spec.attn_res_block_size is not None)


def test_gqa_biases_match_the_built_model():
    """q / k / v biases with qk_norm and the output gate: the gate and o_proj take none."""
    gqa = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "qkv_bias": True, "qk_norm": True, "output_gate": True}
    spec = ModelSpec.model_validate(dict(name="g", vocab_size=64, hidden_size=32, num_layers=2, max_seq_len=64,
                                         full_attention_layers=[1, 2], attention="gqa", gqa=gqa,
                                         dense_mlp={"intermediate_size": 48}))
    net = build_model(spec, "meta")
    assert sum(t.numel() for t in net.parameters()) == profile_model(spec, 64).total_params


def test_profile_only_biases():
    """Specs the builder refuses: Mamba-2 proj_bias adds in_proj and out_proj biases; linear_bias adds none to KDA
    or MLA (they take no biases), only to the MLP and expert layers."""
    nano, _ = load_any_model(HF / "nemotron-3-nano-30b-a3b.config.json")
    m = nano.mamba2
    biased = nano.model_copy(update={"mamba2": m.model_copy(update={"proj_bias": True})})
    a, b = profile_model(nano, 64).layers[0], profile_model(biased, 64).layers[0]
    assert a.mixer == "mamba2" and b.params - a.params == 2 * m.inner_size + 2 * m.num_groups * m.state_size + (
        m.num_heads + nano.hidden_size)
    k3 = load_model_spec("tiny")
    a, b = profile_model(k3, 64), profile_model(k3.model_copy(update={"linear_bias": True}), 64)
    assert [lp.mixer for lp in a.layers] == ["kda", "kda", "kda", "mla"]
    d, moe, inter = k3.hidden_size, k3.moe, k3.dense_mlp.intermediate_size
    assert b.layers[0].params - a.layers[0].params == 2 * inter + d  # gate / up and down biases
    expert = 2 * moe.expert_intermediate_size + moe.latent_size
    shared = 2 * moe.shared_intermediate_size + d
    assert b.layers[3].params - a.layers[3].params == moe.num_experts * expert + shared


# ------------------------------------------------------------------------------------------ FLOPs vs Megatron


def megatron_train_flops_per_token(spec: ModelSpec, seq_len: int, mtp_layers: int = 0) -> float:
    """Megatron-LM `num_floating_point_operations` (transformer path) / (batch * seq) for MLA or GQA + MoE, written
    out term by term: 3 (fwd, dgrad, wgrad) * 2 (FMA) * per-token MACs."""
    d, V, S = spec.hidden_size, spec.vocab_size, seq_len
    kinds = spec.layer_kinds()
    n_dense = sum(k.ffn == "dense" for k in kinds)
    n_moe = sum(k.ffn == "moe" for k in kinds)
    last_moe = int(kinds[-1].ffn == "moe")
    n_moe += last_moe * mtp_layers
    n_dense += (1 - last_moe) * mtp_layers
    n_layers = len(kinds) + mtp_layers
    if spec.attention == "mla":
        m = spec.mla
        H, N, R, C, Vd = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
        q = d * H * (N + R) if m.q_lora_rank is None else m.q_lora_rank * (d + H * (N + R) + 1)
        attn = q + C * (d + H * (N + Vd) + 1) + d * R + H * Vd * d + S * H * (N + R) / 2 + S * H * Vd / 2
    else:
        g = spec.gqa
        E = spec.gqa_head_dim
        qs, kvs = E * g.num_heads, E * g.num_kv_heads
        gate = qs if g.output_gate else 0
        attn = d * (qs + 2 * kvs + gate) + qs * S / 2 * 2 + qs * d
    mlp = 0.0
    if n_dense:
        mlp += spec.dense_mlp.intermediate_size * 3 * n_dense
    if n_moe:
        m = spec.moe
        routed = m.expert_intermediate_size * m.top_k * 3
        if m.latent_size is not None:
            routed = routed * m.latent_size / d + 2 * m.latent_size
        mlp += (routed + m.shared_intermediate_size * 3) * n_moe
    per_token = d * mlp + attn * n_layers + mtp_layers * (3 * d + 2 * d * d) + d * V * (mtp_layers + 1)
    return 6 * per_token


def megatron_hybrid_train_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Megatron-LM's hybrid (Mamba) model formula / (batch * seq), main model only."""
    d, S = spec.hidden_size, seq_len
    kinds = spec.layer_kinds()
    n_attn = sum(k.mixer == "gqa" for k in kinds)
    n_mamba = sum(k.mixer == "mamba2" for k in kinds)
    n_moe = sum(k.ffn == "moe" for k in kinds)
    g, mb, m = spec.gqa, spec.mamba2, spec.moe
    E = spec.gqa_head_dim
    p = E * g.num_heads / d
    attn = 4 * d * p * (d + d * g.num_kv_heads / g.num_heads + S / 2)
    d_in = 2 * d
    mamba = 2 * d * (2 * d_in + 2 * mb.num_groups * mb.state_size + mb.num_heads) + 7 * d_in * mb.state_size
    mamba += 2 * d_in * d
    moe = 4 * m.latent_size * m.expert_intermediate_size * m.top_k + 4 * d * m.latent_size
    moe += 4 * d * m.shared_intermediate_size
    return 3 * (n_attn * attn + n_mamba * mamba + n_moe * moe + 2 * d * spec.vocab_size)


@pytest.mark.parametrize("model", ["deepseek-v3.config.json", "kimi-k2-instruct.config.json",
                                   "deepseek-v3.config.json:mtp", "qwen3-30b-a3b.config.json",
                                   "mixtral-8x7b-v0.1.config.json"])
@pytest.mark.parametrize("seq_len", [1024, 4096, 32768])
def test_flops_agree_with_megatron(model, seq_len):
    name, _, mode = model.partition(":")
    spec, p = _prof(name, seq_len)
    mtp = spec.mtp_layers if mode == "mtp" else 0
    ours = p.train_flops_per_token + (p.mtp_train_flops_per_token if mtp else 0)
    # residual: Megatron's MLA adds q_lora_rank + kv_lora_rank MACs per layer for the latent norms
    assert _rel(ours, megatron_train_flops_per_token(spec, seq_len, mtp)) < 1e-4


def test_flops_agree_with_megatron_latent_moe_and_hybrid():
    # LatentMoE: Megatron's latent MoE terms must equal ours for the K3 MoE layers (attention is KDA/MLA-gated,
    # outside Megatron's formula): compare one MoE layer's FFN FLOPs through the difference dense -> moe
    spec, p = _prof("kimi-k3")
    m, d = spec.moe, spec.hidden_size
    megatron_moe = 2 * d * (m.expert_intermediate_size * m.top_k * 3 * m.latent_size / d + 2 * m.latent_size
                            + m.shared_intermediate_size * 3)
    kda_moe = next(lp for lp in p.layers if lp.mixer == "kda" and lp.ffn == "moe")
    kda_dense = p.layers[0]
    dense_ffn = 2 * 3 * d * spec.dense_mlp.intermediate_size
    assert kda_moe.fwd_matmul_flops_per_token - (kda_dense.fwd_matmul_flops_per_token - dense_ffn) == megatron_moe
    # Nemotron-H (Mamba-2 + GQA + LatentMoE): Megatron's hybrid formula; residual = the Mamba conv1d (not counted
    # by Megatron)
    spec, p = _prof("nemotron-3-super-120b-a12b.config.json", 8192)
    assert _rel(p.train_flops_per_token, megatron_hybrid_train_flops_per_token(spec, 8192)) < 1e-3


def test_published_deepseek_v3_tflops():
    # Megatron-Bridge performance summary, DeepSeek-V3 pre-training on H100 (BF16), seq 4096 with one MTP layer:
    # 1,297 tokens/s/GPU <-> 338 model TFLOP/s/GPU
    _, p = _prof("deepseek-v3.config.json", 4096)
    tflops = (p.train_flops_per_token + p.mtp_train_flops_per_token) * 1297 / 1e12
    assert _rel(tflops, 338) < 0.005, tflops


# ------------------------------------------------------------------------------------------ KDA / DSA terms


def test_causal_keys_against_a_loop():
    for S, k in [(64, 16), (100, 7), (4096, 2048), (8192, 2048), (2000, 2048)]:
        loop_mean = sum(min(t, k) for t in range(1, S + 1)) / S
        assert abs(_causal_keys(S, k) - loop_mean) <= 0.5 + 1e-9  # S/2 convention vs (S+1)/2: half a key
    assert _causal_keys(4096) == 2048


def test_attention_terms():
    spec, p1 = _prof("kimi-k3.1-pro", 1024)
    _, p2 = _prof("kimi-k3.1-pro", 65536)
    k3, p3 = _prof("kimi-k3", 65536)
    # Attention Residuals: both mixes of 0-based layer i, 4 d n FLOPs each over their n sources
    ar = lambda s, i: 4 * s.hidden_size * sum(s.attn_res_sources(i))  # noqa: E731
    assert spec.attn_res_sources(1) == (2, 2) and spec.attn_res_sources(12) == (2, 3)  # layer 12 closes block 1
    kda1, kda2 = p1.layers[1], p2.layers[1]
    assert kda1.mixer == "kda" and kda1.fwd_attn_flops_per_token == kda2.fwd_attn_flops_per_token
    assert kda1.fwd_attn_flops_per_token - ar(spec, 1) == 96 * (6 * 128 * 128 + 3 * 64 * 128 + 64 * 64)  # Eq. 13
    m, ix = spec.mla, spec.mla.indexer
    qkv = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
    dsa1, dsa2, dense = p1.layers[3], p2.layers[3], p3.layers[3]
    assert dsa1.mixer == dense.mixer == "mla"
    # S <= top_k: sparse attention sees every causal key, like dense attention
    assert dsa1.fwd_attn_flops_per_token - ar(spec, 3) == (
        2 * m.num_heads * qkv * 512 + 2 * ix.num_heads * (ix.head_dim + 1) * 512)
    # long S: main attention ~ top_k keys, indexer still over S/2 keys; dense MLA grows with S
    k_eff = 2048 - 2048**2 / (2 * 65536)
    main = 2 * m.num_heads * qkv * k_eff
    assert dsa2.fwd_attn_flops_per_token - ar(spec, 3) == pytest.approx(
        main + 2 * ix.num_heads * (ix.head_dim + 1) * 32768)
    assert dense.fwd_attn_flops_per_token - ar(k3, 3) == 2 * m.num_heads * qkv * 32768


def test_dispatch_and_activation_bytes():
    _, p = _prof("kimi-k3")
    moe = p.layers[1]
    assert moe.dispatch_bytes_per_token == 16 * 3584 * 2  # latent width
    assert p.layers[0].dispatch_bytes_per_token == 0
    _, v3 = _prof("deepseek-v3.config.json")
    assert v3.layers[5].dispatch_bytes_per_token == 8 * 7168 * 2  # full hidden
    # activation bytes grow with top_k by exactly the per-slot terms: expert in/out (2 L) + gate/up/act (3 I),
    # bf16, + one fp32 weight and one int64 id
    spec = load_model_spec("tiny")
    more = spec.model_copy(update={"moe": spec.moe.model_copy(update={"top_k": spec.moe.top_k + 1})})
    a = profile_model(spec, 64).layers[1].act_bytes_per_token
    b = profile_model(more, 64).layers[1].act_bytes_per_token
    L, inter = spec.moe.latent_size, spec.moe.expert_intermediate_size
    assert b - a == 2 * (2 * L + 3 * inter) + 4 + 8
    assert all(lp.act_bytes_per_token > 0 for lp in p.layers)


def test_quantization_report():
    _, p = _prof("kimi-k3.config.json")
    q = p.quantization
    assert q["quantized"] == ["routed_experts"]
    experts = 92 * 896 * 3 * 3584 * 3072
    rest = p.total_params - experts
    assert q["checkpoint_bytes_estimate"] == pytest.approx(experts * (0.5 + 1 / 32) + rest * 2)
    assert _prof("kimi-k3")[1].quantization is None


# ------------------------------------------------------------------------------------------ loading and the CLI


def test_load_any_model_spec(tmp_path):
    preset = load_any_model_spec("tiny")
    path = tmp_path / "tiny.yaml"
    dump_yaml(preset, path)
    assert load_any_model_spec(path) == preset
    assert load_any_model_spec(HF / "mixtral-8x7b-v0.1.config.json").family == "mixtral"
    (tmp_path / "notmodel.json").write_text(json.dumps({"hello": 1}))
    for bad, needle in [(tmp_path / "notmodel.json", "not an HF config"), (tmp_path / "nope.json", "not found"),
                        ("no-such-preset", "neither a preset")]:
        with pytest.raises(ConfigError, match=needle):
            load_any_model_spec(bad)
    with pytest.raises(ConfigError, match="seq_len"):
        profile_model(preset, 0)


def test_profile_cli_json(capsys):
    profile(str(HF / "deepseek-v3.config.json"), seq_len=4096, json_out=True)
    out = json.loads(capsys.readouterr().out)
    _, p = _prof("deepseek-v3.config.json", 4096)
    assert out["model_type"] == "deepseek_v3" and out["total_params"] == p.total_params
    assert out["activated_params"] == p.activated_params and out["flops_per_token"] == p.train_flops_per_token
    assert len(out["layers"]) == 61 and out["layers"][0]["index"] == 1
    assert {g["ffn"]: g["count"] for g in out["layer_types"]} == {"dense": 3, "moe": 58}
    assert out["mtp_params"] == p.mtp_params and out["quantization"]["method"] == "fp8"


def test_profile_cli_table(capsys):
    profile("tiny", seq_len=64)
    text = capsys.readouterr().out
    assert "kda" in text and "mla" in text and "total params" in text
    assert f"{profile_model(load_model_spec('tiny'), 64).total_params:,}" in text
