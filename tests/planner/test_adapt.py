"""`moestack adapt`: proxies keep the family's pattern and ratios, build on meta, and fit the memory budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from moestack.cli.adapt import adapt
from moestack.config import ConfigError
from moestack.config.model_spec import ModelSpec, load_model_spec
from moestack.model.transformer import build_model
from moestack.planner.adapt import (
    CPU_ACT_FACTOR,
    GIB,
    LOSS_BYTES_PER_LOGIT,
    _mixer_period,
    _scale_spec,
    adapt_model,
    parse_fit,
    spec_to_yaml,
    training_memory,
)
from moestack.planner.profile import load_any_model_spec, profile_model

HF = Path(__file__).parent.parent / "data" / "hf_configs"


def _meta_params(spec: ModelSpec) -> int:
    return sum(p.numel() for p in build_model(spec, "meta").parameters())


def _mixers(spec: ModelSpec) -> list[str]:
    return [k.mixer for k in spec.layer_kinds()]


def _check_proxy(result, source: ModelSpec) -> None:
    """What every proxy must satisfy: valid, builds on meta with the profile's count, fits, same family shape."""
    proxy = result.spec
    assert proxy.build_support_errors() == []
    assert _meta_params(proxy) == result.profile.total_params
    mem = training_memory(proxy, result.seq_len, result.batch, result.act_factor, result.target.reserved_bytes)
    assert sum(mem.values()) == pytest.approx(result.memory_total)
    assert result.memory_total <= result.target.memory_bytes * 0.9
    assert result.profile.total_params < profile_model(source, result.seq_len).total_params
    assert proxy.vocab_size == source.vocab_size and proxy.activation == source.activation
    if source.moe is not None:
        m, p = source.moe, proxy.moe
        assert p.num_experts * m.top_k == m.num_experts * p.top_k  # experts / top-k kept exactly
        assert p.num_shared_experts == m.num_shared_experts
        assert (p.latent_size is None) == (m.latent_size is None)
        assert p.top_k >= min(2, m.top_k)
    if source.kda is not None:
        assert proxy.kda.head_dim == source.kda.head_dim
    if source.mla is not None:
        for dim in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            assert getattr(proxy.mla, dim) == getattr(source.mla, dim)
    if source.gqa is not None:
        assert proxy.gqa_head_dim == source.gqa_head_dim
        assert proxy.gqa.num_heads // proxy.gqa.num_kv_heads == source.gqa.num_heads // source.gqa.num_kv_heads


def test_parse_fit():
    h200 = parse_fit("H200")
    assert h200.kind == "gpu" and h200.memory_bytes == pytest.approx(140.4 * GIB)
    cpu = parse_fit("cpu-8g")
    assert cpu.kind == "cpu" and cpu.memory_bytes == 8 * GIB
    assert parse_fit("141GB").memory_bytes == 141e9
    assert parse_fit("8GiB").memory_bytes == 8 * GIB
    assert parse_fit("80G").memory_bytes == 80e9
    for bad in ("h300", "0GB", "-5GB", "lots", "12 parsecs"):
        with pytest.raises(ConfigError, match="--fit"):
            parse_fit(bad)


def test_mixer_period():
    assert _mixer_period(_mixers(load_model_spec("kimi-k3"))) == 4  # (KDA x3, MLA) x 23 + MLA
    assert _mixer_period(["mla"] * 61) == 1
    assert _mixer_period(["kda", "kda", "gqa"] * 5) == 3
    assert _mixer_period(["kda", "mla", "mla", "kda", "kda"]) == 5  # no repeating unit: the whole sequence


def test_kimi_k3_for_one_h200():
    src = load_model_spec("kimi-k3")
    result = adapt_model(src, parse_fit("h200"))
    _check_proxy(result, src)
    proxy = result.spec
    n = proxy.num_layers
    assert n % 4 == 0 and proxy.full_attention_layers == list(range(4, n + 1, 4))  # KDA:MLA = 3:1, MLA every 4th
    assert proxy.dense_layers == [1]
    assert proxy.moe.latent_size * 2 == proxy.hidden_size  # latent / hidden = 3584 / 7168
    assert proxy.moe.shared_intermediate_size == 2 * proxy.moe.expert_intermediate_size
    assert proxy.mla.kv_lora_rank == 512 and proxy.mla.output_gate and not proxy.mla.use_rope
    assert proxy.kda.gate == "k3" and proxy.kda.output_gate_rank is None
    # the spirit of the hand-made proxy preset: a few B total, well under 2B activated, on one 141 GB GPU
    assert 1.5e9 < result.profile.total_params < 6e9
    assert 0.3e9 < result.profile.activated_params < 2e9
    assert result.precision == "bf16"


def test_kimi_k3_for_an_8gb_cpu():
    src = load_model_spec("kimi-k3")
    result = adapt_model(src, parse_fit("cpu-8g"))
    _check_proxy(result, src)
    assert result.precision == "fp32" and result.act_factor == CPU_ACT_FACTOR
    assert result.spec.full_attention_layers[-1] == result.spec.num_layers
    assert result.memory_total <= 8 * GIB


def test_widest_fit_is_chosen():
    """No wider proxy (with any allowed expert count) fits: the search returns the widest that does."""
    src = load_model_spec("kimi-k3")
    target = parse_fit("cpu-8g")
    result = adapt_model(src, target)
    d = result.spec.hidden_size
    wider, _ = _scale_spec(result.source, d + 128, result.seq_len, s=16)  # top-1 of 56: the fewest experts
    wider["name"] = "wider"
    mem = training_memory(ModelSpec(**wider), result.seq_len, result.batch, result.act_factor, target.reserved_bytes)
    assert sum(mem.values()) > result.usable_bytes


@pytest.mark.parametrize(
    "config, fit, note",
    [
        ("deepseek-v3.config.json", "h200", "dropped mla.rope_scaling (yarn)"),
        ("qwen3-30b-a3b.config.json", "h100", None),
        ("mixtral-8x7b-v0.1.config.json", "a100-80g", None),
        ("kimi-k3.config.json", "cpu-16g", None),
    ],
)
def test_hf_families_adapt(config, fit, note):
    src = load_any_model_spec(HF / config)
    result = adapt_model(src, parse_fit(fit))
    _check_proxy(result, result.source)
    if src.attn_res_block_size is not None:  # Attention Residuals kept, with the source's number of blocks
        p = result.spec
        assert p.attn_res_block_size is not None and not any("Attention Residuals" in n for n in result.notes)
        blocks = lambda s: s.attn_res_blocks_before(s.num_layers)  # noqa: E731
        assert abs(blocks(p) - blocks(src)) <= max(1, blocks(src) // 3), (p.num_layers, p.attn_res_block_size)
    if note is not None:
        assert any(note in n for n in result.notes), result.notes
    if src.mtp_layers:
        assert result.spec.mtp_layers == 0 and any("MTP" in n for n in result.notes)


def test_memory_model_by_hand():
    spec = load_model_spec("tiny")
    prof = profile_model(spec, 64)
    act = sum(lp.act_bytes_per_token for lp in prof.layers) + prof.head_act_bytes_per_token
    mem = training_memory(spec, 64, 3, 2.5, 1000.0)
    assert mem["weights+grads+adamw"] == 16 * prof.total_params
    assert mem["activations"] == pytest.approx(3 * 64 * act * 2.5)
    assert mem["loss chunk"] == 3 * 64 * spec.vocab_size * LOSS_BYTES_PER_LOGIT
    assert mem["runtime reserve"] == 1000.0


def test_cpu_activation_factor_bounds_what_the_model_saves():
    """CPU_ACT_FACTOR x the profile's estimate covers the bytes autograd really saves on a CPU (fp32 reference
    kernels), and the profile does not overstate them (fp32 alone doubles its bf16 estimate)."""
    spec = load_model_spec("tiny")
    torch.manual_seed(0)
    model = build_model(spec, "cpu", seed=0)
    B, T = 2, 64
    tokens = torch.randint(0, spec.vocab_size, (B, T))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, tokens)
    prof = profile_model(spec, T)
    estimate = (sum(lp.act_bytes_per_token for lp in prof.layers) + prof.head_act_bytes_per_token) * B * T
    assert 2 * estimate < sum(saved.values()) < CPU_ACT_FACTOR * estimate


def test_top_k_option():
    src = load_model_spec("kimi-k3")
    result = adapt_model(src, parse_fit("h200"), top_k=8)
    assert (result.spec.moe.num_experts, result.spec.moe.top_k) == (448, 8)
    with pytest.raises(ConfigError, match="--top-k: 3"):
        adapt_model(src, parse_fit("h200"), top_k=3)


def test_errors():
    with pytest.raises(ConfigError, match="no proxy of 'kimi-k3' fits cpu-2g"):
        adapt_model(load_model_spec("kimi-k3"), parse_fit("cpu-2g"))
    with pytest.raises(ConfigError, match="mamba"):
        adapt_model(load_any_model_spec(HF / "nemotron-3-super-120b-a12b.config.json"), parse_fit("h200"))
    with pytest.raises(ConfigError, match="--margin"):
        adapt_model(load_model_spec("tiny"), parse_fit("h200"), margin=1.5)


def test_yaml_round_trip(tmp_path):
    result = adapt_model(load_any_model_spec(HF / "qwen3-next-80b-a3b.config.json"), parse_fit("h100"))
    path = tmp_path / "proxy.yaml"
    path.write_text(spec_to_yaml(result))
    back = load_model_spec(path)
    assert back == result.spec
    assert back.kda.gate_rank is None  # None where the default is not None survives the file


def test_cli(tmp_path):
    app = typer.Typer()
    app.command()(adapt)
    app.command("noop")(lambda: None)  # two commands: typer keeps the subcommand name
    out = tmp_path / "k3-h200.yaml"
    res = CliRunner().invoke(app, ["adapt", "kimi-k3", "--fit", "h200", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "kimi-k3-fit-h200" in res.output and "total params" in res.output and "2.779T" in res.output
    spec = load_model_spec(out)
    assert spec.name == "kimi-k3-fit-h200"
    res = CliRunner().invoke(app, ["adapt", str(HF / "deepseek-v3.config.json"), "--fit", "141GB"])
    assert res.exit_code == 0, res.output
    assert "dropped mla.rope_scaling (yarn)" in res.output and "hidden_size:" in res.output
