"""Exact architecture profile: parameters, FLOPs, activation bytes and dispatch bytes, per layer and in total.

Every per-layer number is read from the work description the cost model prices (cost.work.model_work), whose
parameters mirror moestack.model module by module (no biases unless the spec says so):
  block   2 RMSNorm(d) (attn_norm, ffn_norm); a single-sublayer block (layer_pattern, mtp_pattern) has one;
          Attention Residuals add a mix before each sublayer and one at the output (counted with the final norm),
          each a norm weight [d] and a Linear(d, 1) weight [1, d] (their product is the pseudo-query).
  KDA     q_proj, k_proj d -> H*K; v_proj d -> Hv*K; 3 short convs [C, 1, W] (C = H*K, H*K, Hv*K); decay input
          f_a d -> r, f_b r -> G (or f_proj d -> G; G = Hv*K per channel, Hv per head); A_log [Hv]; dt_bias [G];
          b_proj d -> Hv; g_proj d -> Hv*K (or g_a d -> r, g_b r -> Hv*K); o_norm [K]; o_proj Hv*K -> d.
  MLA     q_a_proj d -> Lq, q_a_norm [Lq], q_b_proj Lq -> H*(N+R) (or q_proj d -> H*(N+R)); kv_a_proj d -> C+R;
          kv_a_norm [C]; kv_b_proj C -> H*(N+V); g_proj d -> H*V (output gate); o_proj H*V -> d;
          indexer: wq Lq -> Hi*Di, wk d -> Di, k_norm LayerNorm [Di] weight + bias, weights_proj d -> Hi.
  GQA     q d -> H*E, k, v d -> G*E (+ biases with qkv_bias), q_norm, k_norm [E] (qk_norm), g_proj d -> H*E
          (output gate), o_proj H*E -> d.
  MoE     router weight [E, d] (the selection bias [E] is a buffer: model state, not a parameter, not counted);
          LatentMoE down_proj d -> L, latent_norm [L], up_proj L -> d; experts E * m * L * I (m = 3 GLU, 2 relu2;
          L = d for a plain MoE); fused shared experts m * d * Is; shared-expert gate [d].
  MLP     m * d * I.
  Mamba-2 in_proj d -> 2*Di + 2*ng*ds + nh; conv [Di + 2*ng*ds, 1, W] (+ bias); dt_bias, A_log, D [nh];
          gated norm [Di]; out_proj Di -> d (in_proj and out_proj biases with proj_bias).
  model   embedding V*d (+ S*d learned positions); final RMSNorm [d]; LM head d*V (0 when tied to the embedding).
  GPT-2/3 parts (profiled, not built): norm layernorm = weight + bias [2d] per norm; gelu = one up matrix (as relu2);
          linear_bias = biases on the GQA output projection and the MLP / expert up and down layers (q/k/v:
          gqa.qkv_bias).
total_params = embedding + layers + final norm + head: the model moestack builds. other_params = final norm + MTP
modules + vision tower (MTP and vision are counted and reported, not in total_params: they are not trained).
Activated parameters per token = what a token's forward touches, excluding the input embedding (a row gather) and
including the LM head: only the top_k routed experts of a MoE layer.

Forward FLOPs per token (train = 3 x forward: forward, data-gradient and weight-gradient GEMMs, Megatron's rule):
  matmul  2 x weights of every matmul/conv the token multiplies (2 x activated params minus norms, biases, A_log,
          dt_bias, D, and the router, which is reported apart as router FLOPs, as Megatron leaves it out).
  causal softmax attention (GQA, MLA dense): QK^T and PV over on average S/2 keys: 2 * H * (d_qk + d_v) * S/2;
          a sliding window of w keys (sliding_window_layers) caps them as DSA's top-k does: w - w^2 / (2S).
  DSA (MLA with an indexer, sparse): the same over the keys a query keeps, k_eff = S/2 (S <= k) else
          k - k^2/(2S); plus indexer scores over all S/2 causal keys: 2 * Hi * (Di + 1) * S/2 (dot products and
          head weighting; the top-k selection itself is not counted). This is the sparse stage; the dense warm-up
          costs dense MLA plus the indexer. MLA terms use the per-head form (d_qk = N + R, d_v = V) whichever
          kernel form (per-head or absorbed MQA) runs.
  KDA     chunked form, Kimi Linear report Eq. 13 per value head: 6 K^2 + 3 C K + C^2 (C = chunk size); the same
          estimate for Gated DeltaNet (per-head decay).
  Mamba-2 the SSD scan as Megatron estimates it: 7 * Di * ds.
  AttnRes each mix over n sources (ModelSpec.attn_res_sources: n grows with depth): scores and weighted sum,
          4 * d * n, counted with the attention terms (the per-source RMS, like the norms, is not counted).
  LM head 2 * d * V.
  MTP     per module: its blocks + eh_proj 2 * 2d * d + the shared LM head 2 * d * V (reported apart).
Agreement with Megatron-LM `num_floating_point_operations` (standard GQA / MLA / MoE / LatentMoE): the same terms
layer by layer, except that Megatron adds q_lora_rank + kv_lora_rank per MLA layer for the latent norms (~1e-5
relative) and omits the Mamba conv1d; Megatron adds MTP layers to the total when it trains them (here:
mtp_train_flops_per_token).

Activation bytes per token per layer (bf16 = 2 B/element, fp32 = 4 B): the tensors autograd keeps for backward
without recompute, with fused attention kernels (O and the fp32 log-sum-exp, never S x S) and the KDA / SSD
kernels recomputing chunk states (PartWork.autograd_saved_bytes: work.py lists the terms where it sets them).
Dispatch bytes per MoE layer, token and direction: top_k * width * 2 (bf16), width = latent size for LatentMoE else d.

Legend: d hidden, V vocab, S sequence length, H heads, K KDA head dim, N/R/V MLA nope/rope/value dims, C kv_lora.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moestack.config.base import ConfigError
from moestack.config.model_spec import ModelSpec, load_model_spec
from moestack.planner.cost.work import BF16, FP32, LayerWork, ModelWork, PartWork, add_attn_res, model_work


@dataclass
class LayerProfile:
    index: int  # 1-based
    mixer: str  # "kda" | "mla" | "gqa" | "mamba2" | "none"
    ffn: str  # "dense" | "moe" | "none"
    params: int
    activated_params: int
    fwd_matmul_flops_per_token: float
    fwd_attn_flops_per_token: float  # seq-len dependent terms (softmax attn, KDA chunk terms, DSA, SSD scan)
    act_bytes_per_token: float  # bytes saved for backward per token, bf16, no recompute (module docstring)
    dispatch_bytes_per_token: float  # MoE: top_k * width * 2 per direction; else 0
    fwd_router_flops_per_token: float = 0.0  # 2 * d * E, not part of model FLOPs (Megatron convention)

    @property
    def fwd_flops_per_token(self) -> float:
        return self.fwd_matmul_flops_per_token + self.fwd_attn_flops_per_token


@dataclass
class ArchProfile:
    model_type: str
    name: str
    seq_len: int
    layers: list[LayerProfile]
    embedding_params: int
    head_params: int
    other_params: int  # final norm + MTP + vision (reported; only the final norm is in total_params)
    total_params: int
    activated_params: int
    fwd_flops_per_token: float
    train_flops_per_token: float  # fwd + bwd (3x fwd, the Megatron convention)
    final_norm_params: int = 0
    mtp_params: int = 0  # next-n prediction modules (embedding and head shared): counted, not trained
    mtp_activated_params: int = 0
    mtp_train_flops_per_token: float = 0.0
    vision_params: int = 0  # vision tower + projector (estimate from an HF vision_config)
    router_train_flops_per_token: float = 0.0  # 3 x sum of the router GEMMs, outside model FLOPs
    head_act_bytes_per_token: float = 0.0  # final norm input + head input (chunked loss keeps no logits)
    quantization: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def by_type(self) -> list[dict[str, Any]]:
        """Layers grouped by (mixer, ffn): count, and per-layer values of one layer of the group."""
        groups: dict[tuple[str, str], list[LayerProfile]] = {}
        for lp in self.layers:
            groups.setdefault((lp.mixer, lp.ffn), []).append(lp)
        out = []
        for (mixer, ffn), lps in groups.items():
            first = lps[0]
            out.append(
                {
                    "mixer": mixer,
                    "ffn": ffn,
                    "count": len(lps),
                    "layers": [lp.index for lp in lps],
                    "params": first.params,
                    "activated_params": first.activated_params,
                    "fwd_flops_per_token": first.fwd_flops_per_token,
                    "act_bytes_per_token": first.act_bytes_per_token,
                    "dispatch_bytes_per_token": first.dispatch_bytes_per_token,
                }
            )
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for layer, lp in zip(d["layers"], self.layers):
            layer["fwd_flops_per_token"] = lp.fwd_flops_per_token
        d["flops_per_token"] = self.train_flops_per_token  # training FLOPs per token (model FLOPs, for MFU)
        d["layer_types"] = self.by_type()
        return d


# ---------------------------------------------------------------------------------------------- per layer


def _causal_keys(seq_len: int, top_k: int | None = None) -> float:
    """Mean number of keys a causal query attends to: S/2 (Megatron's convention), capped by top_k."""
    if top_k is None or seq_len <= top_k:
        return seq_len / 2
    return top_k - top_k * top_k / (2 * seq_len)


def _mla_attn_flops(spec: ModelSpec, seq_len: int) -> float:
    m = spec.mla
    per_key = 2 * m.num_heads * (m.qk_head_dim + m.v_head_dim)
    ix = m.indexer
    if ix is None:
        return per_key * _causal_keys(seq_len)
    return per_key * _causal_keys(seq_len, ix.top_k) + 2 * ix.num_heads * (ix.head_dim + 1) * _causal_keys(seq_len)


def _seq_flops(spec: ModelSpec, part: PartWork, seq_len: int) -> float:
    """The sequence-dependent forward FLOPs of one token in `part` (module docstring). Softmax attention counts
    _causal_keys, Megatron's S/2 per query, where the cost model prices the (S+1)/2 pairs a kernel runs."""
    if part.kind == "gqa":
        return 2 * spec.gqa.num_heads * (2 * spec.gqa_head_dim) * _causal_keys(seq_len, part.window)
    if part.kind == "mla":
        return _mla_attn_flops(spec, seq_len)
    return part.kda_flops


def _layer_profile(spec: ModelSpec, layer: LayerWork, seq_len: int) -> LayerProfile:
    parts = layer.parts
    # the router is reported apart; a depthwise conv costs 2 FLOPs per weight
    matmul = sum(p.fwd_gemm_flops() - p.fwd_router_flops() + 2 * p.conv_params for p in parts)
    attn = sum(p.attn_res_flops for p in parts) + sum(_seq_flops(spec, p, seq_len) for p in parts)
    return LayerProfile(
        index=layer.index,
        mixer=layer.kind.mixer,
        ffn=layer.kind.ffn,
        params=layer.params,
        activated_params=sum(p.activated_params for p in parts),
        fwd_matmul_flops_per_token=matmul,
        fwd_attn_flops_per_token=attn,
        act_bytes_per_token=float(sum(p.autograd_saved_bytes for p in parts)),
        dispatch_bytes_per_token=float(sum(p.top_k * p.dispatch_width * BF16 for p in parts)),
        fwd_router_flops_per_token=sum(p.fwd_router_flops() for p in parts),
    )


def profile_model(spec: ModelSpec, seq_len: int, extras: Any = None) -> ArchProfile:
    """Per-layer and total parameters, FLOPs per token at `seq_len`, activation and dispatch bytes.

    spec: any valid ModelSpec (including profile-only parts such as Mamba-2 layers); seq_len: tokens per sequence
    (> 0). extras: optional moestack.config.hf.HFExtras (vision tower count, quantization block, notes).
    """
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be > 0, got {seq_len}")
    d, V = spec.hidden_size, spec.vocab_size
    work = model_work(spec, seq_len)
    layers = [_layer_profile(spec, lw, seq_len) for lw in work.layers if not lw.is_mtp]
    mtp = [_layer_profile(spec, lw, seq_len) for lw in work.layers if lw.is_mtp]

    head = 0 if spec.tie_word_embeddings else d * V
    out_mix = PartWork("attn_res")  # Attention Residuals: the output mix over every block, before the final norm
    if spec.attn_res_block_size is not None:
        add_attn_res(out_mix, d, spec.attn_res_blocks_before(spec.num_layers) + 1)
    final_norm = d * (2 if spec.norm == "layernorm" else 1) + out_mix.other_params
    head_flops = 2 * d * V

    mtp_proj = spec.mtp_layers * work.mtp_proj_params  # eh_proj 2d -> d and the module's 3 norms
    mtp_matmul = spec.mtp_layers * 2 * 2 * d * d + sum((lp.fwd_matmul_flops_per_token for lp in mtp), 0.0)
    mtp_flops = mtp_matmul + sum(lp.fwd_attn_flops_per_token for lp in mtp) + spec.mtp_layers * head_flops
    mtp_params = mtp_proj + sum(lp.params for lp in mtp)

    vision = int(getattr(extras, "vision_params", 0) or 0)
    total = work.embed_params + sum(lp.params for lp in layers) + final_norm + head
    activated = sum(lp.activated_params for lp in layers) + final_norm + d * V
    fwd = sum(lp.fwd_flops_per_token for lp in layers) + out_mix.attn_res_flops + head_flops
    notes = list(getattr(extras, "notes", []) or [])
    if spec.moe is not None and spec.moe.router.selection_bias:
        notes.append("router selection bias: a buffer of num_experts fp32 values per MoE layer, not a parameter")
    if spec.mtp_layers:
        notes.append(f"{spec.mtp_layers} MTP module(s): counted in mtp_params / mtp_train_flops, not trained")
    if vision:
        notes.append(getattr(extras, "vision_note", "") or "vision tower counted, not trained")
    notes.extend(spec.build_support_errors())
    return ArchProfile(
        model_type=spec.family or "moestack",
        name=spec.name,
        seq_len=seq_len,
        layers=layers,
        embedding_params=work.embed_params,
        head_params=head,
        other_params=final_norm + mtp_params + vision,
        total_params=total,
        activated_params=activated,
        fwd_flops_per_token=fwd,
        train_flops_per_token=3 * fwd,
        final_norm_params=final_norm,
        mtp_params=mtp_params,
        mtp_activated_params=mtp_proj + sum(lp.activated_params for lp in mtp),
        mtp_train_flops_per_token=3 * mtp_flops,
        vision_params=vision,
        router_train_flops_per_token=3 * sum(lp.fwd_router_flops_per_token for lp in layers),
        head_act_bytes_per_token=2 * d * BF16 + FP32 + out_mix.autograd_saved_bytes,
        quantization=_quantization_report(work, head, extras),
        notes=notes,
    )


def _quantization_report(work: ModelWork, head: int, extras: Any) -> dict[str, Any] | None:
    """The checkpoint's quantization block with an estimate of its weight bytes (quantized groups at their width
    plus scales, the rest bf16)."""
    quant = getattr(extras, "quantization", None)
    if not quant:
        return None
    from moestack.config.hf import quantized_categories

    cats = quantized_categories(quant)
    groups = _param_groups(work, head)
    bits = quant.get("bits") or 16
    if quant.get("block"):
        scale = FP32 / (quant["block"][0] * quant["block"][1])  # one fp32 scale per block
    elif quant.get("group_size"):
        scale = 1 / quant["group_size"]  # one 8-bit scale per group
    else:
        scale = 0.0
    nbytes = sum(n * (bits / 8 + scale) if cat in cats else n * BF16 for cat, n in groups.items())
    return {**quant, "quantized": sorted(cats & set(groups)), "checkpoint_bytes_estimate": nbytes}


# the quantization category (moestack.config.hf.quantized_categories) of a GEMM; "attention" holds the rest
_QUANT_GROUP = {"expert.up": "routed_experts", "expert.down": "routed_experts", "shared.up": "shared_experts",
                "shared.down": "shared_experts", "mlp.up": "dense_mlp", "mlp.down": "dense_mlp"}


def _param_groups(work: ModelWork, head: int) -> dict[str, int]:
    """Parameters of the trained model split into the categories a quantization block names, by GEMM."""
    groups = {"embedding": work.embed_params, "lm_head": head, "routed_experts": 0, "shared_experts": 0,
              "dense_mlp": 0, "attention": 0}
    for part in (p for lw in work.layers if not lw.is_mtp for p in lw.parts):
        for g in part.gemms:
            groups[_QUANT_GROUP.get(g.name, "attention")] += g.params * (part.num_experts if g.expert else 1)
        groups["attention"] += part.other_params + part.expert_bias * part.num_experts  # norms, biases, convs
    return groups


# ---------------------------------------------------------------------------------------------- loading


def load_any_model(name_or_path: str | Path) -> tuple[ModelSpec, Any]:
    """(spec, extras): extras is an HFExtras for an HF config.json (vision, quantization, notes), else None."""
    from moestack.config.hf import is_hf_config, load_hf_config

    p = Path(name_or_path)
    if p.is_dir() and (p / "config.json").is_file():
        p = p / "config.json"
    if p.suffix == ".json":
        if not p.is_file():
            raise ConfigError(f"{p}: file not found")
        _check_json(p)
        if not is_hf_config(p):
            raise ConfigError(f"{p}: not an HF config.json (no model_type / architectures)")
        imp = load_hf_config(p)
        return imp.spec, imp.extras
    return load_model_spec(name_or_path), None


def _check_json(p: Path) -> None:
    """ConfigError naming where a .json file stops being JSON (a truncated download, a stray comma)."""
    import json

    try:
        json.loads(p.read_text())
    except UnicodeDecodeError as err:
        raise ConfigError(f"{p}: not UTF-8 text (byte {err.start}); is it a config.json?") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{p}: line {err.lineno} column {err.colno}: not valid JSON ({err.msg}); the file is "
                          "truncated or edited: fetch it again") from None


def load_any_model_spec(name_or_path: str | Path) -> ModelSpec:
    """A preset name, a moestack ModelSpec YAML, or an HF config.json (or a directory holding one)."""
    return load_any_model(name_or_path)[0]
