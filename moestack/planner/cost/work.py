"""1. Work: what one token costs in each sub-layer, forward: the GEMMs (with their shapes and how tensor parallelism
splits them), attention / KDA / sparse-attention FLOPs, elementwise HBM traffic, saved activation bytes and
parameters. Pure shape arithmetic from the ModelSpec (legend: moestack/planner/cost/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moestack.config.model_spec import LayerKind, ModelSpec

BF16, FP32, INT64 = 2, 4, 8
ROUTER = "moe.router"  # the router GEMM: its FLOPs are reported apart from the model's (Megatron leaves them out)


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

    kind: str  # kda | mla | gqa | mamba2 | dense | moe (attn_res: the output mix, profile.py)
    gemms: list[Gemm] = field(default_factory=list)
    attn_flops: float = 0.0  # flash (dense causal) attention core, all heads
    sparse_attn_flops: float = 0.0  # DSA top-k attention core (MQA form over the shared latent)
    kda_flops: float = 0.0  # chunked KDA / SSD scan core, all heads
    indexer_flops: float = 0.0  # lightning-indexer scores
    attn_res_flops: float = 0.0  # Attention-Residual mix: scores and weighted sum, 4 h n (priced by elem_bytes)
    topk_elems: float = 0.0  # scores scanned by top-k selection
    elem_bytes: float = 0.0  # elementwise HBM traffic (norms, activations, gates, permutes), split by tp (SP)
    act_keep: float = 0.0  # saved bytes that stay under "selective"
    act_selective: float = 0.0  # saved bytes "selective" drops (recomputed)
    act_replicated: float = 0.0  # saved bytes not split by tp (replicated MLA latents)
    expert_act: float = 0.0  # saved bytes per token on the expert side (already x top_k)
    expert_act_selective: float = 0.0  # of which "selective" drops (expert activation outputs, `moe_act`)
    fp8_saved: float = 0.0  # saved GEMM inputs that the fp8 recipe stores in 1 byte instead of 2 (kept part)
    expert_fp8_saved: float = 0.0  # the same on the expert side
    # every tensor autograd keeps without recompute, listed one by one with fused attention / scan kernels
    # (ArchProfile.act_bytes_per_token); the act_* fields are the cost model's estimate split by recompute policy
    autograd_saved_bytes: float = 0.0
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

    @property
    def activated_params(self) -> int:
        """Parameters one token's forward touches: all but the routed experts it is not sent to."""
        return self.dense_params + self.top_k * (sum(g.params for g in self.gemms if g.expert) + self.expert_bias)

    def fwd_gemm_flops(self) -> float:
        return sum(2.0 * g.n * g.k * g.copies for g in self.gemms)

    def fwd_router_flops(self) -> float:
        return sum((2.0 * g.n * g.k for g in self.gemms if g.name == ROUTER), 0.0)


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


def _mlp_act_bytes(inter: int, gated: bool) -> tuple[float, float, float]:
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
    decay = Hv * d if k.decay == "channel" else Hv
    # attn norm, convs, A_log [Hv], dt_bias [Hv*K or Hv], o_norm [K]
    other = h + conv + Hv + decay + d
    # autograd keeps: input; proj outs (conv in), conv outs (SiLU in), SiLU outs; L2-normed q, k; low-rank
    # decay / gate hiddens; decay input; beta; o, o_norm out, gate pre-activation, gated o; fp32 log-decay and beta
    saved = (h + 3 * qkv + 2 * H * d + (k.gate_rank or 0) + decay + (k.output_gate_rank or 0) + Hv
             + 4 * Hv * d) * BF16 + (decay + Hv) * FP32
    return PartWork("kda", gemms, kda_flops=core, elem_bytes=elem, act_keep=keep, act_selective=sel,
                    other_params=other, conv_params=conv, autograd_saved_bytes=saved)


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
    conv_dim = di + 2 * G * N
    conv = conv_dim * m.conv_kernel_size
    # norm, conv (+ bias), dt_bias, A_log, D [nh], gated norm [Di], in_proj and out_proj biases (proj_bias)
    other = h + conv + (conv_dim if m.conv_bias else 0) + 3 * H + di + ((in_n + h) if m.proj_bias else 0)
    # autograd keeps: input, in_proj out, conv out, SiLU out, y, norm out; fp32 dt
    saved = (h + in_n + 2 * conv_dim + 2 * di) * BF16 + H * FP32
    return PartWork("mamba2", gemms, kda_flops=7.0 * di * N, elem_bytes=elem, act_keep=keep, act_selective=sel,
                    other_params=other, conv_params=conv, autograd_saved_bytes=saved)


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
    part.autograd_saved_bytes = _mla_saved_bytes(spec)
    return part


def _mla_saved_bytes(spec: ModelSpec) -> float:
    """What autograd keeps for one MLA token: input, q_a out and its norm's out, kv_a out and its norm's out,
    gate pre-activation and gated output, the attention output O and its fp32 log-sum-exp; dense: the kernel's q,
    k, v; sparse (DSA, MQA form): absorbed query [H, C+R], latent output [H, C], the top-k indices, the indexer's q,
    k (before and after its LayerNorm) and head weights."""
    a, h = spec.mla, spec.hidden_size
    H, R, C, dv = a.num_heads, a.qk_rope_head_dim, a.kv_lora_rank, a.v_head_dim
    saved = (h + 2 * (a.q_lora_rank or 0) + (C + R) + C + H * dv + (2 * H * dv if a.output_gate else 0)) * BF16
    saved += H * FP32
    idx = a.indexer
    if idx is None:
        return saved + (2 * H * a.qk_head_dim + H * dv) * BF16
    indexer = idx.num_heads * idx.head_dim + 2 * idx.head_dim + idx.num_heads
    return saved + (H * (C + R) + H * C + indexer) * BF16 + idx.top_k * FP32


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
    # attn norm, q_norm and k_norm [E], q / k / v biases (the fused output gate has none)
    other = h + (2 * d if g.qk_norm else 0) + ((H + 2 * Hkv) * d if g.qkv_bias else 0)
    # autograd keeps: input, q, k, v, O, the qk norms' inputs, the gate pre-activation and gated O; fp32 LSE
    saved = (h + (H + 2 * Hkv) * d + H * d + ((H + Hkv) * d if g.qk_norm else 0)
             + (2 * H * d if g.output_gate else 0)) * BF16 + H * FP32
    return PartWork("gqa", gemms, attn_flops=4.0 * _causal_pairs(s, window) * H * d, elem_bytes=elem, act_keep=keep,
                    act_selective=sel, other_params=other, o_in=H * d * BF16, window=window,
                    autograd_saved_bytes=saved)


def dense_mlp_work(spec: ModelSpec) -> PartWork:
    assert spec.dense_mlp is not None
    h, inter = spec.hidden_size, spec.dense_mlp.intermediate_size
    gated = spec.gated_mlp
    keep, sel, elem = _mlp_act_bytes(inter, gated)
    norm_keep, norm_sel = _norm_bytes(h)
    return PartWork("dense", _glu_gemms("mlp", h, inter, gated), elem_bytes=elem + 5 * h * BF16,
                    act_keep=keep + norm_keep, act_selective=sel + norm_sel, other_params=h,
                    fp8_saved=(h + inter) * BF16, fc2_in=sel, fc1_out=keep,
                    autograd_saved_bytes=(h + (3 if gated else 2) * inter) * BF16)  # input, gate / up, act out


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
    ek, es, eelem = _mlp_act_bytes(inter, gated)
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
        sk, ss, selem = _mlp_act_bytes(moe.shared_intermediate_size, gated)
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
    part.autograd_saved_bytes = _moe_saved_bytes(spec)
    return part


def _moe_saved_bytes(spec: ModelSpec) -> float:
    """What autograd keeps for one MoE token: the input (router, down_proj and shared experts read it), fp32
    router scores and top-k weights, int64 top-k ids; LatentMoE: latent h, combined y and the latent norm's out;
    per routed slot: expert input, output, gate / up and activation outputs; the shared experts' gate / up and
    activation outputs and their gate's output."""
    moe, h = spec.moe, spec.hidden_size
    k, mult = moe.top_k, 3 if spec.gated_mlp else 2
    lat = moe.latent_size or h
    saved = h * BF16 + (moe.num_experts + k) * FP32 + k * INT64 + (3 * lat if moe.latent_size else 0) * BF16
    saved += k * (2 * lat + mult * moe.expert_intermediate_size) * BF16
    return saved + (mult * moe.shared_intermediate_size + (1 if moe.shared_expert_gate else 0)) * BF16


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
    part.attn_res_flops += 4.0 * h * n_sources
    nbytes = attn_res_elem_bytes(h, n_sources)
    part.elem_bytes += nbytes
    part.sp_elem += nbytes
    saved = h * BF16 + 2 * n_sources * FP32
    part.act_selective += saved
    part.sp_sel += saved
    part.autograd_saved_bytes += saved
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


# GEMMs with a bias under ModelSpec.linear_bias (GPT-2/3): GQA's output projection and the MLP layers; KDA and
# MLA take no biases, Mamba-2's follow mamba2.proj_bias and GQA's q / k / v gqa.qkv_bias
LINEAR_BIASES = ("gqa.o", "mlp.up", "mlp.down", "shared.up", "shared.down")


def block_extras(spec: ModelSpec, part: PartWork) -> PartWork:
    """What every sub-layer adds around its own work: its pre-norm and residual (the sequence-parallel region:
    PartWork.sp_*), a LayerNorm's bias (spec.norm) and, with spec.linear_bias, the GPT-2/3 biases (LINEAR_BIASES),
    the routed experts' with the experts (parameters only: Megatron's FLOPs leave biases out)."""
    h = spec.hidden_size
    part.sp_keep, part.sp_sel = _norm_bytes(h)
    part.sp_elem = 5 * h * BF16  # norm read + write, residual add (read two, write one)
    layernorm = spec.norm == "layernorm"
    if layernorm:
        part.other_params += h
    part.autograd_saved_bytes += h * BF16 + (2 if layernorm else 1) * FP32  # norm input; rstd (and mean)
    if spec.linear_bias:
        part.other_params += sum(g.n for g in part.gemms if g.name in LINEAR_BIASES)
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
