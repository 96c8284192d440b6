"""Cost model: memory per device and time per step of one Plan, from the model's shapes and the cluster.

Three layers, read top to bottom:
  1. Work      what one token costs in each sub-layer, forward: the GEMMs (with their shapes and how tensor
               parallelism splits them), attention / KDA / sparse-attention FLOPs, elementwise HBM traffic, saved
               activation bytes and parameters. Pure shape arithmetic from the ModelSpec.
  2. Terms     one function per physical term, each with its source: GEMM time (calibrated efficiency), flash /
               KDA / sparse attention time, elementwise time (HBM roofline), alpha-beta collectives per network
               tier (ring all-reduce / reduce-scatter / all-gather, flat and hierarchical all-to-all, p2p),
               pipeline bubbles per schedule, in-flight micro-batches per schedule, optimizer and offload time.
  3. evaluate  assembles the terms for a Plan into a PlanCost: memory breakdown, time breakdown, step time,
               tokens/s, TFLOP/s per device and MFU (model FLOPs from the profile), and the binding constraint.

Legend: T tokens, h hidden size, s sequence length, H heads, E experts, k top-k, L latent width, I intermediate
size, V vocab, p = pp, v = vpp, m micro-batches per step. Bytes: bf16 = 2. "per token" is always forward.
Model FLOPs (MFU) come from `profile.profile_model` (Megatron's definition); the GEMM list here is the hardware
work, which additionally counts recompute, replicated MLA down-projections under TP, and FlashAttention's
backward recompute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moestack.config.cluster import GIB, ClusterSpec
from moestack.config.model_spec import LayerKind, ModelSpec
from moestack.config.plan import V_SHAPE, Plan, RecomputePolicy
from moestack.planner.adapt import LOSS_BYTES_PER_LOGIT, LOSS_CHUNK_TOKENS  # the chunked loss, as adapt.py prices it
from moestack.planner.calibration import Calibration, CommCalibration
from moestack.planner.host_profile import framework_of, host_calibration

BF16 = 2
FP32 = 4
# activation offload (moestack.memory.offload.ActivationOffloader, max_inflight=2): two layers' saved tensors wait for
# their device-to-host copies while a third is produced (the copies are slower than the compute that fills them);
# a prior: Calibration.act_factors['activation_offload'] scales it (0.58 measured on the H200, ~1.7 layers)
ACT_OFFLOAD_LAYERS = 3

# ------------------------------------------------------------------------------------------------------------
# 1. Work per token
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gemm:
    """[tokens, k] @ [k, n], `copies` times per token (top-k copies for routed experts).

    split: how tensor parallelism divides it: "col" (n / tp), "row" (k / tp), "rep" (every rank does all of it,
    e.g. MLA down-projections on the gathered sequence). Experts split by etp instead of tp.
    seq_shard: a replicated weight that runs on the rank's sequence shard only (T / tp rows) under TP: the MoE
    router and latent projections (moestack/parallel/tensor.py runs the MoE token-sharded).
    """

    name: str
    n: int
    k: int
    split: str = "col"
    copies: int = 1
    expert: bool = False
    fp8: bool = True  # runs in FP8 under the fp8 recipe (routers, LM head and attention cores stay bf16/fp32)
    fp32: bool = False  # router: computed in fp32 (tf32 units where the device has them)
    selective: bool = False  # recomputed under the "selective" policy (MLA up-projections)
    seq_shard: bool = False  # with split "rep": runs on the SP shard (T / tp rows), weight replicated

    @property
    def params(self) -> int:
        return self.n * self.k


@dataclass
class PartWork:
    """One sub-layer (a mixer or an FFN) for one token, forward."""

    kind: str  # kda | mla | gqa | mamba2 | dense | moe
    gemms: list[Gemm] = field(default_factory=list)
    attn_flops: float = 0.0  # flash (dense causal) attention core, all heads
    sparse_attn_flops: float = 0.0  # DSA top-k attention core (MQA form over the shared latent)
    kda_flops: float = 0.0  # chunked KDA / SSD scan core, all heads
    indexer_flops: float = 0.0  # lightning-indexer scores
    topk_elems: float = 0.0  # scores scanned by top-k selection
    elem_bytes: float = 0.0  # elementwise HBM traffic (norms, activations, gates, permutes), split by tp (SP)
    act_keep: float = 0.0  # saved bytes that stay under "selective"
    act_selective: float = 0.0  # saved bytes "selective" drops (recomputed)
    act_replicated: float = 0.0  # saved bytes not split by tp (replicated MLA latents)
    expert_act: float = 0.0  # saved bytes per token on the expert side (already x top_k)
    expert_act_selective: float = 0.0  # of which "selective" drops (expert activation outputs, `moe_act`)
    fp8_saved: float = 0.0  # saved GEMM inputs that the fp8 recipe stores in 1 byte instead of 2 (kept part)
    expert_fp8_saved: float = 0.0  # the same on the expert side
    other_params: int = 0  # parameters outside the GEMMs (norms, conv, biases, A_log, ...)
    expert_bias: int = 0  # per routed expert: its biases (ModelSpec.linear_bias)
    conv_params: int = 0  # of which depthwise short-conv weights (2 FLOPs each per token; elementwise-priced)
    dispatch_width: int = 0  # MoE: width of a dispatched token (latent or hidden)
    top_k: int = 0
    num_experts: int = 0
    tp_comm: bool = True  # one all-gather in / reduce-scatter out under sequence-parallel TP
    heads: int = 0  # DSA sparse attention: attention heads (the kernels pay per block of DSA_HEAD_BLOCK heads)
    # the sequence-parallel region (pre-norm and residual, outside the TP GEMMs): split by tp only under sequence
    # parallelism; plain TP keeps them whole on every rank (Korthikanti et al. 2022, Sec. 4.2.2: the "10 sbh")
    sp_keep: float = 0.0  # saved per token there: the norm input (kept under selective)
    sp_sel: float = 0.0  # the norm output, input of the first TP GEMM (selective recomputes the norm)
    sp_elem: float = 0.0  # elementwise bytes per token there (norm read / write, residual add)
    # saved tensors a framework may store differently (megatron_saved_delta): the attention output feeding the output
    # projection (in act_keep), the activation outputs feeding down projections (dense / shared MLP, in
    # act_selective) and the routed experts' outputs kept for the combine's backward (in expert_act)
    o_in: float = 0.0
    fc2_in: float = 0.0
    expert_out: float = 0.0
    # the activation function's inputs (gate / up outputs): dense and shared MLP (in act_keep), experts (in expert_act)
    fc1_out: float = 0.0
    expert_fc1_out: float = 0.0
    window: int | None = None  # sliding-window attention: keys per query

    @property
    def dense_params(self) -> int:
        return sum(g.params for g in self.gemms if not g.expert) + self.other_params

    @property
    def expert_params(self) -> int:
        # per-expert GEMMs are listed once with copies = top_k; the layer holds num_experts of them
        return (sum(g.params for g in self.gemms if g.expert) + self.expert_bias) * self.num_experts

    def fwd_gemm_flops(self) -> float:
        return sum(2.0 * g.n * g.k * g.copies for g in self.gemms)

    @property
    def act_none(self) -> float:
        return self.act_keep + self.act_selective + self.act_replicated + self.expert_act + self.expert_act_selective


@dataclass
class LayerWork:
    index: int  # 1-based; MTP blocks continue after num_layers
    kind: LayerKind
    parts: list[PartWork]
    is_mtp: bool = False

    @property
    def params(self) -> int:
        return sum(p.dense_params + p.expert_params for p in self.parts)


@dataclass
class ModelWork:
    spec: ModelSpec
    seq_len: int
    layers: list[LayerWork]  # decoder layers then MTP blocks
    embed_params: int
    head: Gemm  # LM head (one per output: main + each MTP module)
    num_heads_out: int  # 1 + mtp modules
    mtp_proj_params: int  # MTP eh_proj (2h -> h) per module

    @property
    def expert_params(self) -> int:
        return sum(p.expert_params for layer in self.layers for p in layer.parts)

    @property
    def total_params(self) -> int:
        head = 0 if self.spec.tie_word_embeddings else self.head.params
        mtp = self.mtp_proj_params * self.spec.mtp_layers
        return self.embed_params + head + mtp + sum(layer.params for layer in self.layers)


def _causal_pairs(s: int, window: int | None = None) -> float:
    """Average (query, key) pairs per query for causal attention over s tokens, optionally capped at `window` keys
    per query (DSA top-k): sum_{t=1..s} min(t, w) / s."""
    if window is None or window >= s:
        return (s + 1) / 2
    return (window * (window + 1) / 2 + (s - window) * window) / s


def _glu_gemms(prefix: str, h: int, inter: int, gated: bool, expert: bool = False, copies: int = 1,
               width: int | None = None) -> list[Gemm]:
    """Up (gate+up for GLU) and down projections of an MLP on width `width` (default h)."""
    d = width or h
    up_n = 2 * inter if gated else inter
    return [
        Gemm(f"{prefix}.up", n=up_n, k=d, split="col", copies=copies, expert=expert),
        Gemm(f"{prefix}.down", n=d, k=inter, split="row", copies=copies, expert=expert),
    ]


def _mlp_act_bytes(h: int, inter: int, gated: bool) -> tuple[float, float, float]:
    """(keep, selective, elementwise) bytes per token of a GLU MLP: GEMM inputs kept; the activation output is
    what selective recompute drops; elementwise = act read (2I or I) + write I."""
    up_out = (2 if gated else 1) * inter * BF16
    keep = up_out  # gate/up outputs (input of the activation)
    selective = inter * BF16  # activation output (input of down-proj)
    elem = up_out + inter * BF16
    return keep, selective, elem


def _norm_bytes(width: int) -> tuple[float, float]:
    """RMSNorm: (saved input kept, saved output dropped by selective); elementwise read+write = 2*width*bf16."""
    return width * BF16, width * BF16


def kda_work(spec: ModelSpec, s: int) -> PartWork:
    """KDA layer (MODEL.md; Kimi Linear arXiv:2510.26692). Core cost per head per token: 6 dk^2 + 3 C dk + C^2
    (report Eq. 13), counted for the hardware-time term only."""
    k = spec.kda
    assert k is not None
    h, H, d, C = spec.hidden_size, k.num_heads, k.head_dim, k.chunk_size
    Hv = k.value_heads
    gemms = [Gemm("kda.qkv", n=(2 * H + Hv) * d, k=h), Gemm("kda.beta", n=Hv, k=h, fp8=False)]
    if k.gate_rank is None:
        gemms.append(Gemm("kda.f", n=Hv * d if k.decay == "channel" else Hv, k=h))
    else:
        gemms += [Gemm("kda.f_a", n=k.gate_rank, k=h, split="rep", fp8=False),
                  Gemm("kda.f_b", n=Hv * d if k.decay == "channel" else Hv, k=k.gate_rank, fp8=False)]
    if k.output_gate_rank is None:
        gemms.append(Gemm("kda.g", n=Hv * d, k=h))
    else:
        gemms += [Gemm("kda.g_a", n=k.output_gate_rank, k=h, split="rep", fp8=False),
                  Gemm("kda.g_b", n=Hv * d, k=k.output_gate_rank, fp8=False)]
    gemms.append(Gemm("kda.o", n=h, k=Hv * d, split="row"))
    qkv = (2 * H + Hv) * d
    core = Hv * (6 * d * d + 3 * C * d + C * C)
    norm_keep, norm_sel = _norm_bytes(h)
    # kept: qkv projection output (conv input), gate pre-activation (fp32), beta, core output, gate proj output
    keep = norm_keep + qkv * BF16 + Hv * d * FP32 + Hv * BF16 + 2 * Hv * d * BF16
    # selective drops: normed input, conv+SiLU outputs, l2-normed q/k, normalized-and-gated output
    sel = norm_sel + qkv * BF16 + 2 * H * d * BF16 + 2 * Hv * d * BF16
    # elementwise: norm, conv+SiLU (r/w qkv), l2norm (r/w q,k), gate (fp32 r/w), out norm * sigmoid gate, residual
    elem = 2 * h * BF16 + 2 * qkv * BF16 + 4 * H * d * BF16 + 2 * Hv * d * FP32 + 6 * Hv * d * BF16 + 3 * h * BF16
    conv = qkv * k.conv_kernel_size
    # attn norm, convs, A_log [Hv], dt_bias [Hv*K or Hv], o_norm [K]
    other = h + conv + Hv + (Hv * d if k.decay == "channel" else Hv) + d
    return PartWork("kda", gemms, kda_flops=core, elem_bytes=elem, act_keep=keep, act_selective=sel,
                    other_params=other, conv_params=conv)


def mamba2_work(spec: ModelSpec, s: int) -> PartWork:
    """Mamba-2 mixer (Nemotron-H): in_proj, conv, SSD scan (Megatron's 7 * d_inner * N per token), out_proj."""
    m = spec.mamba2
    assert m is not None
    h, di, N, G, H = spec.hidden_size, m.inner_size, m.state_size, m.num_groups, m.num_heads
    in_n = 2 * di + 2 * G * N + H
    gemms = [Gemm("mamba.in", n=in_n, k=h), Gemm("mamba.out", n=h, k=di, split="row")]
    norm_keep, norm_sel = _norm_bytes(h)
    keep = norm_keep + in_n * BF16 + di * BF16
    sel = norm_sel + (di + 2 * G * N) * BF16 + di * BF16
    elem = 2 * h * BF16 + 2 * in_n * BF16 + 4 * di * BF16 + 3 * h * BF16
    conv = (di + 2 * G * N) * m.conv_kernel_size
    # norm, conv (+ bias), dt_bias, A_log, D [nh], gated norm [Di]
    other = h + conv + ((di + 2 * G * N) if m.conv_bias else 0) + 3 * H + di
    return PartWork("mamba2", gemms, kda_flops=7.0 * di * N, elem_bytes=elem, act_keep=keep, act_selective=sel,
                    other_params=other, conv_params=conv)


def mla_work(spec: ModelSpec, s: int) -> PartWork:
    """Gated MLA (DeepSeek-V2/V3 MLA + sigmoid output gate), with the DSA lightning indexer when present.

    Down-projections (x -> q_lora, x -> kv_lora + rope) are replicated across TP ranks (Megatron does the same);
    the up-projections are the "selective" recompute target (Megatron `mla_up_proj`). Dense attention: causal
    pairs (s+1)/2 per query over (qk_head + v_head) dims. With an indexer (sparse stage), the core runs in MQA
    form over the shared latent (kv_lora + rope for QK, kv_lora for PV) on min(t, top_k) keys per query.
    """
    a = spec.mla
    assert a is not None
    h, H = spec.hidden_size, a.num_heads
    dqk, dv, r = a.qk_head_dim, a.v_head_dim, a.kv_lora_rank
    gemms = []
    if a.q_lora_rank is None:
        gemms.append(Gemm("mla.q", n=H * dqk, k=h))
    else:
        gemms += [Gemm("mla.q_a", n=a.q_lora_rank, k=h, split="rep"),
                  Gemm("mla.q_b", n=H * dqk, k=a.q_lora_rank, selective=True)]
    gemms += [Gemm("mla.kv_a", n=r + a.qk_rope_head_dim, k=h, split="rep"),
              Gemm("mla.kv_b", n=H * (a.qk_nope_head_dim + dv), k=r, selective=True)]
    if a.output_gate:
        gemms.append(Gemm("mla.g", n=H * dv, k=h))
    gemms.append(Gemm("mla.o", n=h, k=H * dv, split="row"))
    part = PartWork("mla", gemms)
    q_lat = a.q_lora_rank or 0
    idx = a.indexer
    if idx is None:
        part.attn_flops = 2.0 * _causal_pairs(s) * H * (dqk + dv)
    else:
        gemms += [Gemm("dsa.q_idx", n=idx.num_heads * idx.head_dim, k=q_lat or h, split="rep", fp8=False),
                  Gemm("dsa.k_idx", n=idx.head_dim, k=h, split="rep", fp8=False),
                  Gemm("dsa.w_idx", n=idx.num_heads, k=h, split="rep", fp8=False)]
        part.sparse_attn_flops = 2.0 * _causal_pairs(s, idx.top_k) * H * ((r + a.qk_rope_head_dim) + r)
        part.heads = H
        part.indexer_flops = 2.0 * _causal_pairs(s) * idx.num_heads * idx.head_dim
        part.topk_elems = _causal_pairs(s)
    norm_keep, norm_sel = _norm_bytes(h)
    lat = q_lat + r + a.qk_rope_head_dim
    # replicated across TP: the down-projection outputs and their normed copies (inputs of the up-projections)
    part.act_replicated = 2 * lat * BF16
    # kept: attention output + softmax stats, gate pre-activation; dropped by selective: q, k, v (up-proj outputs)
    part.act_keep = norm_keep + H * dv * BF16 + H * FP32 + (H * dv * BF16 if a.output_gate else 0)
    part.o_in = H * dv * BF16
    part.act_selective = norm_sel + H * (dqk + dqk + dv) * BF16 + (H * dv * BF16 if a.output_gate else 0)
    if idx is not None:  # the indexer runs replicated on every TP rank over the whole sequence (tensor.py)
        part.act_replicated += idx.top_k * FP32 + (idx.num_heads * idx.head_dim + idx.head_dim + idx.num_heads) * BF16
    part.elem_bytes = 2 * h * BF16 + 2 * (q_lat + r) * BF16 + 4 * H * dv * BF16 + 3 * h * BF16
    part.other_params = h + q_lat + r + (2 * idx.head_dim if idx is not None else 0)
    return part


def gqa_work(spec: ModelSpec, s: int, window: int | None = None) -> PartWork:
    """Softmax GQA with FlashAttention: causal pairs (s+1)/2 per query (at most `window` under sliding-window
    attention), 2 * d FLOPs each for QK^T and PV."""
    g = spec.gqa
    assert g is not None
    h, H, Hkv, d = spec.hidden_size, g.num_heads, g.num_kv_heads, spec.gqa_head_dim
    qkv_n = (H + 2 * Hkv) * d + (H * d if g.output_gate else 0)
    gemms = [Gemm("gqa.qkv", n=qkv_n, k=h), Gemm("gqa.o", n=h, k=H * d, split="row")]
    norm_keep, norm_sel = _norm_bytes(h)
    keep = norm_keep + (H + 2 * Hkv) * d * BF16 + H * d * BF16 + H * FP32
    sel = norm_sel + (H * d * BF16 if g.output_gate else 0)
    elem = 2 * h * BF16 + (4 * (H + Hkv) * d * BF16 if g.use_rope else 0) + 3 * h * BF16
    other = h + (2 * d if g.qk_norm else 0) + (qkv_n if g.qkv_bias else 0)
    return PartWork("gqa", gemms, attn_flops=4.0 * _causal_pairs(s, window) * H * d, elem_bytes=elem, act_keep=keep,
                    act_selective=sel, other_params=other, o_in=H * d * BF16, window=window)


def dense_mlp_work(spec: ModelSpec) -> PartWork:
    assert spec.dense_mlp is not None
    h, inter = spec.hidden_size, spec.dense_mlp.intermediate_size
    gated = spec.gated_mlp
    keep, sel, elem = _mlp_act_bytes(h, inter, gated)
    norm_keep, norm_sel = _norm_bytes(h)
    return PartWork("dense", _glu_gemms("mlp", h, inter, gated), elem_bytes=elem + 5 * h * BF16,
                    act_keep=keep + norm_keep, act_selective=sel + norm_sel, other_params=h,
                    fp8_saved=(h + inter) * BF16, fc2_in=sel, fc1_out=keep)


def moe_work(spec: ModelSpec) -> PartWork:
    """(Latent) MoE: fp32 router on the full hidden; optional latent down-proj before dispatch and up-proj after
    combine (LatentMoE: dispatch moves L-wide tokens); top-k routed experts; fused shared experts on the full
    hidden. Expert-side saved activations per routed copy: dispatched input, gate/up output, activation output
    (selective drops it, Megatron `moe_act`), expert output (for the combine backward)."""
    moe = spec.moe
    assert moe is not None
    h, E, k, inter = spec.hidden_size, moe.num_experts, moe.top_k, moe.expert_intermediate_size
    gated = spec.gated_mlp
    lat = moe.latent_size or h
    # router and latent projections: replicated weights on the rank's sequence shard under TP (token-sharded MoE)
    gemms = [Gemm("moe.router", n=E, k=h, split="rep", fp8=False, fp32=True, seq_shard=True)]
    if moe.latent_size is not None:
        gemms += [Gemm("moe.down", n=lat, k=h, split="rep", seq_shard=True),
                  Gemm("moe.up", n=h, k=lat, split="rep", seq_shard=True)]
    gemms += _glu_gemms("expert", h, inter, gated, expert=True, copies=k, width=lat)
    if moe.shared_intermediate_size:
        gemms += _glu_gemms("shared", h, moe.shared_intermediate_size, gated)
        if moe.shared_expert_gate:
            gemms.append(Gemm("shared.gate", n=1, k=h, split="rep", fp8=False))
    ek, es, eelem = _mlp_act_bytes(lat, inter, gated)
    norm_keep, norm_sel = _norm_bytes(h)
    # under SP only the shared experts gather / scatter (the rest runs on the rank's sequence shard)
    part = PartWork("moe", gemms, dispatch_width=lat, top_k=k, num_experts=E,
                    tp_comm=bool(moe.shared_intermediate_size))
    part.expert_act = k * (lat * BF16 + ek + lat * BF16)
    part.expert_act_selective = k * es
    part.expert_fp8_saved = k * lat * BF16  # dispatched input (the activation output is in the selective share)
    part.expert_out = k * lat * BF16
    part.expert_fc1_out = k * ek
    part.act_selective = norm_sel
    part.act_keep = norm_keep + E * FP32 + k * (FP32 + 8) + (2 * lat * BF16 if moe.latent_size else 0)
    if moe.shared_intermediate_size:
        sk, ss, selem = _mlp_act_bytes(h, moe.shared_intermediate_size, gated)
        part.act_keep += sk
        part.act_selective += ss
        part.fc2_in = ss
        part.fc1_out = sk
    else:
        selem = 0.0
    # elementwise: norm, router sigmoid/top-k (fp32 over E), permute + unpermute (r/w k copies each), expert
    # activations, weighted combine, latent norm, shared activation, residual
    part.elem_bytes = (2 * h * BF16 + 3 * E * FP32 + 4 * k * lat * BF16 + k * eelem + 2 * k * lat * BF16
                       + (4 * lat * BF16 if moe.latent_norm and moe.latent_size else 0) + selem + 3 * h * BF16)
    # ffn norm + latent norm (the router's selection bias is a buffer, not a parameter)
    part.other_params = h + (lat if moe.latent_norm and moe.latent_size else 0)
    return part


def attn_res_elem_bytes(h: int, n_sources: int) -> float:
    """Forward HBM bytes per token of one Attention-Residual mix over n sources as moestack.model.attn_res runs it
    (by source, unfused): each bf16 source read three times (RMS, score, weighted sum) and the fp32 accumulator
    read and written once per source, then the bf16 output written."""
    return n_sources * (3 * BF16 + 2 * FP32) * h + (FP32 + BF16) * h


def add_attn_res(part: PartWork, h: int, n_sources: int) -> PartWork:
    """The Attention-Residual mix in front of `part` (moestack.model.block): its two weight factors (replicated, 2h),
    elementwise traffic, and saved bytes: its output (the part's norm input) and per-source softmax weight and rstd
    (fp32), both recomputed under selective recompute of the block (the sources are partial sums kept anyway). It
    runs in the sequence-parallel region (token-local, like the pre-norm): whole on every rank under plain TP."""
    part.other_params += 2 * h
    nbytes = attn_res_elem_bytes(h, n_sources)
    part.elem_bytes += nbytes
    part.sp_elem += nbytes
    saved = h * BF16 + 2 * n_sources * FP32
    part.act_selective += saved
    part.sp_sel += saved
    return part


def mixer_work(spec: ModelSpec, mixer: str, s: int, window: int | None = None) -> PartWork | None:
    if mixer == "none":
        return None
    if mixer == "gqa":
        return gqa_work(spec, s, window)
    builders = {"kda": kda_work, "mla": mla_work, "mamba2": mamba2_work}
    if mixer not in builders:
        raise NotImplementedError(f"cost model: mixer '{mixer}' is not modelled")
    return builders[mixer](spec, s)


def block_extras(spec: ModelSpec, part: PartWork) -> PartWork:
    """What every sub-layer adds around its own work: its pre-norm and residual (the sequence-parallel region:
    PartWork.sp_*), a LayerNorm's bias (spec.norm) and, with spec.linear_bias, the biases of the output / down
    projections and the MLP up projections, the routed experts' with the experts (parameters only: Megatron's FLOPs
    leave biases out)."""
    h = spec.hidden_size
    part.sp_keep, part.sp_sel = _norm_bytes(h)
    part.sp_elem = 5 * h * BF16  # norm read + write, residual add (read two, write one)
    if spec.norm == "layernorm":
        part.other_params += h
    if spec.linear_bias:
        part.other_params += sum(g.n for g in part.gemms if not g.expert and g.split == "row")
        part.other_params += sum(g.n for g in part.gemms if not g.expert and g.name in ("mlp.up", "shared.up"))
        part.expert_bias = sum(g.n for g in part.gemms if g.expert)
    return part


def ffn_work(spec: ModelSpec, ffn: str) -> PartWork | None:
    if ffn == "none":
        return None
    return dense_mlp_work(spec) if ffn == "dense" else moe_work(spec)


def model_work(spec: ModelSpec, seq_len: int) -> ModelWork:
    """Per-token forward work of every layer (decoder layers, then MTP blocks) at sequence length `seq_len`."""
    layers = []
    cache: dict[LayerKind, list[PartWork]] = {}
    kinds = [(i, kind, False) for i, kind in enumerate(spec.layer_kinds(), 1)]
    mtp = spec.mtp_block_kinds()
    idx = spec.num_layers
    for _ in range(spec.mtp_layers):
        for kind in mtp:
            idx += 1
            kinds.append((idx, kind, True))
    attn_res = spec.attn_res_block_size is not None
    for i, kind, is_mtp in kinds:
        # with Attention Residuals a layer's mixes read more sources deeper down: layers of one kind and depth share
        sources = spec.attn_res_sources(i - 1) if attn_res and not is_mtp else None
        key = (kind, sources)
        if key not in cache:
            parts = [mixer_work(spec, kind.mixer, seq_len, kind.window), ffn_work(spec, kind.ffn)]
            parts = [p and block_extras(spec, p) for p in parts]
            if sources is not None:
                parts = [p and add_attn_res(p, spec.hidden_size, n) for p, n in zip(parts, sources)]
            cache[key] = [p for p in parts if p]
        layers.append(LayerWork(i, kind, cache[key], is_mtp))
    h, V = spec.hidden_size, spec.vocab_size
    head = Gemm("lm_head", n=V, k=h, split="col", fp8=False)
    embed = V * h + (spec.max_seq_len * h if spec.learned_positions else 0)  # + the learned position table
    return ModelWork(spec, seq_len, layers, embed_params=embed, head=head, num_heads_out=1 + spec.mtp_layers,
                     mtp_proj_params=2 * h * h + 3 * h)


# ------------------------------------------------------------------------------------------------------------
# 2. Terms
# ------------------------------------------------------------------------------------------------------------

# Dropless routing: the busiest EP rank sets the pace (Plan.moe_load_imbalance, lowered by hot-expert replication:
# moe_time_imbalance); buffers are sized for a 1.5x burst.
MOE_MEMORY_HEADROOM = 1.5
# Fraction of an "overlapped" collective that still shows (imperfect overlap: launch gaps, SM contention).
OVERLAP_RESIDUAL = 0.15


def gemm_time(g: Gemm, rows: float, rows_per_gemm: float, tp: int, etp: int, precision: str,
              cluster: ClusterSpec, cal: Calibration) -> float:
    """Forward seconds of one Gemm on one device: `rows` token rows in total through this weight (routed copies
    on this device for experts), `rows_per_gemm` rows per single GEMM (tokens per local expert when grouped).

    Tensor parallelism splits n ("col") or k ("row"); experts split by etp. Backward = dgrad + wgrad = 2x these
    FLOPs at the same efficiency (Megatron's 3x rule, arXiv:2104.04473 App. A). Efficiency:
    Calibration.gemm_efficiency (fitted to measured H200 GEMMs, or measured by `moestack tune`).
    """
    n, k = g.n, g.k
    div = etp if g.expert else tp
    if g.split == "col":
        n = max(1, n // div)
    elif g.split == "row":
        k = max(1, k // div)
    peaks = cluster.device.peak_tflops
    if g.fp32:
        dtype = "tf32" if "tf32" in peaks else "fp32"
        eff = cal.gemm_efficiency(rows_per_gemm, n, k, "bf16", grouped=g.expert)
    else:
        recipe = gemm_recipe(precision, cluster) if g.fp8 else None
        if recipe is None:
            dtype, eff = "bf16", cal.gemm_efficiency(rows_per_gemm, n, k, "bf16", grouped=g.expert)
        elif recipe.scaling == "blockwise":  # moestack's recipe: its measured factor (Calibration.fp8_gemm_factor)
            dtype, eff = "fp8", cal.gemm_efficiency(rows_per_gemm, n, k, "fp8", grouped=g.expert)
        else:
            dtype = recipe.dtype
            factor = cal.lowp_native_grouped_factor if g.expert else cal.lowp_native_gemm_factor
            eff = cal.gemm_efficiency(rows_per_gemm, n, k, "bf16", grouped=g.expert) * factor
    return 2.0 * rows * n * k / (cluster.device.peak_flops(dtype) * eff)


@dataclass(frozen=True)
class GemmRecipe:
    """A low-precision GEMM recipe (Plan.precision) as the cost model prices it.

    dtype: the ClusterSpec peak its GEMMs run at; elem_bytes: one quantised element; scale_bytes: scale bytes per
    element; scaling: "blockwise" (moestack's recipe: software-scaled 1x128 / 128x128 blocks, priced by its measured
    Calibration.fp8_gemm_factor) or "native" (one scale per tensor, or block scales the tensor cores apply:
    MXFP8 / NVFP4 on Blackwell, priced at the bf16 efficiency x Calibration.lowp_native_gemm_factor)."""

    dtype: str
    elem_bytes: float
    scale_bytes: float
    scaling: str


GEMM_RECIPES = {
    "fp8": GemmRecipe("fp8", 1.0, FP32 / 128, "blockwise"),
    "fp8_tensorwise": GemmRecipe("fp8", 1.0, 0.0, "native"),
    "mxfp8": GemmRecipe("fp8", 1.0, 1.0 / 32, "native"),  # e8m0 scale per 32 elements (OCP MX)
    "nvfp4": GemmRecipe("fp4", 0.5, 1.0 / 16, "native"),  # e4m3 scale per 16 elements (+ one fp32 per tensor)
}


def gemm_recipe(precision: str, cluster: ClusterSpec) -> GemmRecipe | None:
    """The low-precision recipe a plan of this precision runs on this cluster; None for bf16 or a device without
    the recipe's units (its GEMMs are then priced in bf16)."""
    recipe = GEMM_RECIPES.get(precision)
    if recipe is None or recipe.dtype not in cluster.device.peak_tflops:
        return None
    return recipe


def fp8_recipe_runs(precision: str, cluster: ClusterSpec) -> bool:
    """Whether a plan of this precision runs a low-precision GEMM recipe on this cluster (GEMM_RECIPES)."""
    return gemm_recipe(precision, cluster) is not None


def recipe_cast_bytes(g: Gemm, rows: float, tp: int, etp: int, recipe: GemmRecipe, microbatches: int
                      ) -> tuple[float, float]:
    """HBM bytes of quantisation around one GEMM under a native-scaled recipe (Transformer Engine's): forward reads
    the bf16 input [rows, k] once and writes both layouts (row-wise for the forward GEMM, column-wise for wgrad);
    backward does the same for the output gradient [rows, n]. One scale per tensor (current scaling) needs the
    tensor's amax first: one more bf16 read. The weight is quantised once per optimizer step (its cast is cached
    across micro-batches), both layouts, amortised over the step's micro-batches."""
    div = etp if g.expert else tp
    n = g.n / div if g.split == "col" else g.n
    k = g.k / div if g.split == "row" else g.k
    q = 2 * (recipe.elem_bytes + recipe.scale_bytes)  # two layouts written per element read
    read = 2 * BF16 if recipe.scale_bytes == 0 else BF16  # per-tensor scales: an amax pass before the cast
    w = n * k * (read + q) / max(1, microbatches)
    return rows * k * (read + q) + w, rows * n * (read + q)


def grad_bytes(plan: Plan) -> float:
    """Bytes per gradient element in the gradient buffers and their data-parallel reduction (Plan.grad_dtype)."""
    return FP32 if plan.grad_dtype == "fp32" else BF16


def bf16_weight_copy(plan: Plan, cluster: ClusterSpec, dense: float, expert: float, vocab: float) -> float:
    """Parameters of one rank held as a bf16 compute copy next to the fp32 master weights (FSDP2's gathered
    parameters; Megatron's bf16 model parameters). With Plan.quantized_params the low-precision GEMMs' weights are
    held only in their GEMM format (the fp8_weights term), so just the embedding / head and the rest stay bf16."""
    if plan.quantized_params and fp8_recipe_runs(plan.precision, cluster):
        return min(dense, vocab)
    return dense + expert


def moe_time_imbalance(plan: Plan, spec: ModelSpec) -> float:
    """Busiest EP rank's routed rows over the mean (Plan.moe_load_imbalance), with plan.ep_replicas slots per EP
    rank what hot-expert replication leaves of it (moestack/planner/eplb.py), capped by the capacity factor when
    tokens beyond it are dropped (ModelSpec moe.capacity_factor: no expert takes more than factor x mean)."""
    imbalance = plan.moe_load_imbalance
    if plan.ep_replicas and plan.ep > 1 and spec.moe is not None:
        from moestack.planner.eplb import replicated_imbalance

        imbalance = replicated_imbalance(imbalance, spec.moe.num_experts, plan.ep, plan.ep_replicas)
    cap = spec.moe.capacity_factor if spec.moe is not None else None
    return min(imbalance, cap) if cap is not None else imbalance


def fp8_cast_bytes(g: Gemm, rows: float, tp: int, etp: int) -> tuple[float, float]:
    """HBM bytes of FP8 quantisation around one GEMM (read bf16 2 B + write fp8 1 B per element): forward casts the
    input [rows, k] and the weight; backward casts the output gradient [rows, n] and re-casts the input transposed
    for wgrad (Transformer Engine's delayed/current scaling recipes)."""
    div = etp if g.expert else tp
    n = g.n / div if g.split == "col" else g.n
    k = g.k / div if g.split == "row" else g.k
    w = n * k * 3
    return rows * k * 3 + w, rows * (n + k) * 3


def elementwise_time(nbytes: float, cluster: ClusterSpec, cal: Calibration) -> float:
    """Memory-bound kernels: bytes / (HBM bandwidth * achievable fraction) (roofline; MEASURED.md copy 4.24 of
    4.8 TB/s on H200)."""
    return nbytes / (cluster.device.hbm_bandwidth_gb_s * 1e9 * cal.hbm_eff)


def group_members_per_domain(cluster: ClusterSpec, size: int, stride: int, tier: int) -> int:
    """Members of a process group (ranks r0 + j * stride, j < size) inside one domain of `tier`."""
    domain = cluster.tier_domain(tier)
    if stride >= domain:
        return 1
    return min(size, domain // stride)


def group_tier(cluster: ClusterSpec, size: int, stride: int) -> int:
    """Innermost network tier whose domains contain a whole group (the link class its ring crosses)."""
    for i in range(len(cluster.tiers)):
        if group_members_per_domain(cluster, size, stride, i) >= size:
            return i
    return len(cluster.tiers) - 1


def _tier_bw(cluster: ClusterSpec, tier: int) -> float:
    """Datasheet bandwidth of a tier's links x its efficiency (bytes/s): the price of a collective when no
    measured number applies (see `_measured`)."""
    t = cluster.tiers[tier]
    return t.bandwidth_gb_s * 1e9 * t.efficiency


def _measured(comm: CommCalibration | None, tier: int, kind: str) -> tuple[float, float] | None:
    """(bus bandwidth in bytes/s, per-call latency in s) of collective `kind` ("ar", "rs", "ag", "a2a") measured by
    `moestack tune-comm`, when the group runs inside tier 0 (the scale-up domain the measurement ran in) and the
    calibration has it; else None (datasheet path). Why measured numbers win: calibration.CommCalibration."""
    if comm is None or tier != comm.tier:
        return None
    c = comm.collectives.get(kind)
    if c is None:
        return None
    return c.busbw_gb_s * 1e9, c.latency_us * 1e-6


def ring_time(cluster: ClusterSpec, nbytes: float, size: int, stride: int, kind: str,
              comm: CommCalibration | None = None) -> float:
    """Ring collective over `size` ranks: reduce-scatter / all-gather move (n-1)/n of the buffer per rank,
    all-reduce twice that (Patarasuk & Yuan 2009; NCCL's busbw convention), at the bandwidth of the tier the
    group spans, plus one latency per ring step.

    With a measured `comm` (Calibration.comm) and a group inside tier 0: factor (n-1)/n * nbytes / measured busbw of
    this kind + the measured per-call latency (busbw is NCCL's convention, so the same factor converts it back)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    tier = group_tier(cluster, size, stride)
    factor = {"rs": 1.0, "ag": 1.0, "ar": 2.0}[kind]
    measured = _measured(comm, tier, kind)
    if measured is not None:
        bw, lat = measured
        return factor * (size - 1) / size * nbytes / bw + lat
    steps = (size - 1) * factor
    return factor * (size - 1) / size * nbytes / _tier_bw(cluster, tier) + steps * cluster.tiers[tier].latency_us * 1e-6


def a2a_time(cluster: ClusterSpec, nbytes: float, size: int, stride: int, hierarchical: bool, top_k: int,
             max_domains: int | None = None, comm: CommCalibration | None = None) -> float:
    """All-to-all where each rank sends `nbytes` spread uniformly over `size` ranks (expert dispatch or combine).

    Flat: the share for peers inside the rank's innermost domain goes over tier 0, the rest over the tier the group
    spans; links run concurrently, so the slower share sets the time. Hierarchical (DeepEP / HybridEP style): a
    token crosses to each remote domain once and is fanned out there, so the crossing bytes shrink by
    E[distinct remote domains hit] / E[remote copies] = G (1 - (1 - 1/G)^k) / k (uniform routing over G domains,
    capped by group-limited routing's `max_domains`).

    With a measured `comm` (Calibration.comm, kind "a2a") and a group inside tier 0: (n-1)/n * nbytes / measured
    busbw + the measured per-call latency. Groups spanning outer tiers keep the datasheet bandwidths.
    """
    if size <= 1 or nbytes <= 0:
        return 0.0
    if not cluster.tiers:
        return 0.0
    outer = group_tier(cluster, size, stride)
    local = group_members_per_domain(cluster, size, stride, 0)
    measured = _measured(comm, outer, "a2a")
    if measured is not None:
        bw, lat = measured
        return nbytes * (size - 1) / size / bw + lat
    lat = cluster.tiers[outer].latency_us * 1e-6 * 2
    if outer == 0:
        return nbytes * (size - 1) / size / _tier_bw(cluster, 0) + lat
    remote_frac = (size - local) / size
    if hierarchical:
        domains = size / local
        distinct = domains * (1.0 - (1.0 - 1.0 / domains) ** top_k)
        if max_domains is not None:
            distinct = min(distinct, max_domains)
        remote = nbytes / top_k * distinct * (domains - 1) / domains
        intra = nbytes * (1.0 - 1.0 / size)
    else:
        remote = nbytes * remote_frac
        intra = nbytes * (local - 1) / size
    return max(remote / _tier_bw(cluster, outer), intra / _tier_bw(cluster, 0)) + lat


def p2p_time(cluster: ClusterSpec, nbytes: float, stride: int) -> float:
    """One send between neighbouring pipeline stages `stride` ranks apart."""
    if nbytes <= 0 or not cluster.tiers:
        return 0.0
    tier = group_tier(cluster, 2, stride)
    return nbytes / _tier_bw(cluster, tier) + cluster.tiers[tier].latency_us * 1e-6


def inflight_microbatches(schedule: str, p: int, v: int, m: int) -> float:
    """Micro-batches whose activations the first pipeline rank holds at its peak, in units of one micro-batch's
    activations for the whole rank (all its chunks).

    gpipe: all m (Huang et al. 2019). 1f1b: p (Narayanan et al. 2021). interleaved: Megatron warms up
    2(p-1) + (v-1)p chunk-micro-batches then holds one more: (vp + p - 1)/v rank-micro-batches. zbv: same peak as
    1F1B (Qi et al., ZB-V). dualpipev: p + 1 (DeepSeek-V3 report, Table 2).
    """
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p, m))
    if schedule == "interleaved_1f1b":
        return min(m * v, v * p + p - 1) / v
    if schedule == "zbv":
        return float(min(p, m))
    if schedule == "dualpipev":
        return float(min(p + 1, m))
    raise ValueError(schedule)


def pipeline_time(schedule: str, p: int, v: int, m: int, t_fwd: float, t_bwd: float, t_wgrad: float) -> float:
    """Time for m micro-batches through p ranks, given the slowest rank's forward, backward (incl. recompute) and
    the weight-gradient share of the backward, all per micro-batch for the whole rank.

    1f1b / gpipe: (m + p - 1)(F + B) (bubble (p-1)/m; Narayanan et al. 2021). interleaved: (m + (p-1)/v)(F + B).
    zbv (Qi et al., "Zero Bubble Pipeline Parallelism", ZB-V): m(F + B) + (p-1)(F_c + B_c - 2 W_c) with chunk
    times half the rank's and B_c the input-gradient part. dualpipev (DeepSeek-V3 report Table 2, DualPipe bubble
    (PP/2-1)(F&B + B - 3W) with PP/2 -> p for the V variant): m(F + B) + (p-1)(F&B_c + B_c - 3 W_c).
    """
    t = t_fwd + t_bwd
    if p == 1:
        return m * t
    if schedule in ("1f1b", "gpipe"):
        return (m + p - 1) * t
    if schedule == "interleaved_1f1b":
        return (m + (p - 1) / v) * t
    fc, bc, wc = t_fwd / 2, (t_bwd - t_wgrad) / 2, t_wgrad / 2
    if schedule == "zbv":
        return m * t + (p - 1) * max(0.0, fc + bc - 2 * wc)
    if schedule == "dualpipev":
        return m * t + (p - 1) * max(0.0, (fc + bc + wc) + bc - 3 * wc)
    raise ValueError(schedule)


def optimizer_bytes_per_param(optimizer: str) -> float:
    """Optimizer state bytes per parameter: AdamW fp32 m, v (8); AdamW with bf16 m, v (4); Muon momentum (4)."""
    return {"adamw": 8.0, "adamw_bf16": 4.0, "muon": 4.0}[optimizer]


def optimizer_step_bytes(optimizer: str) -> float:
    """HBM traffic per parameter of one optimizer step (read param, grad, states; write param, states)."""
    return {"adamw": 28.0, "adamw_bf16": 20.0, "muon": 20.0}[optimizer]


def muon_flops(n: int, k: int) -> float:
    """Newton-Schulz orthogonalisation of one [n, k] update, 5 iterations of X <- aX + (bA + cA^2)X with A = XX^T
    over the smaller dim m (Jordan et al. 2024; Kimi K2 report's MuonClip): ~5 (4 m^2 M + 2 m^3) FLOPs."""
    m, big = min(n, k), max(n, k)
    return 5.0 * (4.0 * m * m * big + 2.0 * m**3)


# ------------------------------------------------------------------------------------------------------------
# 3. Assemble a Plan
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    """Everything a part's cost needs besides the part itself."""

    plan: Plan
    spec: ModelSpec
    cluster: ClusterSpec
    cal: Calibration
    tokens: float  # T: tokens per micro-batch on one device's TP group (mbs * seq / cp)

    @property
    def tokens_sp(self) -> float:  # sequence-parallel shard
        return self.tokens / self.plan.tp


@dataclass
class PartCost:
    """One sub-layer, one micro-batch, one device. Seconds and bytes."""

    fwd: float = 0.0  # forward compute + exposed forward communication (EP a2a excluded: see a2a)
    bwd: float = 0.0  # backward compute + exposed backward communication (no recompute)
    wgrad: float = 0.0  # weight-gradient GEMMs inside bwd (zero-bubble schedules defer them)
    recompute: float = 0.0  # forward work redone in backward
    a2a: float = 0.0  # EP all-to-all (+ ETP gathers) of fwd, bwd and recompute, before overlap
    act: float = 0.0  # saved activation bytes
    act_kept: float = 0.0  # of which activation offload leaves on the device (autocast copies of weights)
    parts: dict[str, float] = field(default_factory=dict)  # component -> seconds (compute and exposed comm)

    def add(self, other: PartCost, times: float = 1.0, breakdown: bool = True) -> None:
        self.fwd += other.fwd * times
        self.bwd += other.bwd * times
        self.wgrad += other.wgrad * times
        self.recompute += other.recompute * times
        self.a2a += other.a2a * times
        self.act += other.act * times
        self.act_kept += other.act_kept * times
        if not breakdown:
            return
        for key, val in other.parts.items():
            self.parts[key] = self.parts.get(key, 0.0) + val * times

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.recompute


def _overlapped(comm: float, compute: float, overlap: bool) -> float:
    """Exposed part of a collective that can run under `compute` (imperfect: OVERLAP_RESIDUAL still shows)."""
    if not overlap:
        return comm
    return max(0.0, comm - compute) + OVERLAP_RESIDUAL * min(comm, compute)


# Not modelled: tensor.py keeps each unit's all-gathered input for backward where Megatron keeps the shard and
# re-gathers (~0.4 GiB per micro-batch on the proxy tp2). Counting it would put the published Megatron runs of
# test_validation.py out of memory (Llama 3 405B TP8 PP16: 177 GiB per GPU); the fix belongs in tensor.py.

# DSA sparse MQA attention kernels (moestack/ops/dsa/triton_attn_*.py) put up to 64 heads of one token in one program
# (forward BLOCK_H <= 64, backward heads padded to DS_HEAD_PAD = 64) over the token's gathered top-k latent rows:
# the time per token is that of ceil(H / 64) head blocks, however few heads a block holds.
DSA_HEAD_BLOCK = 64


def dsa_head_block_factor(heads: int, tp: int, cal_heads: int | None) -> float:
    """Time of the DSA sparse attention with heads / tp local heads, relative to `sparse_attn_flops` (all heads)
    priced at the calibrated efficiency, which was measured at `cal_heads` heads (None: all `heads`, tp = 1).
    The kernels pay per block of DSA_HEAD_BLOCK heads, so below 64 heads TP does not shorten them."""
    if heads <= 0:
        return 1.0 / tp
    ref = cal_heads or heads
    local = max(1, heads // tp)
    blocks = lambda n: math.ceil(n / DSA_HEAD_BLOCK)  # noqa: E731
    return (ref / heads) * blocks(local) / blocks(ref)


def tp_grad_sum_bytes(part: PartWork, plan: Plan) -> float:
    """Gradient bytes of one part that moestack's TP all-reduces over the TP group in every backward: replicated
    weights used on part of the work (tensor.py "sum" / "avg": low-rank and MLA down-projections, the DSA indexer,
    the MoE router and latent projections, and the routed experts unless expert parallelism owns them). Gradients
    come in the compute dtype (bf16 under FSDP2 mixed precision), the router's in fp32. Norm weights are left out."""
    if plan.tp <= 1:
        return 0.0
    grad_b = FP32 if plan.precision == "fp32" else BF16
    total = 0.0
    for g in part.gemms:
        if g.expert:
            if _experts_tp_replicated(plan):
                total += g.params * part.num_experts * grad_b
        elif g.split == "rep":
            total += g.params * (FP32 if g.fp32 else grad_b)
    return total


def _experts_tp_replicated(plan: Plan) -> bool:
    """Routed experts replicated over the TP ranks (no EP / ETP): each rank runs them on its own tokens and the
    gradients are summed over TP in every backward (moestack/parallel/tensor.py)."""
    return plan.tp > 1 and plan.ep * plan.etp == 1


def tp_grad_sum_time(part: PartWork, ctx: Ctx) -> float:
    """Exposed seconds of those all-reduces for one micro-batch (moestack/parallel/tensor.py `_LocalView`)."""
    nbytes = tp_grad_sum_bytes(part, ctx.plan)
    return ring_time(ctx.cluster, nbytes, ctx.plan.tp, 1, "ar", ctx.cal.comm) if nbytes else 0.0


def recompute_mode(plan: Plan, part: PartWork) -> str:
    r = plan.recompute
    return {"kda": r.kda, "mamba2": r.kda, "mla": r.attention, "gqa": r.attention, "dense": r.mlp,
            "moe": r.moe}[part.kind]


def part_cost(part: PartWork, ctx: Ctx) -> PartCost:
    """Time and saved bytes of one sub-layer for one micro-batch on one device (see module docstring)."""
    plan, cluster, cal = ctx.plan, ctx.cluster, ctx.cal
    tp, etp, ep = plan.tp, plan.etp, plan.ep
    T, Tsp = ctx.tokens, ctx.tokens_sp
    peak = cluster.device.peak_flops("bf16")
    out = PartCost()
    # routed rows on this device: its SP shard's copies gathered over etp, spread over E/ep local experts
    imbalance = moe_time_imbalance(plan, ctx.spec) if part.kind == "moe" else 1.0
    expert_rows = Tsp * part.top_k * etp * imbalance if part.kind == "moe" else 0.0
    rows_per_expert = expert_rows * ep / part.num_experts if part.kind == "moe" else 0.0

    g_fwd = sel_fwd = 0.0
    cast_f = cast_b = 0.0
    for g in part.gemms:
        if g.expert:
            rows, per = expert_rows, rows_per_expert
        elif g.seq_shard:
            rows = per = Tsp  # router / MoE latent projections: replicated weight on the sequence-parallel shard
        else:
            rows = per = T
        t = gemm_time(g, rows, per, tp, etp, plan.precision, cluster, cal)
        g_fwd += t
        if g.selective:
            sel_fwd += t
        if g.fp8 and plan.precision != "fp8" and fp8_recipe_runs(plan.precision, cluster):
            cf, cb = recipe_cast_bytes(g, rows, tp, etp, GEMM_RECIPES[plan.precision], plan.num_microbatches)
            cast_f += cf
            cast_b += cb
        elif g.fp8 and fp8_recipe_runs(plan.precision, cluster):
            cf, cb = fp8_cast_bytes(g, rows, tp, etp)
            cast_f += cf
            cast_b += cb
    attn_f = part.attn_flops * T / tp / (peak * cal.flash_attn_fwd_eff)
    attn_b = 2.5 * part.attn_flops * T / tp / (peak * cal.flash_attn_bwd_eff)
    head_blocks = dsa_head_block_factor(part.heads, tp, cal.sparse_attn_heads) if part.sparse_attn_flops else 1.0
    sparse_f = part.sparse_attn_flops * T * head_blocks / (peak * cal.sparse_attn_fwd_eff)
    sparse_b = 2.0 * part.sparse_attn_flops * T * head_blocks / (peak * cal.sparse_attn_bwd_eff)
    kda_f = part.kda_flops * T / tp / (peak * cal.kda_fwd_eff)
    kda_b = 2.0 * part.kda_flops * T / tp / (peak * cal.kda_bwd_eff)
    # the DSA indexer is replicated: every TP rank scores and selects for the whole sequence (tensor.py)
    idx_f = part.indexer_flops * T / (peak * cal.flash_attn_fwd_eff) + part.topk_elems * T / cal.topk_elems_per_s
    idx_b = 2.0 * part.indexer_flops * T / (peak * cal.flash_attn_bwd_eff)
    # without sequence parallelism the norms and residual adds run on the whole sequence on every TP rank
    sp_whole = part.sp_elem * T * (1 - 1 / tp) if not plan.sequence_parallel else 0.0
    elem_f = elementwise_time(part.elem_bytes * T / tp + sp_whole + cast_f, cluster, cal)
    elem_b = elementwise_time(2.0 * (part.elem_bytes * T / tp + sp_whole) + cast_b, cluster, cal)
    # what a whole-part measurement (tune) found beyond the analytic terms, per token; priced as elementwise work
    # (it is recomputed under selective and full recompute alike)
    measured = cal.parts.get(part.kind)
    if measured is not None:
        elem_f += measured.fwd_fixed_s + measured.fwd_extra_s_per_token * T / tp
        elem_b += measured.bwd_fixed_s + measured.bwd_extra_s_per_token * T / tp
    over = cal.kernel_overhead_s
    core_f = attn_f + sparse_f + kda_f + idx_f
    core_b = attn_b + sparse_b + kda_b + idx_b
    comp_f = g_fwd + core_f + elem_f + over
    comp_b = 2.0 * g_fwd + core_b + elem_b + over

    # tensor parallel (sequence parallel): fwd all-gather in + reduce-scatter out; bwd adds the re-gather of the
    # saved input for wgrad (Korthikanti et al. 2022, Sec. 4.2.2; moestack/parallel/tensor.py keeps the gathered
    # input instead: one collective less, T x h x (1 - 1/tp) more saved bytes per unit, not modelled). moestack's
    # collectives are DTensor redistributes on the compute stream: exposed
    tp_f = tp_b = 0.0
    h = ctx.spec.hidden_size
    if tp > 1 and part.tp_comm:
        coll = ring_time(cluster, T * h * BF16, tp, 1, "ag", ctx.cal.comm)
        tp_f, tp_b = tp_comm_times(plan, coll, g_fwd)
    # the gradient all-reduce of the replicated weights whose local use was partial, in every micro-batch's backward
    # (tensor.py `_LocalView`: synchronous, on the critical path); plan.tp_grad_reduce = deferred sums them once per
    # step instead (CostModel.evaluate, "tp_grad_sum")
    if plan.tp_grad_reduce != "deferred":
        tp_b += tp_grad_sum_time(part, ctx)
    # context parallel (moestack/parallel/context.py): all-gather of the MLA latent (+ indexer keys) overlapped with
    # the attention core; recurrent mixers relay their final state rank to rank, so the ranks run the layer one
    # after another (sequential, exposed), or (KDA, plan.cp_kda = scan) run at once and pay the scan's extra work
    cp_f = cp_b = 0.0
    if plan.cp > 1:
        cp_f, cp_b = _cp_times(part, ctx, attn_f + sparse_f + idx_f, attn_b + sparse_b + idx_b, kda_f, kda_b)
    # expert parallel all-to-all: dispatch + combine each way (+ ETP gather / scatter of dispatched tokens)
    a2a_one = 0.0
    if part.kind == "moe":
        moe = ctx.spec.moe
        assert moe is not None
        # moestack's dispatcher sends bf16 rows under the fp8 recipe too (the experts quantise after it); fp8 rows with
        # per-128 scales only where the plan says so (DeepEP runs; support.py: not launchable here)
        wbytes = 1.03 if plan.ep_dispatch_dtype == "fp8" else BF16
        nbytes = Tsp * part.top_k * part.dispatch_width * imbalance
        groups = None
        if moe.router.topk_groups < moe.router.num_groups:
            groups = moe.router.topk_groups
        disp = a2a_time(cluster, nbytes * wbytes, ep, etp, plan.dispatcher == "hierarchical", part.top_k, groups,
                        ctx.cal.comm)
        comb = a2a_time(cluster, nbytes * BF16, ep, etp, plan.dispatcher == "hierarchical", part.top_k, groups,
                        ctx.cal.comm)
        a2a_one = disp + comb
        if plan.ep_replicas and ep > 1:  # replica weights fetched from their owners (bf16), gradients sent back
            expert_params = sum(g.params for g in part.gemms if g.expert)
            a2a_one += a2a_time(cluster, plan.ep_replicas * expert_params * BF16, ep, 1, False, 1, None,
                                ctx.cal.comm)
        if etp > 1:
            a2a_one += 2 * ring_time(cluster, expert_rows * part.dispatch_width * BF16, etp, 1, "ag", ctx.cal.comm)

    mode = recompute_mode(plan, part)
    out.fwd = comp_f + tp_f + cp_f
    out.bwd = comp_b + tp_b + cp_b
    out.wgrad = g_fwd
    out.a2a = 2 * a2a_one
    if mode == "selective":
        out.recompute = sel_fwd + elem_f
    elif mode == "full":
        out.recompute = comp_f + tp_f + cp_f
        out.a2a += a2a_one
    out.parts = {
        "gemm": 3 * g_fwd,
        "attention": attn_f + attn_b + sparse_f + sparse_b + idx_f + idx_b,
        "kda": kda_f + kda_b,
        "elementwise": elem_f + elem_b + 2 * over,
        "recompute": out.recompute,
        "tp_comm": tp_f + tp_b,
        "cp_comm": cp_f + cp_b,
    }
    out.act = activation_bytes(part, mode, ctx)
    out.act_kept = autocast_weight_copies(part, ctx) if mode == "none" else 0.0
    return out


def tp_comm_times(plan: Plan, coll: float, g_fwd: float) -> tuple[float, float]:
    """(fwd, bwd) exposed seconds of one sub-layer's TP collectives; `coll` is one all-gather of its input.

    Sequence parallel: forward all-gather in + reduce-scatter out, backward the same + the re-gather of the input
    for wgrad (Korthikanti et al. 2022, Sec. 4.2.2): 2 and 3 collectives. Plain TP: one all-reduce (= reduce-scatter +
    all-gather) each way, no re-gather. plan.tp_comm_overlap: hidden behind the part's GEMMs (Megatron's userbuffers
    overlap; OVERLAP_RESIDUAL still shows); moestack's trainer runs them on the compute stream, so the search leaves
    the overlap off (search.TP_OVERLAP_DEFAULT)."""
    f, b = (2 * coll, 3 * coll) if plan.sequence_parallel else (2 * coll, 2 * coll)
    if plan.tp_comm_overlap:
        return _overlapped(f, g_fwd, True), _overlapped(b, 2 * g_fwd, True)
    return f, b


def _cp_times(part: PartWork, ctx: Ctx, core_f: float, core_b: float, rec_f: float = 0.0, rec_b: float = 0.0
              ) -> tuple[float, float]:
    """Exposed CP time of one sub-layer: (fwd, bwd), from the term of its kind (core_*: the attention core's time,
    rec_*: the recurrence's own time on this rank's shard)."""
    if part.kind in ("mla", "gqa"):
        return cp_attention_times(part, ctx, core_f, core_b)
    if part.kind == "kda" and ctx.plan.cp_kda == "scan":
        return cp_kda_scan_times(part, ctx, rec_f, rec_b)
    if part.kind in ("kda", "mamba2"):
        return cp_relay_times(part, ctx, rec_f, rec_b)
    return 0.0, 0.0


def cp_attention_times(part: PartWork, ctx: Ctx, core_f: float, core_b: float) -> tuple[float, float]:
    """Attention under CP: the all-gather of the MLA latent (and DSA indexer key; GQA: keys and values) over the
    cp ranks, hidden behind the attention core; backward reduce-scatters the gradient (twice the traffic)."""
    plan, cluster, spec = ctx.plan, ctx.cluster, ctx.spec
    if part.kind == "gqa":
        assert spec.gqa is not None
        kv = 2 * spec.gqa.num_kv_heads * spec.gqa_head_dim * BF16
    else:
        assert spec.mla is not None
        kv = (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) * BF16  # MQA latent, shared by all heads
        if spec.mla.indexer is not None:
            kv += spec.mla.indexer.head_dim * BF16  # the indexer key, gathered too
    if part.window is not None and part.window < ctx.tokens:
        # sliding window: a rank's queries reach back `window` keys, all on the previous shard: one send of the
        # window's keys and values per sequence, not the all-gather (ctx.tokens is the rank's shard)
        comm = p2p_time(cluster, plan.micro_batch_size * part.window * kv, plan.tp)
    else:
        comm = ring_time(cluster, plan.cp * ctx.tokens * kv, plan.cp, plan.tp, "ag", ctx.cal.comm)
    return _overlapped(comm, core_f, True), _overlapped(2 * comm, core_b, True)


def _state_bytes(part: PartWork, ctx: Ctx) -> float:
    """One rank's recurrent state (fp32), per sequence of the micro-batch."""
    spec = ctx.spec
    if part.kind == "kda":
        assert spec.kda is not None
        return spec.kda.value_heads * spec.kda.head_dim**2 * FP32 / ctx.plan.tp
    assert spec.mamba2 is not None
    return spec.mamba2.inner_size * spec.mamba2.state_size * FP32 / ctx.plan.tp


def cp_relay_times(part: PartWork, ctx: Ctx, rec_f: float, rec_b: float) -> tuple[float, float]:
    """KDA / Mamba-2 state relay (plan.cp_kda = relay): rank r starts after ranks 0..r-1 finished theirs, so a
    micro-batch waits cp - 1 shards' recurrence plus cp - 1 state hops, forward and backward (no micro-batch fills
    the wait outside a pipeline schedule)."""
    cp = ctx.plan.cp
    hop = p2p_time(ctx.cluster, _state_bytes(part, ctx), ctx.plan.tp)
    return (cp - 1) * (hop + rec_f), (cp - 1) * (hop + rec_b)


def kda_scan_widen_factor(head_dim: int, chunk: int) -> float:
    """KDA core FLOPs with the value width doubled (the scan's [0 | v] pass) over the plain pass. Per head and
    token the core is 6 d^2 + 3 C d + C^2 (kda_work); the V-proportional part -- the three state products
    (6 d V) and the intra-chunk value products U = M V, P D (~C V of the 3 C d) -- doubles."""
    d, C = head_dim, chunk
    return 1.0 + (6 * d * d + C * d) / (6 * d * d + 3 * C * d + C * C)


def cp_kda_scan_times(part: PartWork, ctx: Ctx, rec_f: float, rec_b: float) -> tuple[float, float]:
    """KDA state scan (plan.cp_kda = scan): every rank runs its shard at once. Exposed: the widened pass's extra
    compute, the all-gather of the cp transitions [M | S_loc] (fp32, H*K*(K+V) per sequence and rank; backward a
    reduce-scatter) on the critical path, and the correction q_hat S_in plus the prefix composition (plain matmuls).
    The short-conv halo all-gather (W-1 rows) is negligible."""
    plan, cluster, spec = ctx.plan, ctx.cluster, ctx.spec
    assert spec.kda is not None
    Hv, d, cp = spec.kda.value_heads / plan.tp, spec.kda.head_dim, plan.cp
    extra = kda_scan_widen_factor(d, spec.kda.chunk_size) - 1.0
    seqs = plan.micro_batch_size
    gather = ring_time(cluster, cp * seqs * 2 * _state_bytes(part, ctx), cp, plan.tp, "ag", ctx.cal.comm)
    flops = 2 * ctx.tokens * Hv * d * d + seqs * (cp - 1) * Hv * 2 * d * d * d  # correction + composition
    mm = flops / (cluster.device.peak_flops("bf16") * ctx.cal.gemm_peak_eff)
    return extra * rec_f + gather + mm, extra * rec_b + 2 * gather + 2 * mm


def activation_bytes(part: PartWork, mode: str, ctx: Ctx) -> float:
    """Saved bytes of one sub-layer for one micro-batch on one device under recompute `mode`.

    Sequence/tensor parallel split everything but the replicated MLA latents by tp (Korthikanti et al. 2022);
    context parallel splits tokens. Expert-side tensors live on the device that ran the expert: SP-shard tokens x
    top-k copies, with MOE_MEMORY_HEADROOM for dropless bursts. full: only the sub-layer input (SP-sharded).
    """
    T, tp = ctx.tokens, ctx.plan.tp
    factors = ctx.cal.act_factors
    if mode == "full":
        whole = tp if not ctx.plan.sequence_parallel else 1  # plain TP keeps the whole input on every rank
        return T * ctx.spec.hidden_size * BF16 / tp * whole * factors.get("full", 1.0)
    scale = factors.get(mode, 1.0) * (factors.get("fp8", 1.0) if ctx.plan.precision == "fp8" else 1.0)
    # no extra term under expert parallelism: its local experts run the same activation as one device (Experts.glu)
    return scale * _saved_bytes(part, mode, ctx)


def _saved_bytes(part: PartWork, mode: str, ctx: Ctx) -> float:
    """activation_bytes before the measured technique factors (none / selective)."""
    T, tp = ctx.tokens, ctx.plan.tp
    copies = autocast_weight_copies(part, ctx) if mode == "none" else 0.0
    measured = ctx.cal.parts.get(part.kind)
    if measured is not None:
        # measured bytes per token (bf16 storage, no recompute); selective keeps the analytic fraction of them;
        # fp8 storage takes off what the analytic terms say it saves
        frac = 1.0
        if mode == "selective":
            frac = _analytic_act(part, "selective", ctx, False) / max(_analytic_act(part, "none", ctx, False), 1e-9)
        fp8_saving = 0.0
        if ctx.plan.precision == "fp8":
            fp8_saving = _analytic_act(part, mode, ctx, False) - _analytic_act(part, mode, ctx, True)
        # the replicated share (MLA latents, DSA indexer) is not split by tp
        rep = min(part.act_replicated, measured.act_bytes_per_token)
        per_token = (measured.act_bytes_per_token - rep) / tp + rep
        return max(0.0, T * per_token * frac - fp8_saving) + copies + _no_sp_act(part, mode, ctx)
    return _analytic_act(part, mode, ctx, ctx.plan.precision == "fp8") + copies + _no_sp_act(part, mode, ctx)


def _no_sp_act(part: PartWork, mode: str, ctx: Ctx) -> float:
    """Plain TP (no sequence parallelism): the sequence-parallel region's saved tensors (norm input; under no
    recompute also the norm output that feeds the first TP GEMM) are whole on every TP rank, not 1/tp of them
    (Korthikanti et al. 2022, Eq. 2 vs Eq. 4)."""
    tp = ctx.plan.tp
    if ctx.plan.sequence_parallel or tp <= 1:
        return 0.0
    kept = part.sp_keep + (part.sp_sel if mode == "none" else 0.0)
    return ctx.tokens * kept * (1 - 1 / tp)


def autocast_weight_copies(part: PartWork, ctx: Ctx) -> float:
    """bf16 copies of fp32 GEMM weights that autocast makes in forward and autograd keeps for backward: the
    single-device trainer keeps fp32 weights under autocast (distributed plans run FSDP2 with bf16 params, no
    copies). Selective and full recompute redo the casts (memory/recompute.py). The routed experts' copies are
    not kept when their GEMMs go through moestack.memory's expert seam (expert offload, FP8 saved inputs): the
    seam's autograd.Function casts inside its forward and keeps the fp32 weight (or nothing, when offloaded)."""
    if ctx.plan.devices != 1:
        return 0.0
    dense = sum(g.params for g in part.gemms if not g.expert and not g.fp32)
    expert = sum(g.params for g in part.gemms if g.expert) * part.num_experts
    if ctx.plan.offload.experts or ctx.plan.precision == "fp8":
        expert = 0.0
    return BF16 * (dense + expert)


def megatron_saved_delta(part: PartWork, mode: str, plan: Plan, cluster: ClusterSpec) -> float:
    """Saved bytes per token Megatron-Core / Transformer Engine keep beyond (or short of) moestack's terms.

    Megatron applies the routing probabilities inside the experts' activation (the experts take the permuted
    probabilities), so the combine keeps no expert outputs for its backward, only the probabilities. Under a
    low-precision recipe every Transformer Engine linear layer saves its own quantised input for the weight gradient
    (elem + scale bytes): the inputs that only feed GEMMs (the norm output, the activation outputs feeding the down
    projections, the dispatched expert inputs) are stored quantised instead of in bf16; the attention output is
    quantised in addition to the bf16 copy the attention backward reads. plan.fp8_activation_input stores the
    activation function's input (the gate / up outputs) quantised as well."""
    delta = part.top_k * FP32 - part.expert_out if part.kind == "moe" else 0.0
    recipe = gemm_recipe(plan.precision, cluster)
    if recipe is None:
        return delta
    q = recipe.elem_bytes + recipe.scale_bytes
    saved = 1 - q / BF16
    delta -= part.expert_fp8_saved * saved
    if mode == "none":
        delta -= (part.expert_act_selective + part.fc2_in + part.sp_sel) * saved
    if plan.fp8_activation_input:  # the activation function's input kept quantised too (Megatron, DeepSeek-V3)
        delta -= (part.fc1_out + part.expert_fc1_out) * saved
    return delta + part.o_in * q / BF16


def _analytic_act(part: PartWork, mode: str, ctx: Ctx, fp8: bool) -> float:
    """Saved bytes from the analytic per-token terms (`fp8`: GEMM inputs stored in one byte)."""
    T, tp = ctx.tokens, ctx.plan.tp
    if framework_of(ctx.plan.host_profile) == "megatron":  # its own saved-tensor convention instead of the fp8 one
        base = _analytic_act_moestack(part, mode, ctx, False)
        return base + T * megatron_saved_delta(part, mode, ctx.plan, ctx.cluster) / tp
    return _analytic_act_moestack(part, mode, ctx, fp8)


def _analytic_act_moestack(part: PartWork, mode: str, ctx: Ctx, fp8: bool) -> float:
    """_analytic_act as moestack's trainer saves them."""
    T, tp = ctx.tokens, ctx.plan.tp
    # summed over many layers and micro-batches, expert loads average out: stored expert activations use the mean
    # load (the transient dispatch buffers carry MOE_MEMORY_HEADROOM instead)
    keep = part.act_keep - (part.fp8_saved / 2 if fp8 else 0.0)
    expert = part.expert_act - (part.expert_fp8_saved / 2 if fp8 else 0.0)
    if mode == "selective":
        return T * (keep / tp + part.act_replicated + expert / tp)
    sel = part.act_selective + part.expert_act_selective / (2 if fp8 else 1)
    return T * ((keep + sel) / tp + part.act_replicated + expert / tp)


@dataclass
class StageLayout:
    """Which layers each pipeline chunk holds; chunk c lives on rank chunk_rank[c]."""

    chunks: list[list[int]]  # layer positions (0-based into ModelWork.layers) per chunk
    chunk_rank: list[int]


def chunk_ranks(p: int, v: int, schedule: str) -> list[int]:
    """Rank of each of the p*v chunks: interleaved round-robin (Megatron), V-shape for zbv / dualpipev."""
    if schedule in V_SHAPE:
        return list(range(p)) + list(reversed(range(p)))
    return [c % p for c in range(p * v)]


def balanced_chunks(costs: list[float], n: int, first_extra: float, last_extra: float) -> list[list[int]]:
    """Split layers (in order) into n contiguous non-empty chunks minimising the largest chunk cost; the first chunk
    also carries the embedding and the last the LM head (Llama 3 and Megatron-Bridge's DeepSeek-V3 layouts put
    fewer layers on those stages for the same reason). Binary search on the cap with a greedy fill."""
    L = len(costs)
    assert 1 <= n <= L
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    lo = max(max(costs), (prefix[-1] + first_extra + last_extra) / n)
    hi = prefix[-1] + first_extra + last_extra
    best = _greedy(prefix, n, hi * (1 + 1e-9), first_extra, last_extra)
    for _ in range(30):
        cap = (lo + hi) / 2
        bounds = _greedy(prefix, n, cap, first_extra, last_extra)
        if bounds is not None:
            best, hi = bounds, cap
        else:
            lo = cap
        if hi - lo <= 1e-4 * hi:
            break
    assert best is not None
    return [list(range(a, b)) for a, b in zip(best, best[1:])]


def uniform_chunks(layers: int, n: int, account: bool) -> list[list[int]]:
    """Megatron's default pipeline split (Plan.pipeline_split): the same number of layers in each of the n chunks
    (earlier chunks take the remainder), the embedding and the LM head extra on the first / last. `account`
    (Megatron's account_for_embedding / loss_in_pipeline_split): the embedding and the loss count as one layer each,
    so the first and the last chunk hold one layer less."""
    slots = layers + (2 if account else 0)
    sizes = [slots // n + (1 if c < slots % n else 0) for c in range(n)]
    if account:
        sizes[0] -= 1
        sizes[-1] -= 1
    if min(sizes) < 1:
        raise ValueError(f"pipeline: {n} chunks leave a chunk without layers ({layers} layers)")
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def _greedy(prefix: list[float], n: int, cap: float, first_extra: float, last_extra: float) -> list[int] | None:
    """Chunk boundaries filling each chunk up to `cap` (leaving at least one layer per remaining chunk)."""
    import bisect

    L = len(prefix) - 1
    bounds = [0]
    start = 0
    for c in range(n):
        room = cap - (first_extra if c == 0 else 0.0)
        end = bisect.bisect_right(prefix, prefix[start] + room) - 1
        end = min(end, L - (n - c - 1))
        if c == n - 1:
            end = L
        if end <= start:
            return None
        load = prefix[end] - prefix[start] + (first_extra if c == 0 else 0.0) + (last_extra if end == L else 0.0)
        if load > cap * (1 + 1e-9):
            if end == L and c < n - 1:
                end -= 1  # keep the head's extra off a chunk that cannot take it; the next chunk ends at L
                if end <= start:
                    return None
            else:
                return None
        bounds.append(end)
        start = end
    return bounds if start == L else None


@dataclass
class PlanCost:
    """Everything the cost model says about one plan (seconds per step, bytes per device)."""

    plan: Plan
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    model_flops_per_step: float
    memory: dict[str, float]  # component -> bytes on the busiest device
    hbm_bytes: float
    host_bytes: float  # host memory needed per device (offload)
    host_capacity: float
    time: dict[str, float]  # component -> seconds per step (exposed, on the critical rank)
    binding: str
    layout: StageLayout
    rank_fwd_bwd: list[tuple[float, float, float]]  # per rank per micro-batch: (fwd, bwd + recompute, wgrad)
    notes: list[str] = field(default_factory=list)
    forward_activations: float = 0.0  # busiest rank: what forward leaves for backward (the memory report's term)
    memory_by_pp_rank: list[dict[str, float]] = field(default_factory=list)  # `memory` of every pipeline rank

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def memory_fraction(self) -> float:
        return self.memory_total / self.hbm_bytes

    def fits(self, margin: float = 0.05) -> bool:
        return self.memory_total <= self.hbm_bytes * (1 - margin) and self.host_bytes <= self.host_capacity

    def prediction(self):
        from moestack.config.plan import PlanPrediction

        return PlanPrediction(
            step_time_s=round(self.step_time_s, 4),
            tokens_per_s=round(self.tokens_per_s, 1),
            tflops_per_device=round(self.tflops_per_device, 1),
            mfu=round(self.mfu, 4),
            memory_gib={k: round(v / GIB, 2) for k, v in self.memory.items()},
            time_s={k: round(v, 4) for k, v in self.time.items()},
            binding=self.binding,
        )


class CostModel:
    """Evaluates plans for one (model, cluster, calibration, sequence length); caches per-layer work.

    `model_flops_per_token` is the training FLOPs per token used for TFLOP/s and MFU (the profile's
    `train_flops_per_token`, Megatron's definition).
    """

    def __init__(self, spec: ModelSpec, cluster: ClusterSpec, cal: Calibration, seq_len: int,
                 model_flops_per_token: float):
        self.spec, self.cluster, self.cal, self.seq_len = spec, cluster, cal, seq_len
        self.work = model_work(spec, seq_len)
        self.model_flops_per_token = model_flops_per_token
        self._kinds = sorted({id(layer.parts): layer for layer in self.work.layers}.values(), key=lambda x: x.index)
        kind_of = {id(layer.parts): k for k, layer in enumerate(self._kinds)}
        self._layer_kind = [kind_of[id(layer.parts)] for layer in self.work.layers]
        self._kind_cache: dict[tuple, list[PartCost]] = {}
        self._chunk_cache: dict[tuple, list[list[int]]] = {}
        self._param_cache: dict[tuple, tuple[float, float]] = {}
        self._sum_cache: dict[tuple, tuple[float, float, float]] = {}

    # -- per-layer costs ---------------------------------------------------------------------------------------
    def kind_costs(self, plan: Plan) -> tuple[list[PartCost], list[LayerWork], list[int]]:
        """Cost of each distinct layer kind for one micro-batch, a representative layer of each, and the kind index
        of every layer (layers of one kind share their PartWork list)."""
        r = plan.recompute
        key = (plan.tp, plan.cp, plan.ep, plan.etp, plan.micro_batch_size, plan.seq_len, plan.precision,
               r.kda, r.attention, r.moe, r.mlp, plan.dispatcher, plan.tp_comm_overlap,
               plan.cp_kda if plan.cp > 1 else None,
               plan.tp_grad_reduce, plan.sequence_parallel, plan.moe_load_imbalance, plan.host_profile,
               plan.fp8_activation_input, plan.ep_dispatch_dtype, plan.ep_replicas,
               plan.num_microbatches if plan.precision not in ("bf16", "fp8") else 0)  # recipe_cast_bytes amortises
        costs = self._kind_cache.get(key)
        if costs is None:
            ctx = Ctx(plan, self.spec, self.cluster, self.cal, plan.micro_batch_size * plan.seq_len / plan.cp)
            costs = []
            for layer in self._kinds:
                total = PartCost()
                for part in layer.parts:
                    total.add(part_cost(part, ctx))
                costs.append(total)
            self._kind_cache[key] = costs
        return costs, self._kinds, self._layer_kind

    def chunks(self, plan: Plan, kind_cost: list[PartCost], first_extra: float, last_extra: float) -> list[list[int]]:
        """balanced_chunks, cached on the kinds' relative costs (3 significant digits); or the layer-count split of
        plan.pipeline_split (uniform_chunks)."""
        if plan.pipeline_split != "balanced":
            return uniform_chunks(len(self.work.layers), plan.pp * plan.vpp, plan.pipeline_split == "uniform_account")
        scale = max(c.total + c.a2a for c in kind_cost)
        rel = tuple(round((c.total + c.a2a) / scale, 3) for c in kind_cost)
        key = (rel, round(first_extra / scale, 3), round(last_extra / scale, 3), plan.pp * plan.vpp)
        out = self._chunk_cache.get(key)
        if out is None:
            costs = [rel[k] for k in self._layer_kind]
            out = balanced_chunks(costs, plan.pp * plan.vpp, key[1], key[2])
            self._chunk_cache[key] = out
        return out

    def head_cost(self, plan: Plan) -> PartCost:
        """LM head(s) + loss on the last stage (and MTP projections): GEMM T x V/tp x h, fp32 softmax traffic
        ~16 B per logit fwd+bwd, under TP the all-reduce of the replicated head's gradient."""
        T = plan.micro_batch_size * plan.seq_len / plan.cp
        tp, cluster, cal = plan.tp, self.cluster, self.cal
        out = PartCost()
        g = gemm_time(self.work.head, T, T, tp, 1, "bf16", cluster, cal) * self.work.num_heads_out
        mtp = 0.0
        if self.spec.mtp_layers:
            h = self.spec.hidden_size
            mtp = gemm_time(Gemm("mtp.proj", n=h, k=2 * h), T, T, tp, 1, plan.precision, cluster, cal)
            mtp *= self.spec.mtp_layers
        logits = T * self.spec.vocab_size / tp * self.work.num_heads_out
        # Attention Residuals: the output mix over every block before the final norm (token-local, SP-sharded)
        out_mix = 0.0
        if self.spec.attn_res_block_size is not None:
            n = self.spec.attn_res_blocks_before(self.spec.num_layers) + 1
            out_mix = attn_res_elem_bytes(self.spec.hidden_size, n) * T / tp
        loss_f = elementwise_time(logits * 6 + out_mix, cluster, cal)
        loss_b = elementwise_time(logits * 10 + 2 * out_mix, cluster, cal)
        # moestack's TP keeps the head replicated and computes the loss on the rank's sequence shard (no gather of
        # the input); the [V, h] weight gradient is all-reduced over TP in every backward (tensor.py)
        coll = 0.0
        if tp > 1 and plan.tp_grad_reduce != "deferred":  # deferred: once per step (evaluate, "tp_grad_sum")
            grad_b = FP32 if plan.precision == "fp32" else BF16
            coll = ring_time(cluster, self.work.head.params * grad_b, tp, 1, "ar", cal.comm)
        out.fwd = g + mtp + loss_f
        out.bwd = 2 * (g + mtp) + loss_b + coll
        out.wgrad = g + mtp
        out.parts = {"gemm": 3 * (g + mtp), "elementwise": loss_f + loss_b, "tp_comm": coll}
        return out

    def embed_cost(self, plan: Plan) -> PartCost:
        """Embedding gather (fwd) and scatter-add (bwd) on the first stage; vocab-parallel reduce under TP."""
        T = plan.micro_batch_size * plan.seq_len / plan.cp
        h = self.spec.hidden_size
        out = PartCost()
        mem = elementwise_time(T * h * BF16 * 2 / plan.tp, self.cluster, self.cal)
        coll = ring_time(self.cluster, T * h * BF16, plan.tp, 1, "rs", self.cal.comm) if plan.tp > 1 else 0.0
        out.fwd, out.bwd = mem + coll, 2 * mem + coll
        out.parts = {"elementwise": 3 * mem, "tp_comm": 2 * coll}
        return out

    # -- quick lower bound (search pruning) ---------------------------------------------------------------------
    def memory_lower_bound(self, plan: Plan) -> tuple[float, float]:
        """(HBM, host) bytes the busiest rank needs at least: the rank average of weights, gradients, optimizer
        states and saved activations (a rank never holds less than the mean). Cheap: no pipeline partition."""
        kind_cost, kinds, i_kind = self.kind_costs(plan)
        key = (id(kind_cost), plan.tp, plan.ep, plan.etp)
        sums = self._sum_cache.get(key)
        if sums is None:
            dense = expert = act = 0.0
            counts: dict[int, int] = {}
            for k in i_kind:
                counts[k] = counts.get(k, 0) + 1
            for k, n in counts.items():
                for part in kinds[k].parts:
                    d, e = self._part_params_local(part, plan)
                    dense, expert = dense + d * n, expert + e * n
                act += kind_cost[k].act * n
            dense += self.work.embed_params / plan.tp * (1 if self.spec.tie_word_embeddings else 2)
            sums = self._sum_cache[key] = (dense, expert, act)
        dense, expert, act = sums
        p = plan.pp
        dense, expert, act = dense / p, expert / p, act / p
        sd, se = self._shards(plan)
        opt_b = optimizer_bytes_per_param(plan.optimizer)
        e_dev = 0.0 if plan.offload.experts else expert
        held = self._gathered_for_step(plan)  # zbv / dualpipev: gathered params, whole gradients (as _memory)
        w_d, w_e = (sd, se) if plan.zero_stage >= 1 else (1, 1)  # FSDP2 shards the fp32 parameters at every stage
        g_d, g_e = (sd, se) if plan.zero_stage >= 2 and not held else (1, 1)
        host = 0.0
        if plan.offload.optimizer:
            w_b = FP32 if plan.devices == 1 else BF16  # as _memory
            w_d, w_e = (sd, se) if plan.zero_stage == 3 else (1, 1)
            hbm = dense * w_b / w_d + e_dev * w_b / w_e
            host += (dense / sd + e_dev / se) * (FP32 + opt_b)
        else:
            hbm = dense * FP32 / w_d + e_dev * FP32 / w_e + dense * opt_b / sd + e_dev * opt_b / se
        if held and plan.zero_stage == 3:
            hbm += (dense + e_dev) * BF16  # the gathered bf16 copy
        grad_b = grad_bytes(plan)
        grads = dense * grad_b / g_d + e_dev * grad_b / g_e
        if plan.offload.experts:
            host += expert / se * (FP32 + FP32 + opt_b)
        inflight = inflight_microbatches(plan.schedule, p, plan.vpp, plan.num_microbatches)
        if plan.offload.activations:
            host += act * inflight
            act_dev = 0.0
        else:
            act_dev = act * min(inflight, (inflight + 1) / 2)  # ranks hold between 1 and `inflight` micro-batches
        # gradients that build up while activations are freed (_grads_build_up): the larger of the two at least;
        # the embedding's is produced after the first layer's backward, the end's peak (_one_end_of_backward)
        if self._grads_build_up(plan):
            hbm += max(grads - self._late_embedding_grad(plan), act_dev)
        else:
            hbm += grads + act_dev
        return hbm + self.cal.runtime_reserved_gib * GIB, host

    # -- parameters per rank ----------------------------------------------------------------------------------
    def _part_params_local(self, part: PartWork, plan: Plan) -> tuple[float, float]:
        key = (id(part), plan.tp, plan.ep, plan.etp)
        hit = self._param_cache.get(key)
        if hit is not None:
            return hit
        dense = float(part.other_params)
        for g in part.gemms:
            if g.expert:
                continue
            dense += g.params if g.split == "rep" else g.params / plan.tp
        expert = part.expert_params / (plan.ep * plan.etp)
        self._param_cache[key] = (dense, expert)
        return dense, expert

    def evaluate(self, plan: Plan) -> PlanCost:
        """Memory per device, time per step and their breakdowns for `plan` (see module docstring)."""
        spec, cluster = self.spec, self.cluster
        p, v, m = plan.pp, plan.vpp, plan.num_microbatches
        L = len(self.work.layers)
        if p * v > L:
            raise ValueError(f"pp*vpp ({p * v}) exceeds the {L} layers")
        kind_cost, kind_layer, i_kind = self.kind_costs(plan)
        head, embed = self.head_cost(plan), self.embed_cost(plan)
        chunks = self.chunks(plan, kind_cost, embed.total, head.total + head.a2a)
        ranks = chunk_ranks(p, v, plan.schedule)
        layout = StageLayout(chunks, ranks)

        # per rank per micro-batch: count layers of each kind per rank, then scale the kind's cost
        kind_params: dict[int, tuple[float, float]] = {}
        rank_counts: list[dict[int, int]] = [{} for _ in range(p)]
        rank_act_layer_max = [0.0] * p
        for c, layer_ids in enumerate(chunks):
            counts = rank_counts[ranks[c]]
            for i in layer_ids:
                counts[i_kind[i]] = counts.get(i_kind[i], 0) + 1
        rank_cost = [PartCost() for _ in range(p)]
        rank_dense = [0.0] * p
        rank_expert = [0.0] * p
        for r in range(p):
            for k_id, count in rank_counts[r].items():
                kc = kind_cost[k_id]
                rank_cost[r].add(kc, count, breakdown=False)
                rank_act_layer_max[r] = max(rank_act_layer_max[r], kc.act - kc.act_kept)
                if k_id not in kind_params:
                    dd = ee = 0.0
                    for part in kind_layer[k_id].parts:
                        d_, e_ = self._part_params_local(part, plan)
                        dd, ee = dd + d_, ee + e_
                    kind_params[k_id] = (dd, ee)
                rank_dense[r] += kind_params[k_id][0] * count
                rank_expert[r] += kind_params[k_id][1] * count
        rank_cost[ranks[0]].add(embed, breakdown=False)
        rank_cost[ranks[-1]].add(head, breakdown=False)
        rank_dense[ranks[0]] += self.work.embed_params / plan.tp
        mtp_params = self.work.mtp_proj_params * spec.mtp_layers / plan.tp
        if not spec.tie_word_embeddings:
            rank_dense[ranks[-1]] += self.work.head.params / plan.tp + mtp_params
        elif p > 1:  # tied: the last stage keeps its own copy of the embedding as the head
            rank_dense[ranks[-1]] += self.work.embed_params / plan.tp + mtp_params

        # EP all-to-all: exposed unless the plan overlaps it with another micro-batch's compute (plan.ep_comm_overlap:
        # moestack runs it under DualPipeV only, moestack/config/support.py; published Megatron runs also under
        # interleaved 1F1B). No credit from the schedule alone: DualPipeV without the field runs sequentially.
        overlap_ep = plan.ep_comm_overlap
        fwd, bwd, wgr, a2a_exposed = [], [], [], []
        for rc in rank_cost:
            compute = rc.fwd + rc.bwd + rc.recompute
            exp = _overlapped(rc.a2a, compute, overlap_ep)
            a2a_exposed.append(exp)
            share_f = exp * 0.33  # forward: dispatch + combine of 1 of the 3 passes (fwd, bwd x2 volume)
            fwd.append(rc.fwd + share_f)
            bwd.append(rc.bwd + rc.recompute + exp - share_f)
            wgr.append(rc.wgrad)
        # the host launches every kernel: a rank's pass over a micro-batch takes at least its host time
        host_f, host_b = self.host_times(plan, rank_counts, kind_layer)
        sync_f, sync_b = self.sync_times(plan, rank_counts, kind_layer)
        host_bound = [0.0] * p
        for r in range(p):
            f_dev, b_dev = fwd[r], bwd[r]
            fwd[r], bwd[r] = max(f_dev, host_f[r]) + sync_f[r], max(b_dev, host_b[r]) + sync_b[r]
            host_bound[r] = fwd[r] + bwd[r] - f_dev - b_dev
        slow = max(range(p), key=lambda r: fwd[r] + bwd[r])
        t_pipe = pipeline_time(plan.schedule, p, v, m, fwd[slow], bwd[slow], wgr[slow])
        p2p = 0.0
        act_msg = plan.micro_batch_size * plan.seq_len / plan.cp * spec.hidden_size * BF16 / plan.tp
        if p > 1 and spec.attn_res_block_size is None:
            p2p = 2 * (p * v - 1) * p2p_time(cluster, act_msg, plan.devices // p)
        elif p > 1:  # Attention Residuals: a boundary sends its n completed blocks and the partial sum
            p2p = 2 * sum(p2p_time(cluster, act_msg * (self._boundary_blocks(chunks[c][0]) + 1), plan.devices // p)
                          for c in range(1, p * v))
            self._add_boundary_state(rank_cost, chunks, ranks, act_msg)

        # data parallel, optimizer, offload
        dp_time, dp_exposed = self._dp_times(plan, rank_dense[slow], rank_expert[slow], fwd[slow], bwd[slow], m,
                                             max(1, sum(len(chunks[c]) for c in range(len(chunks))
                                                        if ranks[c] == slow)))
        opt_time, off_time, host_bytes = self._optimizer_offload(plan, rank_dense, rank_expert, rank_cost,
                                                                 fwd, bwd, m)
        tp_sum = self._deferred_tp_sum_time(plan, rank_counts[slow], kind_layer, slow == ranks[-1])
        step = t_pipe + p2p + dp_exposed + tp_sum + opt_time + off_time

        # breakdown (critical rank, per step)
        rc = PartCost()
        for k_id, count in rank_counts[slow].items():
            rc.add(kind_cost[k_id], count)
        if slow == ranks[0]:
            rc.add(embed)
        if slow == ranks[-1]:
            rc.add(head)
        time = {k: v_ * m for k, v_ in rc.parts.items()}
        time["ep_comm"] = a2a_exposed[slow] * m
        time["host"] = host_bound[slow] * m  # host time beyond the device's (the floor's share of the step)
        time["pp_bubble"] = max(0.0, t_pipe - m * (fwd[slow] + bwd[slow]))
        time["pp_p2p"] = p2p
        time["dp_comm"] = dp_exposed
        time["tp_grad_sum"] = tp_sum
        time["optimizer"] = opt_time
        time["offload"] = off_time
        time = {k: val for k, val in time.items() if val > 0}

        memory, forward_act, by_rank = self._memory(plan, rank_dense, rank_expert, rank_cost, rank_act_layer_max)
        tokens = plan.tokens_per_step
        flops = self.model_flops_per_token * tokens
        tflops = flops / step / plan.devices / 1e12
        mfu = tflops * 1e12 / cluster.device.peak_flops("bf16")
        cost = PlanCost(plan, step, tokens / step, tflops, mfu, flops, memory, cluster.device.hbm_bytes,
                        host_bytes, cluster.device.host_memory_bytes, time, "", layout,
                        list(zip(fwd, bwd, wgr)))
        cost.binding = binding_constraint(cost)
        cost.forward_activations = forward_act
        cost.memory_by_pp_rank = by_rank
        if self._gathered_for_step(plan) and plan.zero_stage >= 2:  # the memory report states why
            held = "parameters gathered, gradients unsharded" if plan.zero_stage == 3 else "gradients unsharded"
            cost.notes.append(f"{plan.schedule}: {held} for the whole step (stage is the FSDP root)")
        return cost

    def _boundary_blocks(self, position: int) -> int:
        """Completed Attention-Residual blocks entering the layer at `position` (0-based into work.layers)."""
        return self.spec.attn_res_blocks_before(min(position, self.spec.num_layers))

    def _add_boundary_state(self, rank_cost: list[PartCost], chunks: list[list[int]], ranks: list[int],
                            act_msg: float) -> None:
        """Attention Residuals under PP: per micro-batch in flight a chunk keeps the completed blocks it received
        (views of the received [n + 1, B, T, D] state that its mixes read: not counted by any of its layers) and the
        stacked state it sent (held by the pipeline stage until backward). Never offloaded (act_kept too)."""
        S = len(chunks)
        for c in range(S):
            held = (self._boundary_blocks(chunks[c][0]) if c > 0 else 0) + \
                (self._boundary_blocks(chunks[c + 1][0]) + 1 if c < S - 1 else 0)
            rank_cost[ranks[c]].act += held * act_msg
            rank_cost[ranks[c]].act_kept += held * act_msg

    def host_times(self, plan: Plan, rank_counts: list[dict[int, int]], kind_layer: list[LayerWork]
                   ) -> tuple[list[float], list[float]]:
        """Host seconds per rank of one micro-batch's forward and backward (Calibration.host: per layer per
        micro-batch, + per MoE layer under EP, + per layer under TP and under the FP8 recipe), split 1 : 2 between
        them as the kernels they launch (backward: data and weight gradients). The head and loss are inside layer_s
        (the fitted default also holds the per-step optimizer and clipping host time; a `moestack tune
        --measure-host` value does not).
        Recompute launches forward work again inside backward: a part under full recompute adds its share of the
        layer's forward host time, under selective half of it (an assumption: not measured)."""
        hc = host_calibration(plan.host_profile, self.cal)
        fp8 = fp8_recipe_runs(plan.precision, self.cluster)
        redo = {"none": 0.0, "selective": 0.5, "full": 1.0}
        fwd, bwd = [], []
        for counts in rank_counts:
            h_f = h_b = 0.0
            for k_id, count in counts.items():
                per = hc.layer_s + (hc.tp_layer_s if plan.tp > 1 else 0.0) + (hc.fp8_layer_s if fp8 else 0.0)
                if kind_layer[k_id].kind.ffn == "moe" and plan.ep * plan.etp > 1:
                    per += hc.ep_moe_s
                parts = kind_layer[k_id].parts
                again = sum(redo[recompute_mode(plan, part)] for part in parts) / max(1, len(parts))
                h_f += per / 3 * count
                h_b += per * (2 + again) / 3 * count
            fwd.append(h_f)
            bwd.append(h_b)
        return fwd, bwd

    def sync_times(self, plan: Plan, rank_counts: list[dict[int, int]], kind_layer: list[LayerWork]
                   ) -> tuple[list[float], list[float]]:
        """Device idle per rank and micro-batch pass from host syncs (HostCalibration.moe_sync_s): a dropless MoE layer
        with expert parallelism copies its token counts to the host before the all-to-all (split sizes) and the grouped
        GEMM (per-expert rows), so the device's queue drains and it waits for the host to launch the rest of the layer;
        once per forward, again in a full recompute of the MoE part. Not hidden by max(device, host): it is on both.
        A capacity factor (static buffers) needs no sync."""
        hc = host_calibration(plan.host_profile, self.cal)
        if hc.moe_sync_s <= 0 or plan.ep * plan.etp <= 1 or (self.spec.moe and self.spec.moe.capacity_factor):
            return [0.0] * plan.pp, [0.0] * plan.pp
        fwd, bwd = [], []
        for counts in rank_counts:
            n_moe = sum(c for k_id, c in counts.items() if kind_layer[k_id].kind.ffn == "moe")
            again = plan.recompute.moe == "full"
            fwd.append(n_moe * hc.moe_sync_s)
            bwd.append(n_moe * hc.moe_sync_s if again else 0.0)
        return fwd, bwd

    @staticmethod
    def _grads_build_up(plan: Plan) -> bool:
        """True when gradients do not outlive the step: one device (no FSDP / DDP buffers), one micro-batch (no
        accumulation), and the trainer's zero_grad(set_to_none=True). Backward then allocates them layer by layer
        while it frees that layer's activations. The CPU-offloaded optimizer copies the device gradients out after
        backward and the same zero_grad frees them, so it builds up the same way. FSDP2 (moestack/parallel/fsdp.py,
        every multi-device plan) also produces and reduce-scatters gradients layer by layer in backward and the
        trainer frees them after the step (measured on 2 x H200, ep2 / zero3_ep2 / tp2, 2026-11-30: the peak is the
        loss phase, before any layer gradient exists), so the same holds without a pipeline."""
        return plan.num_microbatches == 1 and plan.pp == 1

    @staticmethod
    def _gathered_for_step(plan: Plan) -> bool:
        """True under zbv / dualpipev with ZeRO sharding: the trainer makes each pipeline stage the FSDP root
        (moestack.parallel.pipeline.stage_module), so torch's schedule keeps the stage's parameters gathered (ZeRO-3's
        reshard-after-forward off) and its gradients unsharded from its first forward to the end of the step, and
        reduce-scatters them once per step: ZeRO-3 holds parameters as ZeRO-2 does, ZeRO-2 gradients as ZeRO-1."""
        return plan.schedule in V_SHAPE and plan.zero_stage > 0

    def _late_embedding_grad(self, plan: Plan) -> float:
        """Bytes of the embedding's fp32 gradient, produced after the first layer's backward (so not alive at the
        end-of-backward peak); 0 when tied to the head, whose gradient is alive since the loss."""
        return 0.0 if self.spec.tie_word_embeddings else self.work.embed_params / plan.tp * FP32

    def _one_end_of_backward(self, plan: Plan, mem: dict[str, float], expert_ws: float = 0.0,
                             first_stage: bool = True) -> None:
        """Peak of a backward whose gradients build up as activations are freed: at its start (all activations, the
        LM head's gradient, then either the loss buffers or the largest layer working set) or at its end (the
        gradients but the embedding's, plus the first layer's working set: its backward runs last). The loss backward
        runs and frees its chunk buffers before the first layer's backward starts, so the two are never alive
        together (measured on the H200 at seq 16384: the loss phase's peak was the loss chunk, not chunk + layer).
        Layers between the first and the last hold part of the gradients; they are priced by the start (largest
        working set, the head's gradient only) and the end (all gradients), not layer by layer.

        A layer's backward working set ws_k (kind k) is what its backward holds on top of the rest at its peak: the
        recomputed activations plus the gradients of them in flight, priced as the kind's no-recompute activations
        times Calibration.bwd_ws_factors["<mixer>/<ffn>"] (absent = 1). Measured (H200, 2026-11-30,
        benchmarks/memory.py --phase-peaks, 'recompute full' at seq 16384; the peak of a layer's backward minus the
        allocation at the end of the phase before): kda/dense 6.96, kda/moe 5.45, mla/moe 5.67 GiB against modelled
        5.01, 4.94, 5.14 (factors 1.39, 1.10, 1.10). The peak of that row and of 'all combined' (128 experts) was
        the first layer's backward, at the end of backward, not the loss phase.

        `expert_ws`: expert offload's working set (one layer's fetched bf16 weights + the prefetch of the next GEMM
        + the fp32 gradient staged for the host, moestack/memory/offload.py ExpertOffload / _ExpertGEMM). It is a
        transient of a MoE layer's backward, added to the MoE kinds' ws_k only: nothing is fetched before the first
        layer's backward, so at the loss phase it is not alive, nor at the end of backward when the first layer is
        dense (the proxy's).
        Measured (H200, all combined, seq 16384): the peak moved +0.18 GiB from 128 to 384 experts (2026-11-29),
        where a loss-phase sum would have moved +2.6 GiB; at 128 experts the MoE layers' backward transients were
        6.29-6.60 GiB (2026-11-30, working set 1.32 GiB included), below the dense first layer's 6.96.

        The embedding's fp32 gradient (V x h / tp x 4 bytes, on the first stage, untied) is produced after the first
        layer's backward (measured: the end of the 'layer 0 backward' phase rose by it, 0.95 GiB), so it is not
        alive at that layer's peak and the end leaves it out.

        The head term stands for what the loss backward holds of the LM head, V x h / tp x 4 bytes: the chunks share
        one autocast cast of the fp32 weight (one ToCopyBackward node), so their bf16 weight gradients accumulate in
        that node's input buffer (2 bytes) while each chunk's recompute holds its own bf16 cast of the weight for
        the GEMM backward (2 bytes); the fp32 gradient appears once all chunks are done (chunk buffers freed).
        `hidden_loss`: the final norm's saved fp32 input and normalised output, its fp32 output kept by the loss
        chunks' checkpoints and the accumulating fp32 gradient of that output: 4 x T x h x 4 bytes on the loss
        stage (the residual stream is fp32: fp32 embedding + residual adds under autocast)."""
        kind_cost, kinds, layer_kind = self.kind_costs(plan.model_copy(update={"recompute": RecomputePolicy()}))
        factors = self.cal.bwd_ws_factors
        ws = [c.act * factors.get(f"{k.kind.mixer}/{k.kind.ffn}", 1.0) + (expert_ws if k.kind.ffn == "moe" else 0.0)
              for c, k in zip(kind_cost, kinds)]
        head = (self.work.head.params * self.work.num_heads_out / plan.tp) * FP32
        T = plan.micro_batch_size * plan.seq_len / plan.cp
        hidden_loss = 4 * T * self.spec.hidden_size * FP32 / plan.tp if mem["buffers"] > 0 else 0.0
        layer = max(mem["buffers"] + hidden_loss, max(ws))
        start = mem["activations"] + min(head, mem["gradients"]) + layer
        embedding = self._late_embedding_grad(plan) if first_stage else 0.0
        first = ws[layer_kind[0]]  # the backward that runs last: the first layer's
        end = max(0.0, mem["gradients"] - embedding) + first
        if start >= end:
            mem["gradients"] = min(head, mem["gradients"])
            mem["buffers"] = layer
        else:
            mem["activations"] = 0.0
            mem["gradients"] = max(0.0, mem["gradients"] - embedding)
            mem["buffers"] = first

    def _deferred_tp_sum_time(self, plan: Plan, counts: dict[int, int], kind_layer: list[LayerWork],
                              has_head: bool) -> float:
        """plan.tp_grad_reduce = deferred (moestack/parallel/tensor.py `finish_tp_grad_reduce`): the partial TP
        gradients of one rank summed once per step, after the last backward, exposed; on FSDP's fp32 gradients,
        sharded over the dense dp_shard (the reduce-scatter ran first); bucketed, so one ring all-reduce's time."""
        if plan.tp <= 1 or plan.tp_grad_reduce != "deferred":
            return 0.0
        nbytes = sum(tp_grad_sum_bytes(part, plan) * count for k_id, count in counts.items()
                     for part in kind_layer[k_id].parts)  # fmt: skip
        grad_b = FP32 if plan.precision == "fp32" else BF16
        if has_head:
            nbytes += self.work.head.params * grad_b
        nbytes *= FP32 / grad_b / self._shards(plan)[0]
        return ring_time(self.cluster, nbytes, plan.tp, 1, "ar", self.cal.comm) if nbytes else 0.0

    def _dp_times(self, plan: Plan, dense: float, expert: float, fwd: float, bwd: float, m: int,
                  layers: int) -> tuple[float, float]:
        """Gradient reduction and parameter gathers over the data-parallel groups (dense: dp, stride tp*cp;
        experts: edp, stride ep*etp). ZeRO-0: all-reduce; 1: reduce-scatter + all-gather of updated fp32 params,
        once per step, overlapped with the last backward / first forward except the last bucket; 2: the
        reduce-scatter per micro-batch; 3 (FSDP2): bf16 all-gather before fwd and bwd and fp32 reduce-scatter,
        every micro-batch, prefetched one layer ahead. zbv / dualpipev (`_gathered_for_step`): gathered once and
        reduce-scattered once per step, so ZeRO-2 is priced as ZeRO-1 and ZeRO-3 as one bf16 all-gather + one
        reduce-scatter per step."""
        cl, cm = self.cluster, self.cal.comm
        # dense gradients are summed over the context-parallel ranks too (their sequence shares add up): one group of
        # dp * cp ranks, stride tp (moestack/parallel/mesh.py dp_shard_cp; Megatron's data-parallel-with-CP group)
        dpc, dp_stride, edp_stride = plan.dp * plan.cp, plan.tp, plan.ep * plan.etp
        edp = plan.edp
        if _experts_tp_replicated(plan):  # summed over TP per micro-batch (part_cost); FSDP then reduces over dp
            edp, edp_stride = dpc, dp_stride
        z = plan.zero_stage
        held = self._gathered_for_step(plan)
        if held and z == 2:
            z = 1  # one reduce-scatter per step (moestack.parallel.pipeline.stage_module)
        g_dense, g_exp = dense * grad_bytes(plan), expert * grad_bytes(plan)
        if z == 0:
            rs = ring_time(cl, g_dense, dpc, dp_stride, "ar", cm) + ring_time(cl, g_exp, edp, edp_stride, "ar", cm)
            return rs, max(rs - 0.9 * bwd, rs / layers)
        rs = ring_time(cl, g_dense, dpc, dp_stride, "rs", cm) + ring_time(cl, g_exp, edp, edp_stride, "rs", cm)
        if z == 1:
            ag = ring_time(cl, g_dense, dpc, dp_stride, "ag", cm) + ring_time(cl, g_exp, edp, edp_stride, "ag", cm)
            exposed = max(rs - 0.9 * bwd, rs / layers) + max(ag - 0.9 * fwd, ag / layers)
            return rs + ag, exposed
        if z == 2:
            ag = ring_time(cl, g_dense, dpc, dp_stride, "ag", cm) + ring_time(cl, g_exp, edp, edp_stride, "ag", cm)
            per_mb = max(0.0, rs - 0.9 * bwd) + OVERLAP_RESIDUAL * min(rs, bwd)
            return m * rs + ag, m * per_mb + max(ag - 0.9 * fwd, ag / layers)
        w_dense, w_exp = dense * BF16, expert * BF16
        ag = ring_time(cl, w_dense, dpc, dp_stride, "ag", cm) + ring_time(cl, w_exp, edp, edp_stride, "ag", cm)
        if held:  # no reshard after forward, no reduce per micro-batch (pipeline.stage_module)
            return rs + ag, max(rs - 0.9 * bwd, rs / layers) + max(ag - 0.9 * fwd, ag / layers)
        per_mb = _overlapped(ag, fwd, True) + _overlapped(ag + rs, bwd, True)
        return m * (2 * ag + rs), m * per_mb

    def _shards(self, plan: Plan) -> tuple[int, int]:
        """(dense, expert) ZeRO shard counts: dense over dp_shard x cp (FSDP2's dp_shard_cp mesh under context
        parallelism; Megatron's distributed optimizer likewise shards over data parallel with CP), experts over their
        DP group less replicas."""
        if plan.zero_stage == 0:
            return 1, 1
        if _experts_tp_replicated(plan):  # experts shard with their block over the dense dp mesh
            return plan.dp_shard * plan.cp, plan.dp_shard * plan.cp
        return plan.dp_shard * plan.cp, max(1, plan.edp // plan.dp_replicate)

    def _optimizer_offload(self, plan: Plan, dense: list[float], expert: list[float], rank_cost: list[PartCost],
                           fwd: list[float], bwd: list[float], m: int) -> tuple[float, float, float]:
        """Optimizer step (HBM-bound; Muon adds Newton-Schulz GEMMs), offload transfers over the host link and the
        host memory they need, for the busiest rank."""
        cl, cal = self.cluster, self.cal
        sd, se = self._shards(plan)
        link = max(cl.device.host_link_gb_s, 1e-9) * 1e9
        opt_t = off_t = host = 0.0
        for r in range(plan.pp):
            local_d, local_e = dense[r] / sd, expert[r] / se
            on_dev = local_d + (0.0 if plan.offload.experts else local_e)
            t_opt = elementwise_time(on_dev * optimizer_step_bytes(plan.optimizer), cl, cal)
            if plan.optimizer == "muon":
                t_opt += self._muon_time(plan, r)
            t_off = 0.0
            h = 0.0
            if plan.offload.optimizer:
                # grads down (fp32), bf16 params up, CPU update; master + states live in host memory
                t_opt = on_dev / cal.cpu_adam_params_per_s
                t_off += on_dev * (FP32 + BF16) / link
                h += on_dev * (FP32 + optimizer_bytes_per_param(plan.optimizer))
            if plan.offload.experts:
                ex = expert[r]
                # per micro-batch: weights up for fwd and bwd (bf16), grads down (fp32); prefetched under compute
                per_mb = ex * (2 * BF16 + FP32) / link
                t_off += m * max(0.0, per_mb - 0.9 * (fwd[r] + bwd[r]))
                t_opt = max(t_opt, local_e / cal.cpu_adam_params_per_s)
                h += local_e * (FP32 + FP32 + optimizer_bytes_per_param(plan.optimizer))
            if plan.offload.activations:
                act = rank_cost[r].act
                per_mb = act / link
                t_off += m * (max(0.0, per_mb - 0.9 * fwd[r]) + max(0.0, per_mb - 0.9 * bwd[r]))
                h += act * inflight_microbatches(plan.schedule, plan.pp, plan.vpp, m)
            opt_t, off_t, host = max(opt_t, t_opt), max(off_t, t_off), max(host, h)
        return opt_t, off_t, host

    def _muon_time(self, plan: Plan, rank: int) -> float:
        """Newton-Schulz for this rank's matrices (each device orthogonalises its 1/shards share of matrices)."""
        sd, se = self._shards(plan)
        flops = 0.0
        for layer in self._kinds:
            count = sum(1 for x in self.work.layers if x.parts is layer.parts) / plan.pp
            for part in layer.parts:
                for g in part.gemms:
                    if g.expert:
                        flops += count * muon_flops(g.n, g.k) * part.num_experts / (plan.ep * plan.etp) / se
                    else:
                        flops += count * muon_flops(g.n, g.k) / sd / (1 if g.split == "rep" else plan.tp)
        peak = self.cluster.device.peak_flops("bf16")
        return flops / (peak * self.cal.gemm_peak_eff * 0.8)

    def _memory(self, plan: Plan, dense: list[float], expert: list[float], rank_cost: list[PartCost],
                act_layer_max: list[float]) -> tuple[dict[str, float], float, list[dict[str, float]]]:
        """Bytes on the busiest rank, by component (module docstring; ZeRO per Rajbhandari et al. 2020), that
        rank's activations at the end of forward (before the one-end-of-backward accounting), and every pipeline
        rank's components (the dry run compares its rank with them)."""
        cal, spec = self.cal, self.spec
        sd, se = self._shards(plan)
        m = plan.num_microbatches
        T = plan.micro_batch_size * plan.seq_len / plan.cp
        opt_b = optimizer_bytes_per_param(plan.optimizer)
        best: dict[str, float] = {}
        best_fwd_act = 0.0
        by_rank: list[dict[str, float]] = []
        # zbv / dualpipev: the stage is the FSDP root (moestack.parallel.pipeline.stage_module): parameters stay
        # gathered (bf16 copy, as ZeRO 0-2) and gradients unsharded (fp32) for the whole step
        held = self._gathered_for_step(plan)
        head_rank = chunk_ranks(plan.pp, plan.vpp, plan.schedule)[-1]  # the last chunk: LM head and loss (V: rank 0)
        for r in range(plan.pp):
            d, e = dense[r], expert[r]
            w_shard_d = sd if plan.zero_stage == 3 else 1
            w_shard_e = se if plan.zero_stage == 3 else 1
            g_shard_d = sd if plan.zero_stage >= 2 and not held else 1
            g_shard_e = se if plan.zero_stage >= 2 and not held else 1
            mem: dict[str, float] = {}
            e_dev = 0.0 if plan.offload.experts else e
            # embedding / LM head parameters on this rank (in d): AdamW under Muon, bf16 under the fp8 recipe
            vocab_params = ((r == 0) + (r == head_rank and not spec.tie_word_embeddings)) * \
                spec.vocab_size * spec.hidden_size / plan.tp
            if plan.offload.optimizer:
                # the device keeps a bf16 copy for compute (distributed plans: FSDP2 bf16 params); the one-device
                # trainer keeps its fp32 parameters under autocast (moestack.memory.adamw.CPUOffloadAdamW leaves
                # device parameters in their dtype), as autocast_weight_copies assumes
                w_b = FP32 if plan.devices == 1 else BF16
                mem["weights"] = d * w_b / w_shard_d + e_dev * w_b / w_shard_e
                if held and plan.zero_stage == 3:
                    mem["weights"] += (d + e_dev) * BF16  # the gathered copy
                mem["optimizer"] = 0.0
            else:
                # FSDP2 shards the fp32 parameters at every ZeRO stage (moestack/parallel/fsdp.py; Megatron's
                # distributed optimizer likewise keeps the fp32 master weights sharded): ZeRO 1/2 add the bf16 copy
                mem["weights"] = d * FP32 / sd + e_dev * FP32 / se
                mem["optimizer"] = d * opt_b / sd + e_dev * opt_b / se
                if plan.optimizer == "muon":  # Muon leaves the embedding and the LM head to AdamW (8 bytes)
                    mem["optimizer"] += vocab_params * (optimizer_bytes_per_param("adamw") - opt_b) / sd
            if plan.devices > 1 and (plan.zero_stage < 3 or held) and not plan.offload.optimizer:
                # FSDP2 (moestack/parallel/fsdp.py) computes with a bf16 copy of the parameters gathered in forward
                # and kept until backward under ZeRO 0-2; with one shard (ZeRO-0, or dp_shard = 1, e.g. pure TP)
                # that copy comes on top of the whole fp32 parameters
                fsdp = d * FP32 / sd + e_dev * FP32 / se + BF16 * bf16_weight_copy(plan, self.cluster, d, e_dev,
                                                                                   vocab_params)
                mem["weights"] = max(mem["weights"], fsdp)
            grad_b = grad_bytes(plan)
            mem["gradients"] = d * grad_b / g_shard_d + e_dev * grad_b / g_shard_e
            inflight = inflight_microbatches(plan.schedule, plan.pp, plan.vpp, m)
            if r > 0 and plan.schedule in ("1f1b", "interleaved_1f1b"):
                inflight = max(1.0, inflight - r * (2 if plan.schedule == "interleaved_1f1b" else 1) / plan.vpp)
            act = rank_cost[r].act
            if plan.offload.activations:  # layers in flight (copying out / being produced) + what is never offloaded
                in_flight = ACT_OFFLOAD_LAYERS * cal.act_factors.get("activation_offload", 1.0)
                mem["activations"] = in_flight * act_layer_max[r] + rank_cost[r].act_kept * inflight
            else:
                mem["activations"] = act * inflight
            buffers = 0.0
            if r == head_rank and framework_of(plan.host_profile) == "megatron":
                # Megatron's vocabulary-parallel fused cross-entropy (Transformer Engine): the bf16 logits of the
                # rank's vocabulary shard, their gradient written in place, per output head (main + MTP)
                buffers = max(buffers, T * spec.vocab_size / plan.tp * BF16 * self.work.num_heads_out)
            elif r == head_rank:  # the chunked loss: one chunk's logits at a time
                # under TP the head is replicated and each rank runs the loss on its sequence shard (head_cost):
                # chunks of the full vocabulary over T / tp tokens (tp2, 2 x H200: +7.5 GiB in the loss phase)
                buffers = max(buffers, min(T / plan.tp, LOSS_CHUNK_TOKENS) * spec.vocab_size * LOSS_BYTES_PER_LOGIT)
            if spec.moe is not None:
                moe_buf = (T / plan.tp * spec.moe.top_k * (spec.moe.latent_size or spec.hidden_size) * BF16
                           * MOE_MEMORY_HEADROOM * 2)
                buffers = max(buffers, moe_buf)
            if plan.zero_stage == 3 and not held:  # held: the whole gathered copy is in "weights"
                per_layer = (d + e) / max(1, len(self.work.layers) / plan.pp)
                buffers += 2 * per_layer * BF16
            if fp8_recipe_runs(plan.precision, self.cluster):
                # the fp8 weight cache (moestack/ops/fp8/weight_cache.py): both layouts, 1 byte each, of the
                # FP8 GEMMs' weights (all but embedding / head) until the optimizer step; under ZeRO-3 only those of
                # the layer gathered now (it drops what FSDP frees)
                fp8_bytes = 2 * (max(0.0, d - vocab_params) + e_dev)
                recipe = GEMM_RECIPES[plan.precision]
                if recipe.scaling == "native":  # Transformer Engine: row- and column-wise copies, with their scales
                    fp8_bytes *= recipe.elem_bytes + recipe.scale_bytes
                gathered = plan.zero_stage == 3 and not held
                mem["fp8_weights"] = fp8_bytes / max(1, len(self.work.layers) / plan.pp) if gathered else fp8_bytes
            expert_ws = 0.0
            if plan.offload.experts:  # one layer's fetched bf16 weights, the next GEMM's prefetch, the fp32 dW
                per_layer_e = e / max(1, len(self.work.layers) / plan.pp)
                expert_ws = 2 * per_layer_e * BF16 + per_layer_e * FP32
            if plan.offload.experts and not self._grads_build_up(plan):
                buffers += expert_ws  # several micro-batches / devices: kept as a sum (not measured)
            if plan.tp > 1:
                buffers += T * spec.hidden_size * BF16
            mem["buffers"] = buffers
            fwd_act = mem["activations"]
            if self._grads_build_up(plan):
                self._one_end_of_backward(plan, mem, expert_ws, r == 0)
            mem["reserved"] = cal.runtime_reserved_gib * GIB
            by_rank.append(mem)
            if sum(mem.values()) > sum(best.values()):
                best, best_fwd_act = mem, fwd_act
        return best, best_fwd_act, by_rank


def binding_constraint(cost: PlanCost) -> str:
    """The limit this plan hits first: memory when within 5% of HBM, else the largest exposed time term."""
    if cost.host_bytes > cost.host_capacity:
        return f"host memory ({cost.host_bytes / GIB:.0f} GiB needed > {cost.host_capacity / GIB:.0f} GiB)"
    frac = cost.memory_fraction
    if frac > 0.95:
        return f"memory ({frac:.0%} of HBM)"
    names = {"gemm": "GEMM compute", "attention": "attention kernels", "kda": "KDA kernels",
             "elementwise": "memory-bound kernels", "recompute": "recompute", "tp_comm": "TP communication",
             "cp_comm": "CP communication", "ep_comm": "EP all-to-all", "pp_bubble": "pipeline bubble",
             "pp_p2p": "pipeline p2p", "dp_comm": "DP communication", "tp_grad_sum": "deferred TP gradient sums",
             "optimizer": "optimizer step",
             "offload": "host offload link", "host": "host (CPU) launch time"}
    key = max(cost.time, key=cost.time.get)
    return f"{names.get(key, key)} ({cost.time[key] / cost.step_time_s:.0%} of step)"
