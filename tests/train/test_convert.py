"""HF safetensors <-> moestack: every family's real naming, fused experts, streaming, bit-exact round trips, and
errors that name every offending tensor.

The synthetic checkpoints are written here from the families' public naming (hand-written below, independent of
moestack/train/hf_names.py), sharded over 3 files so that some layer's experts span two shards.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moestack.config.model_spec import ModelSpec, load_model_spec
from moestack.model.transformer import build_model
from moestack.train import convert as convert_mod
from moestack.train.checkpoint import load_checkpoint
from moestack.train.convert import (
    CheckpointSource,
    ConvertError,
    compact_names,
    export_hf,
    hf_to_checkpoint,
    hf_to_state_dict,
    load_hf_weights,
    read_hf_layout,
)

FP32_SUFFIXES = ("A_log", "dt_bias", "e_score_correction_bias")


# ---------------------------------------------------------------------------------------------- tiny specs


def _spec(family: str) -> ModelSpec:
    base = load_model_spec("tiny").model_dump()
    base.update(family=family, name=f"tiny-{family}")
    if family == "kimi_k3":  # with K3's Attention Residuals (blocks of 2 layers)
        return ModelSpec(**{**base, "attn_res_block_size": 2})
    if family == "kimi_linear":
        base["kda"].update(gate="kimi_linear", output_gate_rank=16)
        base["mla"].update(q_lora_rank=None, output_gate=False, indexer=None)
        base["moe"].update(num_experts=8, top_k=2, latent_size=None, num_shared_experts=1, shared_intermediate_size=64)
        return ModelSpec(**base)
    if family == "deepseek_v3":  # with the DSA indexer of V3.2, grouped routing, RoPE
        base.update(full_attention_layers=[1, 2, 3, 4], kda=None, linear_attention="kda")
        base["mla"].update(use_rope=True, output_gate=False)
        base["moe"].update(latent_size=None, num_shared_experts=1, shared_intermediate_size=64,
                           router={**base["moe"]["router"], "num_groups": 4, "topk_groups": 2,
                                   "bias_update": "sign"})  # DeepSeek-V3's grouped routing balances by sign
        return ModelSpec(**base)
    gqa = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "qk_norm": family == "qwen3_moe"}
    base.update(attention="gqa", gqa=gqa, mla=None, kda=None, full_attention_layers=[1, 2, 3], num_layers=3,
                dense_layers=[], dense_mlp=None, activation="swiglu", tie_word_embeddings=family == "qwen3_moe")
    router = {**base["moe"]["router"], "score": "softmax", "selection_bias": False, "bias_update": "sign"}
    base["moe"].update(num_experts=8 if family == "qwen3_moe" else 4, top_k=2, latent_size=None,
                       num_shared_experts=0, shared_intermediate_size=0, router=router)
    return ModelSpec(**base)


FAMILIES = ["kimi_k3", "kimi_linear", "deepseek_v3", "qwen3_moe", "mixtral"]


# ---------------------------------------------------------------------------------------------- HF side, by hand


def _hf_shapes(spec: ModelSpec, family: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of an HF checkpoint of `spec` in `family`'s naming (public modeling code)."""
    P = "language_model.model." if family == "kimi_k3" else "model."
    d, V = spec.hidden_size, spec.vocab_size
    out = {P + "embed_tokens.weight": (V, d), P + "norm.weight": (d,)}
    if spec.attn_res_block_size is not None:
        out[P + "output_attn_res_norm.weight"] = (d,)
        out[P + "output_attn_res_proj.weight"] = (1, d)
    if not spec.tie_word_embeddings:
        out["language_model.lm_head.weight" if family == "kimi_k3" else "lm_head.weight"] = (V, d)
    for i, kind in enumerate(spec.layer_kinds()):
        L = f"{P}layers.{i}."
        out[L + "input_layernorm.weight"] = (d,)
        out[L + "post_attention_layernorm.weight"] = (d,)
        if spec.attn_res_block_size is not None:
            for mix in ("self_attention_res", "mlp_res"):
                out[L + f"{mix}_norm.weight"] = (d,)
                out[L + f"{mix}_proj.weight"] = (1, d)
        a = L + "self_attn."
        if kind.mixer == "kda":
            k = spec.kda
            H, K, W = k.num_heads, k.head_dim, k.conv_kernel_size
            for x in "qkv":
                out[a + f"{x}_proj.weight"] = (H * K, d)
                out[a + f"{x}_conv1d.weight"] = (H * K, 1, W)
            out[a + "f_a_proj.weight"] = (k.gate_rank, d)
            out[a + "f_b_proj.weight"] = (H * K, k.gate_rank)
            out[a + "A_log"] = (1, 1, H, 1) if family == "kimi_linear" else (H,)
            out[a + "dt_bias"] = (H * K,)
            out[a + "b_proj.weight"] = (H, d)
            if k.output_gate_rank is None:
                out[a + "g_proj.weight"] = (H * K, d)
            else:
                out[a + "g_a_proj.weight"] = (k.output_gate_rank, d)
                out[a + "g_b_proj.weight"] = (H * K, k.output_gate_rank)
            out[a + "o_norm.weight"] = (K,)
            out[a + "o_proj.weight"] = (d, H * K)
        elif kind.mixer == "mla":
            m = spec.mla
            H, N, R, C, Vd, Q = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim, \
                m.q_lora_rank
            if Q is None:
                out[a + "q_proj.weight"] = (H * (N + R), d)
            else:
                out[a + "q_a_proj.weight"] = (Q, d)
                out[a + "q_a_layernorm.weight"] = (Q,)
                out[a + "q_b_proj.weight"] = (H * (N + R), Q)
            out[a + "kv_a_proj_with_mqa.weight"] = (C + R, d)
            out[a + "kv_a_layernorm.weight"] = (C,)
            out[a + "kv_b_proj.weight"] = (H * (N + Vd), C)
            if m.output_gate:
                out[a + "g_proj.weight"] = (H * Vd, d)
            out[a + "o_proj.weight"] = (d, H * Vd)
            if m.indexer is not None:
                ix = m.indexer
                out[a + "indexer.wq_b.weight"] = (ix.num_heads * ix.head_dim, Q or d)
                out[a + "indexer.wk.weight"] = (ix.head_dim, d)
                out[a + "indexer.k_norm.weight"] = (ix.head_dim,)
                out[a + "indexer.k_norm.bias"] = (ix.head_dim,)
                out[a + "indexer.weights_proj.weight"] = (ix.num_heads, d)
        else:
            g, E = spec.gqa, spec.gqa_head_dim
            out[a + "q_proj.weight"] = (g.num_heads * E, d)
            out[a + "k_proj.weight"] = (g.num_kv_heads * E, d)
            out[a + "v_proj.weight"] = (g.num_kv_heads * E, d)
            out[a + "o_proj.weight"] = (d, g.num_heads * E)
            if g.qk_norm:
                out[a + "q_norm.weight"] = (E,)
                out[a + "k_norm.weight"] = (E,)
        if kind.ffn == "dense":
            inter = spec.dense_mlp.intermediate_size
            out[L + "mlp.gate_proj.weight"] = (inter, d)
            out[L + "mlp.up_proj.weight"] = (inter, d)
            out[L + "mlp.down_proj.weight"] = (d, inter)
            continue
        mo = spec.moe
        B = L + ("mlp." if family in ("deepseek_v3", "qwen3_moe") else "block_sparse_moe.")
        out[B + "gate.weight"] = (mo.num_experts, d)
        if mo.router.selection_bias:
            out[B + "gate.e_score_correction_bias"] = (mo.num_experts,)
        W, inter = mo.latent_size or d, mo.expert_intermediate_size
        if mo.latent_size is not None:
            out[B + "routed_expert_down_proj.weight"] = (W, d)
            out[B + "routed_expert_norm.weight"] = (W,)
            out[B + "routed_expert_up_proj.weight"] = (d, W)
        gate, up, down = ("w1", "w3", "w2") if family in ("kimi_k3", "kimi_linear", "mixtral") else (
            "gate_proj", "up_proj", "down_proj")
        for j in range(mo.num_experts):
            out[B + f"experts.{j}.{gate}.weight"] = (inter, W)
            out[B + f"experts.{j}.{up}.weight"] = (inter, W)
            out[B + f"experts.{j}.{down}.weight"] = (W, inter)
        if mo.num_shared_experts:
            S = mo.shared_intermediate_size
            out[B + "shared_experts.gate_proj.weight"] = (S, d)
            out[B + "shared_experts.up_proj.weight"] = (S, d)
            out[B + "shared_experts.down_proj.weight"] = (d, S)
    return out


def _write_hf(root: Path, tensors: dict[str, torch.Tensor], n_files: int = 3, config: dict | None = None) -> None:
    """Shard `tensors` over n_files plus index.json: other tensors in name order, expert j in file j % n_files (so
    every layer's experts span all shards)."""
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    plain = [n for n in names if ".experts." not in n]
    file_of = {n: i * n_files // max(1, len(plain)) for i, n in enumerate(plain)}
    for n in names:
        m = re.search(r"\.experts\.(\d+)\.", n)
        if m:
            file_of[n] = int(m.group(1)) % n_files
    weight_map = {}
    for i in range(n_files):
        f = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        chunk = {n: tensors[n] for n in names if file_of[n] == i}
        save_file(chunk, str(root / f), metadata={"format": "pt"})
        weight_map.update({n: f for n in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))


def _random_hf(spec: ModelSpec, family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in _hf_shapes(spec, family).items():
        dtype = torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16
        out[name] = torch.randn(shape, generator=gen).to(dtype)
    return out


def _ms_name(hf: str) -> str | None:
    """Independent oracle: the moestack name of a non-expert HF tensor (regex rewrites of the public names)."""
    n = re.sub(r"^(language_model\.)?model\.", "", hf)
    n = re.sub(r"^language_model\.lm_head", "lm_head", n)
    if ".experts." in n:
        return None
    for pat, rep in [
        (r"\.self_attention_res_(norm|proj)\.weight$", r".attn_res.\1_weight"),
        (r"\.mlp_res_(norm|proj)\.weight$", r".ffn_res.\1_weight"),
        (r"^output_attn_res_(norm|proj)\.weight$", r"out_res.\1_weight"),
        (r"^embed_tokens\.", "embed."), (r"\.input_layernorm\.", ".attn_norm."),
        (r"\.post_attention_layernorm\.", ".ffn_norm."), (r"\.self_attn\.", ".attn."),
        (r"\.(mlp|block_sparse_moe)\.gate\.weight$", ".ffn.router.weight"),
        (r"\.(mlp|block_sparse_moe)\.gate\.e_score_correction_bias$", ".ffn.router.selection_bias"),
        (r"\.block_sparse_moe\.routed_expert_down_proj\.", ".ffn.down_proj."),
        (r"\.block_sparse_moe\.routed_expert_norm\.", ".ffn.latent_norm."),
        (r"\.block_sparse_moe\.routed_expert_up_proj\.", ".ffn.up_proj."),
        (r"\.(mlp|block_sparse_moe)\.shared_experts\.", ".ffn.shared."), (r"\.mlp\.", ".ffn."),
        (r"\.([qkv])_conv1d\.", r".\1_conv."), (r"\.q_a_layernorm\.", ".q_a_norm."),
        (r"\.kv_a_proj_with_mqa\.", ".kv_a_proj."), (r"\.kv_a_layernorm\.", ".kv_a_norm."),
        (r"\.indexer\.wq_b\.", ".indexer.wq."),
    ]:
        n = re.sub(pat, rep, n)
    return n


def _expected_experts(hf: dict[str, torch.Tensor], spec: ModelSpec, family: str) -> dict[str, torch.Tensor]:
    """Oracle for the fused expert tensors, loop by loop: w_gate_up[j] = cat(gate_j, up_j), w_down[j] = down_j."""
    P = "language_model.model." if family == "kimi_k3" else "model."
    gate, up, down = ("w1", "w3", "w2") if family in ("kimi_k3", "kimi_linear", "mixtral") else (
        "gate_proj", "up_proj", "down_proj")
    block = "mlp" if family in ("deepseek_v3", "qwen3_moe") else "block_sparse_moe"
    out = {}
    for i, kind in enumerate(spec.layer_kinds()):
        if kind.ffn != "moe":
            continue
        B = f"{P}layers.{i}.{block}.experts"
        E = spec.moe.num_experts
        out[f"layers.{i}.ffn.experts.w_gate_up"] = torch.stack(
            [torch.cat([hf[f"{B}.{j}.{gate}.weight"], hf[f"{B}.{j}.{up}.weight"]], dim=0) for j in range(E)])
        out[f"layers.{i}.ffn.experts.w_down"] = torch.stack([hf[f"{B}.{j}.{down}.weight"] for j in range(E)])
    return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _read_all(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("family", FAMILIES)
def test_import_matches_the_naming_oracle(family, tmp_path):
    spec = _spec(family)
    hf = _random_hf(spec, family)
    _write_hf(tmp_path / "hf", hf)
    layout = read_hf_layout(tmp_path / "hf")
    spans = {}  # some fused expert tensor must take its experts from two shards
    for f, names in layout.files:
        for n in names:
            m = re.match(r"(.*\.experts\.)\d+\.", n)
            if m:
                spans.setdefault(m.group(1), set()).add(f)
    assert any(len(files) > 1 for files in spans.values())

    sd = hf_to_state_dict(tmp_path / "hf", spec)
    want = _expected_experts(hf, spec, family)
    for name, t in hf.items():
        ms = _ms_name(name)
        if ms is not None:
            want[ms] = t.reshape(sd[ms].shape)
    if spec.tie_word_embeddings:
        want["lm_head.weight"] = want["embed.weight"]
        assert sd["lm_head.weight"] is sd["embed.weight"]
    assert sorted(sd) == sorted(want)
    for name in want:
        assert _bits_equal(sd[name], want[name]), name

    model = build_model(spec, "meta")
    model.load_state_dict(sd, strict=True, assign=True)  # names and shapes are the model's own


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact(family, tmp_path):
    """HF -> moestack state dict -> HF: same names, bytes, dtypes, and byte-identical shard files."""
    spec = _spec(family)
    hf = _random_hf(spec, family, seed=3)
    _write_hf(tmp_path / "hf", hf, config={"model_type": family})
    layout = read_hf_layout(tmp_path / "hf")
    sd = hf_to_state_dict(tmp_path / "hf", spec)
    written = export_hf(sd, spec, tmp_path / "back", layout=layout)
    assert {p.name for p in written} >= {f for f, _ in layout.files}
    back = _read_all(tmp_path / "back")
    assert sorted(back) == sorted(hf)
    for name in hf:
        assert _bits_equal(back[name], hf[name]), name
    for f, _ in layout.files:
        assert _sha(tmp_path / "back" / f) == _sha(tmp_path / "hf" / f)
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert index == json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == {"model_type": family}


@pytest.mark.parametrize("family, dtype", [("kimi_k3", None), ("qwen3_moe", torch.float32)])
def test_dcp_checkpoint_round_trip(family, dtype, tmp_path):
    """HF -> moestack DCP checkpoint (HF dtypes, or fp32 as the trainer holds them) -> HF is bit-exact; the
    checkpoint loads into an fp32 model."""
    spec = _spec(family)
    hf = _random_hf(spec, family, seed=5)
    _write_hf(tmp_path / "hf", hf)
    ckpt = hf_to_checkpoint(tmp_path / "hf", tmp_path / "ckpt", spec, dtype=dtype)
    stored = CheckpointSource(ckpt).tensors["layers.1.ffn.experts.w_gate_up"][1]
    assert stored == (dtype or torch.bfloat16)
    assert ckpt.name == "step_00000000" and not (tmp_path / "ckpt" / convert_mod.SPOOL).exists()

    model = build_model(spec, "cpu", seed=2)
    load_checkpoint(ckpt, model)
    ref = hf_to_state_dict(tmp_path / "hf", spec)
    for name, t in model.state_dict().items():
        assert torch.equal(t, ref[name].to(t.dtype)), name

    export_hf(CheckpointSource(ckpt), spec, tmp_path / "back")  # the recorded layout: the source's files
    for f in sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")):
        assert _sha(tmp_path / "back" / f) == _sha(tmp_path / "hf" / f)
    with pytest.raises(ConvertError, match="not empty"):  # never prunes an existing run's checkpoints
        hf_to_checkpoint(tmp_path / "hf", tmp_path / "ckpt", spec)
    with pytest.raises(ConvertError, match="already holds safetensors"):
        export_hf(CheckpointSource(ckpt), spec, tmp_path / "back")


def test_load_hf_weights_streams_one_shard_at_a_time(tmp_path, monkeypatch):
    spec = _spec("kimi_k3")
    hf = _random_hf(spec, "kimi_k3", seed=7)
    _write_hf(tmp_path / "hf", hf, n_files=3)
    opened, open_now, peak = [], [0], [0]
    real_open = convert_mod._safe_open

    class _Counting:
        def __init__(self, path):
            self.inner = real_open(path)

        def __enter__(self):
            open_now[0] += 1
            peak[0] = max(peak[0], open_now[0])
            return self.inner.__enter__()

        def __exit__(self, *exc):
            open_now[0] -= 1
            return self.inner.__exit__(*exc)

    def counting_open(path):
        opened.append(Path(path).name)
        return _Counting(path)

    monkeypatch.setattr(convert_mod, "_safe_open", counting_open)
    model = build_model(spec, "cpu", seed=0)
    n = load_hf_weights(model, tmp_path / "hf")
    assert peak[0] == 1  # never two shards open at once
    data_passes = opened[3:]  # the first 3 opens read headers only
    assert data_passes == sorted(data_passes) and len(data_passes) == 3
    ref = hf_to_state_dict(tmp_path / "hf", spec)
    assert n.tensors == len(ref)
    for name, t in model.state_dict().items():
        assert torch.equal(t, ref[name].float()), name


def test_export_without_layout_then_import(tmp_path):
    """A trained (fp32) model exported with the default layout (bf16, small shards) imports back to the same
    bf16-rounded values; the family's fp32 tensors stay fp32."""
    spec = _spec("kimi_linear")
    model = build_model(spec, "cpu", seed=11)
    sd = model.state_dict()
    files = export_hf(sd, spec, tmp_path / "out", max_shard_bytes=200_000)
    shards = [p for p in files if p.suffix == ".safetensors"]
    assert len(shards) > 2
    back = _read_all(tmp_path / "out")
    assert back["model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert back["model.layers.0.self_attn.A_log"].shape == (1, 1, spec.kda.num_heads, 1)
    assert back["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    again = hf_to_state_dict(tmp_path / "out", spec)
    for name, t in sd.items():
        want = t if name.endswith(("A_log", "dt_bias", "selection_bias")) or "conv" in name or "o_norm" in name \
            else t.to(torch.bfloat16)
        assert torch.equal(again[name].to(want.dtype), want), name


def test_missing_expert_is_named(tmp_path):
    spec = _spec("deepseek_v3")
    hf = _random_hf(spec, "deepseek_v3")
    lost = "model.layers.2.mlp.experts.5.up_proj.weight"
    del hf[lost]
    _write_hf(tmp_path / "hf", hf)
    with pytest.raises(ConvertError, match=re.escape(lost)) as err:
        hf_to_state_dict(tmp_path / "hf", spec)
    assert err.value.missing == [lost] and err.value.unexpected == [] and "1 missing" in str(err.value)


def test_unexpected_and_mismatched_are_named(tmp_path):
    spec = _spec("mixtral")
    hf = _random_hf(spec, "mixtral")
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.randn(16)
    hf["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = torch.randn(64, 128).bfloat16()  # a 5th expert
    name = "model.layers.1.self_attn.k_proj.weight"
    hf[name] = hf[name].t().contiguous()
    _write_hf(tmp_path / "hf", hf)
    with pytest.raises(ConvertError) as err:
        hf_to_state_dict(tmp_path / "hf", spec)
    assert sorted(err.value.unexpected) == ["model.layers.0.block_sparse_moe.experts.4.w1.weight",
                                            "model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert err.value.mismatched == [f"{name}: checkpoint [128, 64] vs model [64, 128]"]
    msg = str(err.value)
    assert "\n" not in msg and "model 'tiny-mixtral' (family mixtral)" in msg and "2 unexpected" in msg
    # skipping on purpose (e.g. buffers, MTP layers) is explicit
    hf[name] = hf[name].t().contiguous()
    _write_hf(tmp_path / "hf2", hf)
    sd = hf_to_state_dict(tmp_path / "hf2", spec, skip=[r"rotary_emb", r"experts\.4\."])
    assert "layers.0.ffn.experts.w_gate_up" in sd


def test_broken_checkpoints(tmp_path):
    spec = _spec("qwen3_moe")
    hf = _random_hf(spec, "qwen3_moe")
    _write_hf(tmp_path / "hf", hf)
    (tmp_path / "hf" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ConvertError, match="model-00002-of-00003.safetensors"):
        hf_to_state_dict(tmp_path / "hf", spec)
    with pytest.raises(ConvertError, match="no model.safetensors.index.json and no"):
        read_hf_layout(tmp_path)
    _write_hf(tmp_path / "bad", hf)
    (tmp_path / "bad" / "model-00001-of-00003.safetensors").write_bytes(b"\x10not a header")
    with pytest.raises(ConvertError, match="model-00001-of-00003.safetensors: not a readable safetensors file"):
        read_hf_layout(tmp_path / "bad")
    hf["model.layers.0.mlp.gate.weight"] = torch.randint(0, 5, (8, 128), dtype=torch.int32)
    _write_hf(tmp_path / "int", hf)
    with pytest.raises(ConvertError, match="not floating point"):
        hf_to_state_dict(tmp_path / "int", spec)


def test_single_file_without_index(tmp_path):
    spec = _spec("mixtral")
    hf = _random_hf(spec, "mixtral", seed=4)
    (tmp_path / "hf").mkdir()
    save_file(hf, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    layout = read_hf_layout(tmp_path / "hf")
    assert layout.index is None and [f for f, _ in layout.files] == ["model.safetensors"]
    written = export_hf(hf_to_state_dict(tmp_path / "hf", spec), spec, tmp_path / "back", layout=layout)
    assert [p.name for p in written] == ["model.safetensors"]
    assert _sha(tmp_path / "back" / "model.safetensors") == _sha(tmp_path / "hf" / "model.safetensors")


def test_export_checks_the_source(tmp_path):
    spec = _spec("mixtral")
    sd = build_model(spec, "cpu", seed=0).state_dict()
    sd.pop("layers.1.ffn.experts.w_down")
    sd["layers.1.ffn.extra"] = torch.zeros(1)
    with pytest.raises(ConvertError, match=r"1 missing: layers\.1\.ffn\.experts\.w_down; 1 unexpected"):
        export_hf(sd, spec, tmp_path / "out")


def test_compact_names():
    names = [f"m.layers.1.mlp.experts.{j}.w1.weight" for j in (0, 1, 2, 7, 9, 10)] + ["lm_head.weight"]
    assert compact_names(names) == "m.layers.1.mlp.experts.{0-2,7,9-10}.w1.weight, lm_head.weight"
    assert compact_names(["a.experts.5.w2.weight"]) == "a.experts.5.w2.weight"


def test_cli_round_trip(tmp_path):
    import typer
    from typer.testing import CliRunner

    from moestack.cli.adapt import convert
    from moestack.config.base import ConfigError, dump_yaml

    app = typer.Typer()
    app.command()(convert)
    app.command("noop")(lambda: None)
    spec = _spec("kimi_linear")
    dump_yaml(spec, tmp_path / "spec.yaml")
    _write_hf(tmp_path / "hf", _random_hf(spec, "kimi_linear", seed=9))
    run = CliRunner().invoke
    res = run(app, ["convert", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--model", str(tmp_path / "spec.yaml")])
    assert res.exit_code == 0, res.output
    res = run(app, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "back")])  # spec and layout from the checkpoint
    assert res.exit_code == 0, res.output
    assert "3 shard(s)" in res.output
    for f in sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")):
        assert _sha(tmp_path / "back" / f) == _sha(tmp_path / "hf" / f)
    res = run(app, ["convert", str(tmp_path / "nothing"), str(tmp_path / "x")])
    assert isinstance(res.exception, ConfigError) and "no such file" in str(res.exception)
    res = run(app, ["convert", str(tmp_path / "hf"), str(tmp_path / "y")])
    assert isinstance(res.exception, ConfigError) and "no config.json; pass --model" in str(res.exception)
