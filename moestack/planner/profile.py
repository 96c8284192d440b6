"""Exact architecture profile: parameters, FLOPs, activation bytes and dispatch bytes, per layer and in total.

Parameters mirror moestack.model module by module (no biases unless the spec says so):
  block   2 RMSNorm(d) (attn_norm, ffn_norm); a single-sublayer block (layer_pattern) has one RMSNorm(d);
          Attention Residuals add two mixes per block and one at the output (counted with the final norm), each
          a norm weight [d] and a Linear(d, 1) weight [1, d] (their product is the pseudo-query).
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
          gated norm [Di]; out_proj Di -> d.
  model   embedding V*d (+ S*d learned positions); final RMSNorm [d]; LM head d*V (0 when tied to the embedding).
  GPT-2/3 parts (profiled, not built): norm layernorm = weight + bias [2d] per norm; gelu = one up matrix (as relu2);
          linear_bias = biases on q/k/v (GQA qkv_bias), the output projection, the MLP / expert up and down layers.
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
kernels recomputing chunk states; each `_*_cost` helper lists its terms where it calls `save`. Dispatch bytes per MoE
layer, token and direction: top_k * width * 2 (bf16), width = latent size for LatentMoE else d.

Legend: d hidden, V vocab, S sequence length, H heads, K KDA head dim, N/R/V MLA nope/rope/value dims, C kv_lora.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moestack.config.base import ConfigError
from moestack.config.model_spec import LayerKind, ModelSpec, load_model_spec

BF16, FP32, INT64 = 2, 4, 8


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


# ---------------------------------------------------------------------------------------------- per-module cost


@dataclass
class _Cost:
    params: int = 0
    activated: int = 0
    matmul: float = 0.0  # forward FLOPs per token
    attn: float = 0.0
    router: float = 0.0
    act_bytes: float = 0.0

    def linear(self, n_in: int, n_out: int, bias: bool = False) -> None:
        self.params += n_in * n_out + (n_out if bias else 0)
        self.activated += n_in * n_out + (n_out if bias else 0)
        self.matmul += 2 * n_in * n_out

    def vector(self, n: int) -> None:
        """Norm weights, scalar gate parameters, biases outside a Linear: parameters without matmul FLOPs."""
        self.params += n
        self.activated += n

    def save(self, elems: float, nbytes: int = BF16) -> None:
        self.act_bytes += elems * nbytes

    def __iadd__(self, other: _Cost) -> _Cost:
        for name in ("params", "activated", "matmul", "attn", "router", "act_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


def _glu_mult(spec: ModelSpec) -> int:
    return 3 if spec.gated_mlp else 2


def _mlp(c: _Cost, d: int, inter: int, mult: int, bias: bool = False) -> None:
    """Dense (or shared-expert) MLP: gate/up d -> I (one of them for relu2 / gelu), down I -> d."""
    for _ in range(mult - 1):
        c.linear(d, inter, bias)
    c.linear(inter, d, bias)
    # saved: gate and up outputs (activation inputs), the activation output (down_proj input)
    c.save(mult * inter)


def _kda_cost(spec: ModelSpec) -> _Cost:
    d, k = spec.hidden_size, spec.kda
    H, Hv, K = k.num_heads, k.value_heads, k.head_dim
    qk, vd = H * K, Hv * K
    G = Hv * K if k.decay == "channel" else Hv
    c = _Cost()
    c.linear(d, qk)  # q_proj
    c.linear(d, qk)  # k_proj
    c.linear(d, vd)  # v_proj
    conv = (2 * qk + vd) * k.conv_kernel_size  # depthwise convs: one weight per (channel, tap)
    c.params += conv
    c.activated += conv
    c.matmul += 2 * conv
    if k.gate_rank is None:
        c.linear(d, G)  # f_proj
    else:
        c.linear(d, k.gate_rank)  # f_a_proj
        c.linear(k.gate_rank, G)  # f_b_proj
    c.vector(Hv)  # A_log
    c.vector(G)  # dt_bias
    c.linear(d, Hv)  # b_proj
    if k.output_gate_rank is None:
        c.linear(d, vd)  # g_proj
    else:
        c.linear(d, k.output_gate_rank)
        c.linear(k.output_gate_rank, vd)
    c.vector(K)  # o_norm
    c.linear(vd, d)  # o_proj
    C = k.chunk_size
    c.attn = Hv * (6 * K * K + 3 * C * K + C * C)
    # saved: input; proj outs (conv in), conv outs (SiLU in), SiLU outs; L2-normed q, k; low-rank decay/gate
    # hiddens; decay input; o, o_norm out, gate pre-activation, gated o (o_proj in); fp32 log-decay and beta.
    c.save(d + 3 * (2 * qk + vd) + 2 * qk + (k.gate_rank or 0) + G + (k.output_gate_rank or 0) + Hv + 4 * vd)
    c.save(G + Hv, FP32)
    return c


def _causal_keys(seq_len: int, top_k: int | None = None) -> float:
    """Mean number of keys a causal query attends to: S/2 (Megatron's convention), capped by top_k."""
    if top_k is None or seq_len <= top_k:
        return seq_len / 2
    return top_k - top_k * top_k / (2 * seq_len)


def _mla_cost(spec: ModelSpec, seq_len: int) -> _Cost:
    d, m = spec.hidden_size, spec.mla
    H, N, R, C, V = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
    c = _Cost()
    if m.q_lora_rank is not None:
        c.linear(d, m.q_lora_rank)
        c.vector(m.q_lora_rank)
        c.linear(m.q_lora_rank, H * (N + R))
        c.save(2 * m.q_lora_rank)  # q_a out (norm in), q_a_norm out (q_b in)
    else:
        c.linear(d, H * (N + R))
    c.linear(d, C + R)  # kv_a_proj
    c.vector(C)  # kv_a_norm
    c.linear(C, H * (N + V))  # kv_b_proj
    if m.output_gate:
        c.linear(d, H * V)
        c.save(2 * H * V)  # gate pre-activation, gated output (o_proj in)
    c.linear(H * V, d)  # o_proj
    c.save(d + (C + R) + C + H * V)  # input, kv_a out, kv_a_norm out, attention output O
    c.save(H, FP32)  # log-sum-exp
    ix = m.indexer
    if ix is None:
        c.attn = 2 * H * (N + R + V) * _causal_keys(seq_len)
        c.save(H * (N + R) + H * (N + R) + H * V)  # q, k, v of the attention kernel
        return c
    q_in = m.q_lora_rank if m.q_lora_rank is not None else d
    c.linear(q_in, ix.num_heads * ix.head_dim)  # wq
    c.linear(d, ix.head_dim)  # wk
    c.vector(2 * ix.head_dim)  # k_norm: LayerNorm weight + bias
    c.linear(d, ix.num_heads)  # weights_proj
    c.attn = 2 * H * (N + R + V) * _causal_keys(seq_len, ix.top_k)
    c.attn += 2 * ix.num_heads * (ix.head_dim + 1) * _causal_keys(seq_len)
    # sparse MQA form: absorbed query [H, C+R], latent output [H, C] (the latent keys are kv_a's output), the
    # top-k indices; indexer q, k (pre/post LayerNorm) and head weights
    c.save(H * (C + R) + H * C + ix.num_heads * ix.head_dim + 2 * ix.head_dim + ix.num_heads)
    c.save(ix.top_k, FP32)  # int32 indices
    return c


def _gqa_cost(spec: ModelSpec, seq_len: int, window: int | None = None) -> _Cost:
    d, g = spec.hidden_size, spec.gqa
    H, G, E = g.num_heads, g.num_kv_heads, spec.gqa_head_dim
    c = _Cost()
    c.linear(d, H * E, g.qkv_bias)
    c.linear(d, G * E, g.qkv_bias)
    c.linear(d, G * E, g.qkv_bias)
    if g.qk_norm:
        c.vector(2 * E)
        c.save((H + G) * E)  # norm inputs
    if g.output_gate:
        c.linear(d, H * E)
        c.save(2 * H * E)
    c.linear(H * E, d, spec.linear_bias)
    c.attn = 2 * H * (E + E) * _causal_keys(seq_len, window)  # a sliding window caps the keys like DSA's top-k
    c.save(d + (H + 2 * G) * E + H * E)  # input, q, k, v, O
    c.save(H, FP32)
    return c


def _mamba2_cost(spec: ModelSpec) -> _Cost:
    d, m = spec.hidden_size, spec.mamba2
    di, ng, ds, nh = m.inner_size, m.num_groups, m.state_size, m.num_heads
    conv_dim = di + 2 * ng * ds
    in_out = 2 * di + 2 * ng * ds + nh
    c = _Cost()
    c.linear(d, in_out, m.proj_bias)
    conv = conv_dim * m.conv_kernel_size
    c.params += conv + (conv_dim if m.conv_bias else 0)
    c.activated += conv + (conv_dim if m.conv_bias else 0)
    c.matmul += 2 * conv
    c.vector(3 * nh)  # dt_bias, A_log, D
    c.vector(di)  # gated RMSNorm
    c.linear(di, d, m.proj_bias)
    c.attn = 7 * di * ds
    c.save(d + in_out + 2 * conv_dim + 2 * di)  # input, in_proj out, conv out, SiLU out, y, norm out
    c.save(nh, FP32)  # dt
    return c


def _moe_cost(spec: ModelSpec) -> tuple[_Cost, float]:
    d, m = spec.hidden_size, spec.moe
    E, k, inter = m.num_experts, m.top_k, m.expert_intermediate_size
    mult = _glu_mult(spec)
    width = m.latent_size or d
    c = _Cost()
    c.params += E * d  # router weight (the selection bias is a buffer)
    c.activated += E * d
    c.router = 2 * E * d
    c.save(d)  # input (router, down_proj and shared experts read the same tensor)
    c.save(E + k, FP32)  # router scores, top-k weights
    c.save(k, INT64)  # top-k ids
    if m.latent_size is not None:
        c.linear(d, width)  # down_proj
        c.linear(width, d)  # up_proj
        c.save(3 * width)  # latent h, combined y (norm in), norm out (up_proj in)
        if m.latent_norm:
            c.vector(width)
    expert = mult * width * inter
    if spec.linear_bias:  # up (and gate) [I] and down [width] biases per expert, outside the matmul FLOPs
        c.params += E * ((mult - 1) * inter + width)
        c.activated += k * ((mult - 1) * inter + width)
    c.params += E * expert
    c.activated += k * expert
    c.matmul += 2 * k * expert
    c.save(k * (2 * width + mult * inter))  # per routed slot: expert input, output, gate/up and activation
    if m.num_shared_experts:
        _mlp(c, d, m.shared_intermediate_size, mult, spec.linear_bias)
        if m.shared_expert_gate:
            c.linear(d, 1)
            c.save(1)
    dispatch = k * width * BF16
    return c, dispatch


def _dense_cost(spec: ModelSpec) -> _Cost:
    c = _Cost()
    _mlp(c, spec.hidden_size, spec.dense_mlp.intermediate_size, _glu_mult(spec), spec.linear_bias)
    c.save(spec.hidden_size)  # input
    return c


def _attn_res_cost(d: int, n_sources: int) -> _Cost:
    """One Attention-Residual mix (moestack.model.attn_res) over n sources: norm weight [d] and proj weight [1, d];
    4 d n FLOPs (module docstring); saved: its output (the next norm's input; the sources are the residual stream,
    saved anyway) and, per source, the softmax weight and rstd (fp32)."""
    c = _Cost()
    c.vector(2 * d)
    c.attn = 4.0 * d * n_sources
    c.save(d)
    c.save(2 * n_sources, FP32)
    return c


def _block_cost(spec: ModelSpec, kind: LayerKind, seq_len: int, layer: int | None = None) -> tuple[_Cost, float]:
    """One block; `layer` (0-based) places it in the depth for Attention Residuals (None: MTP blocks, no mixes)."""
    d = spec.hidden_size
    c = _Cost()
    n_norms = 2 if spec.layer_pattern is None else 1
    ln = 2 if spec.norm == "layernorm" else 1  # LayerNorm: weight + bias; saves mean and rstd
    c.vector(n_norms * d * ln)
    c.save(n_norms * d)  # the residual stream each norm reads (with AttnRes: the partial sums the mixes read)
    c.save(n_norms * ln, FP32)  # rstd (and mean)
    if spec.attn_res_block_size is not None and layer is not None:
        for n in spec.attn_res_sources(layer):  # before the mixer, before the ffn
            c += _attn_res_cost(d, n)
    if kind.mixer == "kda":
        c += _kda_cost(spec)
    elif kind.mixer == "mla":
        c += _mla_cost(spec, seq_len)
    elif kind.mixer == "gqa":
        c += _gqa_cost(spec, seq_len, kind.window)
    elif kind.mixer == "mamba2":
        c += _mamba2_cost(spec)
    dispatch = 0.0
    if kind.ffn == "dense":
        c += _dense_cost(spec)
    elif kind.ffn == "moe":
        moe, dispatch = _moe_cost(spec)
        c += moe
    return c, dispatch


def _layer_profile(index: int, kind: LayerKind, c: _Cost, dispatch: float) -> LayerProfile:
    return LayerProfile(
        index=index,
        mixer=kind.mixer,
        ffn=kind.ffn,
        params=c.params,
        activated_params=c.activated,
        fwd_matmul_flops_per_token=c.matmul,
        fwd_attn_flops_per_token=c.attn,
        act_bytes_per_token=c.act_bytes,
        dispatch_bytes_per_token=dispatch,
        fwd_router_flops_per_token=c.router,
    )


def profile_model(spec: ModelSpec, seq_len: int, extras: Any = None) -> ArchProfile:
    """Per-layer and total parameters, FLOPs per token at `seq_len`, activation and dispatch bytes.

    spec: any valid ModelSpec (including profile-only parts such as Mamba-2 layers); seq_len: tokens per sequence
    (> 0). extras: optional moestack.config.hf.HFExtras (vision tower count, quantization block, notes).
    """
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be > 0, got {seq_len}")
    d, V = spec.hidden_size, spec.vocab_size
    layers = []
    for i, kind in enumerate(spec.layer_kinds(), 1):
        cost, dispatch = _block_cost(spec, kind, seq_len, i - 1)
        layers.append(_layer_profile(i, kind, cost, dispatch))

    embedding = V * d + (spec.max_seq_len * d if spec.learned_positions else 0)  # + the position table
    head = 0 if spec.tie_word_embeddings else d * V
    out_mix = _Cost()  # Attention Residuals: the output mix over every block, before the final norm
    if spec.attn_res_block_size is not None:
        out_mix = _attn_res_cost(d, spec.attn_res_blocks_before(spec.num_layers) + 1)
    final_norm = d * (2 if spec.norm == "layernorm" else 1) + out_mix.params
    head_flops = 2 * d * V

    mtp = _Cost()
    for _ in range(spec.mtp_layers):
        mtp.vector(3 * d)  # enorm, hnorm, final norm of the module
        mtp.linear(2 * d, d)  # eh_proj
        for kind in spec.mtp_block_kinds():
            cost, _ = _block_cost(spec, kind, seq_len)
            mtp += cost
    mtp_flops = mtp.matmul + mtp.attn + spec.mtp_layers * head_flops

    vision = int(getattr(extras, "vision_params", 0) or 0)
    layer_params = sum(lp.params for lp in layers)
    total = embedding + layer_params + final_norm + head
    activated = sum(lp.activated_params for lp in layers) + final_norm + d * V
    fwd = sum(lp.fwd_flops_per_token for lp in layers) + out_mix.attn + head_flops
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
        embedding_params=embedding,
        head_params=head,
        other_params=final_norm + mtp.params + vision,
        total_params=total,
        activated_params=activated,
        fwd_flops_per_token=fwd,
        train_flops_per_token=3 * fwd,
        final_norm_params=final_norm,
        mtp_params=mtp.params,
        mtp_activated_params=mtp.activated,
        mtp_train_flops_per_token=3 * mtp_flops,
        vision_params=vision,
        router_train_flops_per_token=3 * sum(lp.fwd_router_flops_per_token for lp in layers),
        head_act_bytes_per_token=2 * d * BF16 + FP32 + out_mix.act_bytes,
        quantization=_quantization_report(spec, layers, embedding, head, extras),
        notes=notes,
    )


def _quantization_report(
    spec: ModelSpec, layers: list[LayerProfile], embedding: int, head: int, extras: Any
) -> dict[str, Any] | None:
    """The checkpoint's quantization block with an estimate of its weight bytes (quantized groups at their width
    plus scales, the rest bf16)."""
    quant = getattr(extras, "quantization", None)
    if not quant:
        return None
    from moestack.config.hf import quantized_categories

    cats = quantized_categories(quant)
    groups = _param_groups(spec, layers, embedding, head)
    bits = quant.get("bits") or 16
    if quant.get("block"):
        scale = FP32 / (quant["block"][0] * quant["block"][1])  # one fp32 scale per block
    elif quant.get("group_size"):
        scale = 1 / quant["group_size"]  # one 8-bit scale per group
    else:
        scale = 0.0
    nbytes = sum(n * (bits / 8 + scale) if cat in cats else n * BF16 for cat, n in groups.items())
    return {**quant, "quantized": sorted(cats & set(groups)), "checkpoint_bytes_estimate": nbytes}


def _param_groups(spec: ModelSpec, layers: list[LayerProfile], embedding: int, head: int) -> dict[str, int]:
    """Parameters split into the categories a quantization block names (attention, experts, ...)."""
    groups = {"embedding": embedding, "lm_head": head, "routed_experts": 0, "shared_experts": 0, "dense_mlp": 0}
    rest = sum(lp.params for lp in layers)
    if spec.moe is not None:
        m = spec.moe
        mult = _glu_mult(spec)
        n_moe = sum(lp.ffn == "moe" for lp in layers)
        groups["routed_experts"] = n_moe * m.num_experts * mult * (m.latent_size or spec.hidden_size) * (
            m.expert_intermediate_size
        )
        groups["shared_experts"] = n_moe * mult * spec.hidden_size * m.shared_intermediate_size
    if spec.dense_mlp is not None:
        n_dense = sum(lp.ffn == "dense" for lp in layers)
        groups["dense_mlp"] = n_dense * _glu_mult(spec) * spec.hidden_size * spec.dense_mlp.intermediate_size
    groups["attention"] = rest - groups["routed_experts"] - groups["shared_experts"] - groups["dense_mlp"]
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
