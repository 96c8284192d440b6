"""Context parallelism (CP): one sequence split over `cp` ranks, applied from outside the model.

Split: contiguous. Rank r holds tokens [r*T_l, (r+1)*T_l) of every sequence (T_l = T / cp). KDA is a recurrence
and needs its tokens in order; a load-balanced zig-zag split (rank r holds chunks r and 2cp-1-r) would balance the
causal attention work but turn the KDA state relay into two relays per layer, so it is not used (with 3/4 of the
K3 layers linear, the attention imbalance is the smaller cost).

Per module (every rank runs the whole layer stack on its own tokens; the model code is single-device):
  short convs   halo exchange: each conv input is prefixed with the last W-1 rows of the previous rank (relay mode:
                point-to-point from rank r-1; scan mode: one small all-gather of the [B, W-1, C] tails); rank 0
                gets zeros, as the causal padding would give
  KDA           plan.cp_kda / apply_cp(kda_state=...):
                "relay" (default): rank r receives the final recurrent state S [B, H, K, V] of rank r-1, runs
                `chunk_kda` from it (initial_state) and sends its own final state to rank r+1 (send/recv, fp32).
                Backward relays dS the other way. Exact (the same recurrence, run in pieces). Cost: the ranks run a
                KDA layer one after another (latency cp x one shard's KDA time; memory and everything outside KDA
                are still split cp ways); micro-batches or other sequences fill the wait only in a pipelined
                schedule. Point-to-point only (halos too).
                "scan": every rank runs its shard at once from a zero state with the value width widened to K + V,
                which also yields its shard's transition M (product of the (I - b k k^T) Diag(alpha)) and the
                transformed queries M_t^T q_t; an all-gather of the cp [M | S_loc], a prefix composition, and an
                exact output correction (see "The scan" below). ~1.84x the KDA core FLOPs (d 128, C 64) but no
                waiting. Collectives only (halos by all-gather), identical graphs on all ranks.
  Gated MLA     the compressed latent [c_kv | k_rope] (C + R values per token, the smallest thing that carries
                the keys and values) is all-gathered over CP (backward: reduce-scatter of its gradient); each rank
                attends its T_l queries to the keys at global positions <= its own (causal mask by global
                position). Dense path: kv_b decompresses the gathered latent. Sparse DSA: the indexer key k_idx
                [B, T, Di] is all-gathered too; top-k runs over the queries [0, (r+1)*T_l) (earlier rows zero, then
                dropped: causal, so the local rows see exactly the keys they would on one device); the KL loss of
                the local queries rides on the output divided by cp (the single-device loss is the mean over all
                queries, and CP gradients are summed over the ranks). Dense DSA warm-up: dense attention as
                above, and the KL over all visible keys from the same zero-padded block of rows.
  GQA           keys and values all-gathered (per head; GQA has no latent), causal mask by global position.
  MoE           per token: no change. The sequence-wise aux loss sums its expert counts over the CP group
                (`MoE.seq_shard_group`).
  root          tokens and targets sliced; the loss is the exact mean over the whole sequence (sum and count of
                the counted tokens all-reduced over CP); logits without targets are all-gathered.

Gradients: every rank's backward yields its tokens' share of each replicated parameter's gradient; the shares add
up over the CP group (FSDP over the (dp_shard, cp) ranks with divide factor dp does it in `parallelize`;
`sync_cp_grads` for tests and plain models). Not supported under CP: packed documents (cu_seqlens), activation
recompute of KDA layers in relay mode (the recomputed forward would wait for a state that the previous rank only
sends again in its own backward; the scan mode recomputes: its collectives rerun on every rank in the same order),
pipeline parallelism together with CP (untested). With TP (apply_tp first): TP splits my CP shard (sequence-parallel
shards of T/(cp*tp), heads over tp); states, halos and latents go over the CP group of my TP index.

Legend: B batch, T tokens of the whole sequence, T_l = T / cp local tokens, C channels, W conv width.
"""

from __future__ import annotations

import contextvars
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import moestack.model.kda as kda_module
from moestack.model.aux_loss import attach_aux_loss
from moestack.model.dsa import GatedMLA
from moestack.model.gqa import GQAAttention
from moestack.model.kda import KDAAttention, ShortConv
from moestack.model.moe import MoE
from moestack.model.rope import apply_rope, rope_cos_sin, rope_positions
from moestack.model.transformer import Transformer
from moestack.model.wrappers import wrap_forward
from moestack.ops import dsa as dsa_ops
from moestack.ops.dsa import reference as dsa_ref
from moestack.ops.kda import chunk_kda as _chunk_kda
from moestack.parallel.tensor import gather_shards, reduce_from_tp, shard_slice

SEQ_DIM = 1


class CPInfo:
    """The CP group as the wrapped modules need it: mesh, rank, size, and the global offset of my tokens."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh, self.group = mesh, mesh.get_group()
        self.rank, self.size = mesh.get_local_rank(), mesh.size()

    def global_rank(self, cp_rank: int) -> int:
        return dist.get_global_rank(self.group, cp_rank)


# ---------------------------------------------------------------------------------------------------------------
# point-to-point relays (halo rows, KDA state): forward from rank r to r+1, gradients from r+1 back to r.
# Only p2p traffic runs inside a KDA layer, so no rank ever waits in a collective for a peer that is itself waiting
# for this rank's p2p message (a collective there can deadlock: autograd may run it before the relay's send). Every
# relay has its own tag: peers then match messages even if autograd visits the relays in different orders.


class _Recv(torch.autograd.Function):
    """Forward: receive a tensor from `peer`. Backward: send its gradient back. `anchor` (any input requiring
    grad) only makes autograd call backward."""

    @staticmethod
    def forward(ctx, anchor, shape, dtype, peer, group, tag):
        ctx.peer, ctx.group, ctx.tag = peer, group, tag
        s = torch.empty(shape, dtype=dtype, device=anchor.device)
        dist.recv(s, src=peer, group=group, tag=tag)
        return s

    @staticmethod
    def backward(ctx, ds):
        dist.send(ds.contiguous(), dst=ctx.peer, group=ctx.group, tag=ctx.tag)
        return None, None, None, None, None, None


class _Send(torch.autograd.Function):
    """Forward: send `s` to `peer`, return `o` unchanged. Backward: receive ds from the peer."""

    @staticmethod
    def forward(ctx, o, s, peer, group, tag):
        ctx.peer, ctx.group, ctx.tag, ctx.s_meta = peer, group, tag, (s.shape, s.dtype)
        dist.send(s.detach().contiguous(), dst=peer, group=group, tag=tag)
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        ds = torch.empty(ctx.s_meta[0], dtype=ctx.s_meta[1], device=do.device)
        dist.recv(ds, src=ctx.peer, group=ctx.group, tag=ctx.tag)
        return do, ds, None, None, None


_TAGS = iter(range(1000, 10**9))  # one tag per relay point (assigned at apply time, identical on every rank)


def relay(x: torch.Tensor, send: torch.Tensor | None, recv_shape, recv_dtype, cp: CPInfo, tag: int):
    """Receive a tensor of recv_shape from CP rank r-1 (None on rank 0), then send `send` to rank r+1 (not on the
    last rank); returns (x passed through the send, received tensor). Differentiable both ways."""
    got = None
    if cp.rank > 0:
        got = _Recv.apply(x, recv_shape, recv_dtype, cp.global_rank(cp.rank - 1), cp.group, tag)
    if cp.rank < cp.size - 1 and send is not None:
        x = _Send.apply(x, send, cp.global_rank(cp.rank + 1), cp.group, tag)
    return x, got


# ---------------------------------------------------------------------------------------------------------------
# short-conv halo


def _wrap_conv(conv: ShortConv, cp: CPInfo, collective: bool = False) -> None:
    """collective: the halo rows by an all-gather of every rank's tail (the scan mode: collectives only), else by
    point-to-point from rank r-1 (the relay mode: p2p only)."""
    inner, tag = conv.forward, next(_TAGS)

    @functools.wraps(inner)
    def forward(x_BTC: torch.Tensor, pos_T: torch.Tensor | None = None) -> torch.Tensor:
        assert pos_T is None, "context parallelism does not support packed documents (cu_seqlens)"
        halo = conv.kernel_size - 1
        if halo == 0 or cp.size == 1:
            return inner(x_BTC)
        B, _, C = x_BTC.shape
        if collective:
            tails = gather_shards(x_BTC[None, :, -halo:], cp.mesh, 0, partial_grad=True)  # [cp, B, halo, C]
            # rank 0 takes the causal zero history; indexing a stack keeps the same graph on every rank
            prev = torch.cat((torch.zeros_like(tails[:1]), tails[:-1]))[cp.rank]
        else:
            x_BTC, got = relay(x_BTC, x_BTC[:, -halo:], (B, halo, C), x_BTC.dtype, cp, tag)
            prev = got if got is not None else x_BTC.new_zeros(B, halo, C)  # rank 0: the causal zero history
        return inner(torch.cat((prev, x_BTC), dim=SEQ_DIM))[:, halo:]

    wrap_forward(conv, "cp", lambda _inner: forward)  # forward calls `inner`, the same forward


# ---------------------------------------------------------------------------------------------------------------
# KDA state: relay (p2p, sequential) or scan (collectives, parallel)

KDA_STATE_MODES = ("relay", "scan")
_ACTIVE_RELAY: contextvars.ContextVar[tuple[CPInfo, int, str] | None] = contextvars.ContextVar(
    "moestack_cp_relay", default=None)


def _chunk_kda_cp(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                  **kw):
    """`chunk_kda` as KDAAttention calls it; inside a CP-wrapped KDA forward the state is relayed or scanned."""
    active = _ACTIVE_RELAY.get()
    if active is None:
        return _chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens, **kw)
    cp, tag, mode = active
    assert initial_state is None and cu_seqlens is None, "CP passes the state itself; no packed documents"
    if mode == "scan":
        return kda_scan_shard(q, k, v, g, beta, cp, scale=scale, **kw), None
    B, _, H, K = k.shape
    state_dtype = torch.promote_types(v.dtype, torch.float32)
    _, s_in = relay(q, None, (B, H, K, v.shape[-1]), state_dtype, cp, tag)
    o, s_out = _chunk_kda(q, k, v, g, beta, scale=scale, initial_state=s_in, output_final_state=True, **kw)
    if cp.rank < cp.size - 1:
        o = _Send.apply(o, s_out.to(state_dtype), cp.global_rank(cp.rank + 1), cp.group, tag)
    return o, None


# The scan. For fixed q, k, g, beta the recurrence is linear in (S_0, v) jointly: S_t = A_t S_{t-1} + b_t k_t v_t^T
# with A_t = (I - b_t k_t k_t^T) Diag(alpha_t). Over my shard, with M_t = A_t ... A_1 (K x K per head):
#     S_t = M_t S_in + S_loc_t ,   o_t = S_t^T q_t = o_loc_t + S_in^T (M_t^T q_t)
# where S_loc / o_loc are the zero-initial-state run. ONE chunk_kda call with the value width widened to K + V,
# values [0 | v] and initial state [I | 0], returns all of it: outputs [M_t^T q_t | o_loc_t] (the transformed
# queries q_hat and the local outputs) and final state [M | S_loc]. The K-side work of the op (decayed scores, the
# triangular inverse, W) is shared by both halves; only the V-proportional work doubles. Then:
#   all-gather the cp final states [M_j | S_loc_j] (fp32, B*H*K*(K+V) each), every rank composes the prefix
#   S_in(r) = M_{r-1}(... (M_0 0 + S_0) ...) + S_{r-1}, and adds the exact correction q_hat S_in (2*K*V FLOPs per
#   token and head). Rerunning the op from S_in would also be exact but costs one more whole KDA pass.
# Backward is autograd through the same graph; the all-gather's backward is a reduce-scatter (each rank's use of
# the gathered states is partial). Every rank builds the same graph (rank 0 also composes all the prefixes and
# indexes its own, a zero state), so every rank runs the same collectives in the same order, forward and backward.


KDA_SCAN_MAX_VALUE_WIDTH = 256  # the Triton backend's limit on the value width (ops/kda/README.md)


def kda_scan_shard(q, k, v, g, beta, cp: CPInfo, scale=None, **kw) -> torch.Tensor:
    """chunk_kda outputs of my shard with the true initial state, computed without waiting for earlier ranks."""
    B, T_l, H, K = k.shape
    V = v.shape[-1]
    state_dtype = torch.promote_types(v.dtype, torch.float32)
    eye = torch.eye(K, dtype=state_dtype, device=v.device).expand(B, H, K, K)
    if K + V <= KDA_SCAN_MAX_VALUE_WIDTH:  # one widened pass
        s0 = torch.cat((eye, eye.new_zeros(B, H, K, V)), -1)
        o_w, s_w = _chunk_kda(q, k, torch.cat((v.new_zeros(B, T_l, H, K), v), -1), g, beta, scale=scale,
                              initial_state=s0, output_final_state=True, **kw)
        q_hat, o_loc = o_w.split([K, V], -1)
    else:  # the backend's value width would be exceeded: the two halves as two passes
        q_hat, m = _chunk_kda(q, k, v.new_zeros(B, T_l, H, K), g, beta, scale=scale, initial_state=eye.contiguous(),
                              output_final_state=True, **kw)
        o_loc, s_loc = _chunk_kda(q, k, v, g, beta, scale=scale, output_final_state=True, **kw)
        s_w = torch.cat((m, s_loc), -1)
    s_in = scan_initial_state(s_w.to(state_dtype), K, cp)
    o = o_loc.to(state_dtype) + torch.einsum("bthk,bhkv->bthv", q_hat.to(state_dtype), s_in)
    return o.to(v.dtype)


def scan_initial_state(m_s: torch.Tensor, K: int, cp: CPInfo) -> torch.Tensor:
    """m_s [B, H, K, K + V] = [M | S_loc] of my shard -> the state entering my shard, [B, H, K, V]. Differentiable."""
    gathered = gather_shards(m_s.unsqueeze(0), cp.mesh, 0, partial_grad=True)  # [cp, B, H, K, K + V]
    M, S = gathered.split([K, m_s.shape[-1] - K], -1)
    prefix = [torch.zeros_like(S[0])]  # the state entering rank 0
    for j in range(cp.size - 1):
        prefix.append(torch.einsum("bhkl,bhlv->bhkv", M[j], prefix[-1]) + S[j])
    return torch.stack(prefix)[cp.rank]


def _wrap_kda(attn: KDAAttention, cp: CPInfo, mode: str) -> None:
    for conv in (attn.q_conv, attn.k_conv, attn.v_conv):
        _wrap_conv(conv, cp, collective=mode == "scan")
    if kda_module.chunk_kda is not _chunk_kda_cp:  # the model module's name, so its forward stays untouched
        kda_module.chunk_kda = _chunk_kda_cp
    inner, tag = attn.forward, next(_TAGS)

    @functools.wraps(inner)
    def forward(x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        assert cu_seqlens is None, "context parallelism does not support packed documents (cu_seqlens)"
        token = _ACTIVE_RELAY.set((cp, tag, mode))
        try:
            return inner(x_BTD)
        finally:
            _ACTIVE_RELAY.reset(token)

    wrap_forward(attn, "cp", lambda _inner: forward)  # forward calls `inner`, the same forward


# ---------------------------------------------------------------------------------------------------------------
# attention: gather the keys of the whole sequence, mask by global position


def _visible(cp: CPInfo, T_l: int, device) -> torch.Tensor:
    """bool [T_l, T]: my query at global position t0 + i sees keys at positions <= t0 + i."""
    q_pos = cp.rank * T_l + torch.arange(T_l, device=device)
    return q_pos[:, None] >= torch.arange(T_l * cp.size, device=device)[None, :]


def _rope_local(cp: CPInfo, T_l: int, dim: int, theta: float, like: torch.Tensor):
    dt = torch.float64 if like.dtype == torch.float64 else torch.float32
    cos, sin = rope_cos_sin(rope_positions(T_l * cp.size, like.device), dim, theta, dt)
    return cos[cp.rank * T_l : (cp.rank + 1) * T_l], sin[cp.rank * T_l : (cp.rank + 1) * T_l]


def mla_cp_forward(m: GatedMLA, cp: CPInfo, x_BTD: torch.Tensor) -> torch.Tensor:
    """GatedMLA.forward on this rank's T_l queries, keys from the whole sequence (see the module docstring)."""
    B, T_l, _ = x_BTD.shape
    N, R, C, V = m.nope_dim, m.rope_dim, m.kv_lora_rank, m.v_dim
    if m.spec.q_lora_rank is not None:
        q_lat = m.q_a_norm(m.q_a_proj(x_BTD))
        q_BTHQ = m.q_b_proj(q_lat).view(B, T_l, -1, N + R)
    else:
        q_lat = x_BTD
        q_BTHQ = m.q_proj(x_BTD).view(B, T_l, -1, N + R)
    H = q_BTHQ.shape[2]  # this TP rank's heads, from the projection's width
    q_nope, q_rope = q_BTHQ.split([N, R], dim=-1)
    kv_a = m.kv_a_proj(x_BTD)
    c_kv, k_rope = m.kv_a_norm(kv_a[..., :C]), kv_a[..., C:]
    rope = None
    if m.spec.use_rope and R > 0:
        rope = _rope_local(cp, T_l, R, m.spec.rope_theta, x_BTD)
        q_rope = apply_rope(q_rope, *rope, interleaved=True)
        k_rope = apply_rope(k_rope[:, :, None], *rope, interleaved=True)[:, :, 0]
    kv_full = gather_shards(torch.cat((c_kv, k_rope), -1), cp.mesh, SEQ_DIM, partial_grad=True)  # [B, T, C+R]
    T = kv_full.shape[1]

    loss = None
    if m.indexer is None or not m.sparse:
        kv = m.kv_b_proj(kv_full[..., :C]).view(B, T, H, N + V)
        k_nope, v = kv.split([N, V], dim=-1)
        k = torch.cat((k_nope, kv_full[..., None, C:].expand(B, T, H, R).to(k_nope)), -1)
        q = torch.cat((q_nope, q_rope.to(q_nope.dtype)), -1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=_visible(cp, T_l, x_BTD.device), scale=m.scale)
        o_BTHV = o.transpose(1, 2)
        if m.indexer is not None:  # dense warm-up: KL of the indexer to the dense attention over keys [0, t1)
            loss = _dense_indexer_loss(m, cp, x_BTD, q_lat, q_nope, q_rope, kv_full, rope)
    else:
        q_idx, k_idx, w = m.indexer(x_BTD.detach(), q_lat.detach(), rope)
        k_idx_full = gather_shards(k_idx, cp.mesh, SEQ_DIM, partial_grad=True)
        t0, t1 = cp.rank * T_l, (cp.rank + 1) * T_l
        # causal top-k of my rows at their global positions. Rows before mine are zero padding; later rows (and
        # keys) are cut off unless fewer than top_k keys would remain (the op sizes its output by the key count).
        end = max(t1, min(T, m.indexer.top_k))
        with torch.no_grad():
            q_pad = F.pad(q_idx.detach(), (0, 0, 0, 0, t0, end - t1))
            w_pad = F.pad(w.detach(), (0, 0, t0, end - t1))
            idx = dsa_ops.indexer_topk_from_inputs(q_pad, k_idx_full.detach()[:, :end], w_pad, m.indexer.top_k,
                                                   backend=m.dsa_backend)
            idx = idx[:, t0:t1].contiguous()
        q_abs = m._absorb_query(q_nope, q_rope)
        o_lat, lse = dsa_ops.sparse_mqa_attention(q_abs, kv_full, idx, C, m.scale, backend=m.dsa_backend)
        _, w_uv = m._kv_b_heads()
        o_BTHV = torch.einsum("bthc,hvc->bthv", o_lat, w_uv.to(o_lat.dtype))
        target = dsa_ops.attention_probs_target(q_abs.detach(), kv_full.detach(), m.scale, lse=lse.detach(), idx=idx,
                                                backend=m.dsa_backend)
        scores = dsa_ops.indexer_scores_at(q_idx, k_idx_full, w, idx, backend=m.dsa_backend)
        loss = dsa_ops.indexer_kl_loss(scores, target, backend=m.dsa_backend)

    if m.g_proj is not None:
        o_BTHV = o_BTHV * torch.sigmoid(m.g_proj(x_BTD)).view(B, T_l, H, V)
    y = m.o_proj(o_BTHV.reshape(B, T_l, H * V))
    if loss is not None:
        m.last_indexer_loss = loss.detach()  # rank-local KL, for logging
        y = attach_aux_loss(y, loss * (m.indexer_loss_coef / cp.size))
    return y


def _dense_indexer_loss(m: GatedMLA, cp: CPInfo, x_BTD, q_lat, q_nope, q_rope, kv_full, rope) -> torch.Tensor:
    """The DSA dense warm-up's KL for my T_l queries. The dense target and score ops are causal over equal query
    and key lengths, so my queries sit at their global rows [t0, t1) of a zero-padded [0, t1) block (earlier rows
    are dropped; later keys are invisible to my queries anyway)."""
    T_l = x_BTD.shape[1]
    t0, t1 = cp.rank * T_l, (cp.rank + 1) * T_l
    q_idx, k_idx, w = m.indexer(x_BTD.detach(), q_lat.detach(), rope)
    k_idx_full = gather_shards(k_idx, cp.mesh, SEQ_DIM, partial_grad=True)[:, :t1]
    with torch.no_grad():
        q_abs = F.pad(m._absorb_query(q_nope, q_rope), (0, 0, 0, 0, t0, 0))
        target = dsa_ref.attention_probs_target(q_abs, kv_full[:, :t1], m.scale)[:, t0:]
    scores = dsa_ref.indexer_scores(F.pad(q_idx, (0, 0, 0, 0, t0, 0)), k_idx_full, F.pad(w, (0, 0, t0, 0)))
    return dsa_ops.indexer_kl_loss(scores[:, t0:], target, backend=m.dsa_backend)


def _wrap_mla(m: GatedMLA, cp: CPInfo, tp_unit=None) -> None:
    """tp_unit: the module's tensor-parallel unit (apply_tp ran first): entered around the CP forward, as the TP
    forward wrapper it replaces did, so the CP path sees local heads and weight shards."""

    def forward(x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        assert cu_seqlens is None, "context parallelism does not support packed documents (cu_seqlens)"
        if tp_unit is None:
            return mla_cp_forward(m, cp, x_BTD)
        tp_unit.enter()
        try:
            return mla_cp_forward(m, cp, x_BTD)
        finally:
            tp_unit.exit()

    wrap_forward(m, "cp", lambda _inner: forward)  # the CP path in place of the whole forward (TP unit entered)


def _wrap_gqa(m: GQAAttention, cp: CPInfo) -> None:
    raise NotImplementedError("context parallelism for GQA layers is not implemented (KDA and Gated MLA/DSA are)")


# ---------------------------------------------------------------------------------------------------------------
# the model boundary


def _hook_root(model: Transformer, cp: CPInfo) -> None:
    """Slice tokens / targets to my contiguous shard; combine the loss exactly; gather logits when no targets."""
    counts: list[torch.Tensor | None] = []

    def pre(m, args, kwargs):
        args = list(args)
        tokens = args[0] if args else kwargs.pop("tokens")
        targets = args[1] if len(args) > 1 else kwargs.pop("targets", None)
        if kwargs.get("cu_seqlens") is not None or len(args) > 2:
            raise ValueError("cu_seqlens: context parallelism does not support packed documents; pass None")
        if tokens.shape[SEQ_DIM] % cp.size:
            raise ValueError(f"tokens: sequence length {tokens.shape[SEQ_DIM]} must be divisible by cp ({cp.size})")
        tokens = shard_slice(tokens, cp.mesh, SEQ_DIM)
        if targets is not None:
            targets = shard_slice(targets, cp.mesh, SEQ_DIM)
            counts.append((targets != -100).sum())
        else:
            counts.append(None)
        return (tokens, targets), {}

    def post(m, args, out):
        count = counts.pop()
        if count is None:
            return gather_shards(out, cp.mesh, SEQ_DIM, partial_grad=False)
        total = reduce_from_tp(out * count.clamp(min=1), cp.mesh)  # my loss sum; summed over CP
        n = count.clone()
        dist.all_reduce(n, group=cp.group)
        return total / n.clamp(min=1)

    # the CP slice runs before any TP pre-hook (which then splits my shard); TP's post-hook (registered earlier)
    # combines over tp before this one combines over cp
    model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    model.register_forward_hook(post)


def apply_cp(model: Transformer, cp_mesh: DeviceMesh, seq_shard_group: dist.ProcessGroup | None = None,
             kda_state: str = "relay") -> None:
    """Context-parallelise `model` (a whole Transformer, called as model(tokens[, targets]) with the FULL sequence
    on every CP rank) over the 1-D `cp_mesh`, in place; after expert and tensor parallelism, before FSDP.
    seq_shard_group: the ranks one sequence is split over for the MoE aux loss (default: the CP group; required
    under TP: the (cp, tp) group, which shares one sequence). kda_state: "relay" or "scan" (module docstring).
    Replicated gradients are per-rank shares: sum them over CP (FSDP over the (dp_shard, cp) ranks, or
    `sync_cp_grads`)."""
    if kda_state not in KDA_STATE_MODES:
        raise ValueError(f"kda_state: unknown mode {kda_state!r}; use one of {KDA_STATE_MODES}")
    assert cp_mesh.ndim == 1, f"apply_cp needs a 1-D CP mesh, got {cp_mesh.ndim}-D"
    if getattr(model, "_tp_mesh", None) is not None and seq_shard_group is None:
        raise ValueError("seq_shard_group: under tensor parallelism pass the (cp, tp) group (the MoE aux loss "
                         "sums its counts over every rank of one sequence)")
    cp = CPInfo(cp_mesh)
    for block in model.layers.values():
        if isinstance(block.attn, KDAAttention):
            _wrap_kda(block.attn, cp, kda_state)
        elif isinstance(block.attn, GatedMLA):
            _wrap_mla(block.attn, cp, getattr(block.attn, "_tp_unit", None))  # set by apply_tp
        elif isinstance(block.attn, GQAAttention):
            _wrap_gqa(block.attn, cp)
        else:
            raise NotImplementedError(f"context parallelism has no rule for {type(block.attn).__name__}")
        if isinstance(block.ffn, MoE):
            block.ffn.seq_shard_group = seq_shard_group or cp.group
            if block.ffn.balance_group is None:  # batch-scope balancing: at least the sequence's ranks
                block.ffn.balance_group = seq_shard_group or cp.group
    if model.embed is None or model.lm_head is None:
        raise NotImplementedError("context parallelism of a pipeline stage is not implemented")
    _hook_root(model, cp)


@torch.no_grad()
def sync_cp_grads(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Sum every plain gradient over the CP group (for a model without FSDP; FSDP does it in its reduction)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None and not hasattr(p.grad, "device_mesh")]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=cp_mesh.get_group())
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
