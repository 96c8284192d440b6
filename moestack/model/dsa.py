"""Gated MLA with an optional DSA lightning indexer (Kimi K3 full-attention layer; K3.1 Pro / DeepSeek-V3.2 DSA).

MLA (DeepSeek-V2/V3): q = W_qb RMSNorm(W_qa x) (or W_q x), per head [nope | rope]; one compressed latent per
token [c_kv | k_rope] = W_kva x with c_kv RMSNorm'd; W_kvb c_kv -> per head [k_nope | v]; keys per head are
[k_nope | k_rope] (k_rope shared by heads). Softmax scale (nope + rope)^-0.5. NoPE unless spec.use_rope.
Output gate (arXiv:2505.06708): attn_out * sigmoid(g_proj x) before o_proj.

Three attention paths:
  * no indexer, or indexer in dense mode (`sparse = False`): causal attention with per-head K/V decompressed,
    through F.scaled_dot_product_attention (fast path on GPU);
  * indexer, sparse mode: the indexer picks top_k keys per query (no gradient), then attention runs over them in
    MQA form: W_UK is absorbed into the query, all heads attend to the shared latent [c_kv | k_rope] with values
    c_kv, and W_UV maps each head's latent output to v_head_dim.
The indexer always reads detached inputs and learns only from its KL loss to the main attention distribution
(dense target in dense mode, selected-set target in sparse mode). The loss, times `indexer_loss_coef`, rides on
the output via attach_aux_loss.

Legend: B batch, T tokens, D hidden, H heads, N qk_nope dim, R qk_rope dim, Q = N + R, C kv_lora rank,
V v_head dim, L q_lora rank, Hi / Di indexer heads / head dim, K top_k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moestack.config.model_spec import IndexerSpec, MLASpec
from moestack.model.aux_loss import attach_aux_loss
from moestack.model.norm import RMSNorm
from moestack.model.rope import apply_rope, rope_cos_sin, rope_positions, yarn_mscale
from moestack.model.weights import compute_weight
from moestack.ops import dsa as dsa_ops
from moestack.ops.dsa import reference as dsa_ref

INDEXER_NORM_EPS = 1e-6  # DeepSeek-V3.2 indexer LayerNorm


class LightningIndexer(nn.Module):
    """DSA indexer: q_idx = wq(q_in) [Hi x Di], one key k_idx = LayerNorm(wk x) [Di], head weights w = weights_proj x.

    w is scaled by (Hi * Di)^-0.5 as in DeepSeek-V3.2 so that I = sum_j w_j ReLU(q_j . k) starts at unit scale.
    With rope (MLA use_rope) the first `rope_dim` dims of q_idx and k_idx are rotated (V3.2); K3.1 Pro is NoPE.
    """

    def __init__(self, hidden_size: int, q_in_size: int, spec: IndexerSpec, rope_dim: int = 0):
        super().__init__()
        assert rope_dim <= spec.head_dim and rope_dim % 2 == 0
        self.num_heads, self.head_dim, self.top_k, self.rope_dim = spec.num_heads, spec.head_dim, spec.top_k, rope_dim
        self.wq = nn.Linear(q_in_size, spec.num_heads * spec.head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, spec.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(spec.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(hidden_size, spec.num_heads, bias=False)

    def init_weights(self, std: float) -> None:
        for lin in (self.wq, self.wk, self.weights_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=std)
        nn.init.ones_(self.k_norm.weight)
        nn.init.zeros_(self.k_norm.bias)

    def forward(
        self, x_BTD: torch.Tensor, q_in_BTL: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B,T,D], q_in [B,T,L] -> q_idx [B,T,Hi,Di], k_idx [B,T,Di], w [B,T,Hi]."""
        B, T, _ = x_BTD.shape
        q_BTHD = self.wq(q_in_BTL).view(B, T, self.num_heads, self.head_dim)
        k_BTD = self.k_norm(self.wk(x_BTD))
        if rope is not None and self.rope_dim:
            r = self.rope_dim
            q_BTHD = torch.cat((apply_rope(q_BTHD[..., :r], *rope, interleaved=True), q_BTHD[..., r:]), dim=-1)
            k_rot = apply_rope(k_BTD[:, :, None, :r], *rope, interleaved=True)[:, :, 0]
            k_BTD = torch.cat((k_rot, k_BTD[..., r:]), dim=-1)
        w_BTH = self.weights_proj(x_BTD) * (self.num_heads * self.head_dim) ** -0.5
        return q_BTHD, k_BTD, w_BTH


class GatedMLA(nn.Module):
    """Gated MLA / DSA token mixer: x [B,T,D] -> y [B,T,D] (see module docstring).

    Runtime switches (plain attributes, set by the trainer): `sparse` (with an indexer: True = top-k sparse
    attention, False = dense attention + dense KL warm-up) and `indexer_loss_coef`. After each forward with an
    indexer, `last_indexer_loss` holds the detached KL for logging.
    """

    def __init__(self, hidden_size: int, spec: MLASpec, norm_eps: float):
        super().__init__()
        self.spec = spec
        H, N, R, C, V = (
            spec.num_heads,
            spec.qk_nope_head_dim,
            spec.qk_rope_head_dim,
            spec.kv_lora_rank,
            spec.v_head_dim,
        )
        self.num_heads, self.nope_dim, self.rope_dim, self.kv_lora_rank, self.v_dim = H, N, R, C, V
        self.scale = spec.softmax_scale
        self.dsa_backend = "auto"  # KernelSpec.dsa.backend (moestack/model/kernels.py), for every DSA op
        scaling = spec.rope_scaling if spec.use_rope else None
        if scaling is not None:
            if scaling.type != "yarn":
                raise NotImplementedError(f"GatedMLA: rope_scaling '{scaling.type}' is not implemented (yarn is)")
            if scaling.mscale_all_dim:  # DeepSeek's YaRN temperature on the softmax
                self.scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
        if spec.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(hidden_size, spec.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(spec.q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, H * (N + R), bias=False)
        else:
            self.q_proj = nn.Linear(hidden_size, H * (N + R), bias=False)
        self.kv_a_proj = nn.Linear(hidden_size, C + R, bias=False)
        self.kv_a_norm = RMSNorm(C, norm_eps)
        self.kv_b_proj = nn.Linear(C, H * (N + V), bias=False)
        self.g_proj = nn.Linear(hidden_size, H * V, bias=False) if spec.output_gate else None
        self.o_proj = nn.Linear(H * V, hidden_size, bias=False)
        self.indexer = None
        if spec.indexer is not None:
            q_in = spec.q_lora_rank if spec.q_lora_rank is not None else hidden_size
            self.indexer = LightningIndexer(hidden_size, q_in, spec.indexer, R if spec.use_rope else 0)
        self.sparse: bool = True
        self.indexer_loss_coef: float = 1.0
        self.last_indexer_loss: torch.Tensor | None = None

    def init_weights(self, std: float) -> None:
        for name in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj", "kv_b_proj", "g_proj", "o_proj"):
            lin = getattr(self, name, None)
            if lin is not None:
                nn.init.normal_(lin.weight, mean=0.0, std=std)
        for name in ("q_a_norm", "kv_a_norm"):
            norm = getattr(self, name, None)
            if norm is not None:
                nn.init.ones_(norm.weight)
        if self.indexer is not None:
            self.indexer.init_weights(std)

    # ------------------------------------------------------------------------------------------------ forward

    def forward(self, x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x [B,T,D] -> y [B,T,D]. cu_seqlens [N+1] (B == 1): packed documents, attention stays inside each."""
        B, T, _ = x_BTD.shape
        assert cu_seqlens is None or B == 1, "cu_seqlens (packed documents) needs batch size 1"
        N, R, C = self.nope_dim, self.rope_dim, self.kv_lora_rank

        if self.spec.q_lora_rank is not None:
            q_lat_BTL = self.q_a_norm(self.q_a_proj(x_BTD))
            q_BTHQ = self.q_b_proj(q_lat_BTL).view(B, T, -1, N + R)
        else:
            q_lat_BTL = x_BTD  # the indexer's query input when there is no q latent
            q_BTHQ = self.q_proj(x_BTD).view(B, T, -1, N + R)
        H = q_BTHQ.shape[2]  # from the projection's width: a TP rank holds H / tp of the heads
        q_nope_BTHN, q_rope_BTHR = q_BTHQ.split([N, R], dim=-1)
        kv_a_BTX = self.kv_a_proj(x_BTD)
        c_kv_BTC = self.kv_a_norm(kv_a_BTX[..., :C])
        k_rope_BTR = kv_a_BTX[..., C:]

        rope = None
        if self.spec.use_rope and R > 0:
            dt = torch.float64 if x_BTD.dtype == torch.float64 else torch.float32
            rope = rope_cos_sin(rope_positions(T, x_BTD.device, cu_seqlens), R, self.spec.rope_theta, dt,
                                self.spec.rope_scaling)
            q_rope_BTHR = apply_rope(q_rope_BTHR, *rope, interleaved=True)
            k_rope_BTR = apply_rope(k_rope_BTR[:, :, None], *rope, interleaved=True)[:, :, 0]

        loss = None
        if self.indexer is None:
            o_BTHV = self._dense_attention(q_nope_BTHN, q_rope_BTHR, c_kv_BTC, k_rope_BTR, cu_seqlens)
        else:
            q_idx, k_idx, w = self.indexer(x_BTD.detach(), q_lat_BTL.detach(), rope)
            kv_BTX = torch.cat((c_kv_BTC, k_rope_BTR), dim=-1)  # the shared MQA latent [c_kv | k_rope]
            if self.sparse:
                o_BTHV, loss = self._sparse_attention(q_nope_BTHN, q_rope_BTHR, kv_BTX, q_idx, k_idx, w, cu_seqlens)
            else:
                o_BTHV = self._dense_attention(q_nope_BTHN, q_rope_BTHR, c_kv_BTC, k_rope_BTR, cu_seqlens)
                with torch.no_grad():
                    q_abs = self._absorb_query(q_nope_BTHN, q_rope_BTHR)
                    target_BTS = dsa_ref.attention_probs_target(q_abs, kv_BTX, self.scale, cu_seqlens=cu_seqlens)
                scores_BTS = dsa_ref.indexer_scores(q_idx, k_idx, w, cu_seqlens)
                loss = dsa_ops.indexer_kl_loss(scores_BTS, target_BTS, backend=self.dsa_backend)

        if self.g_proj is not None:
            o_BTHV = o_BTHV * torch.sigmoid(self.g_proj(x_BTD)).view(B, T, H, self.v_dim)
        y_BTD = self.o_proj(o_BTHV.reshape(B, T, H * self.v_dim))
        if loss is not None:
            self.last_indexer_loss = loss.detach()
            y_BTD = attach_aux_loss(y_BTD, loss * self.indexer_loss_coef)
        return y_BTD

    def _kv_b_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight split per head: W_UK [H, N, C] and W_UV [H, V, C]. Its compute copy where the weight
        cache keeps one: the copy's hook owns the gradient (a read of the parameter here would have AccumulateGrad
        take over a CUDA graph's output as .grad under blocks+graphs)."""
        w_HXC = compute_weight(self.kv_b_proj).view(-1, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w_HXC[:, : self.nope_dim], w_HXC[:, self.nope_dim :]

    def _absorb_query(self, q_nope_BTHN: torch.Tensor, q_rope_BTHR: torch.Tensor) -> torch.Tensor:
        """MQA-form query [B,T,H,C+R]: q_nope W_UK (scores against c_kv equal those against k_nope) | q_rope."""
        w_uk_HNC, _ = self._kv_b_heads()
        q_lat_BTHC = torch.einsum("bthn,hnc->bthc", q_nope_BTHN, w_uk_HNC.to(q_nope_BTHN.dtype))
        return torch.cat((q_lat_BTHC, q_rope_BTHR.to(q_lat_BTHC.dtype)), dim=-1)

    def _dense_attention(
        self,
        q_nope_BTHN: torch.Tensor,
        q_rope_BTHR: torch.Tensor,
        c_kv_BTC: torch.Tensor,
        k_rope_BTR: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """Causal attention with decompressed per-head K/V via SDPA -> o [B,T,H,V]."""
        B, T, H, _ = q_nope_BTHN.shape
        V = self.v_dim
        kv_BTHX = self.kv_b_proj(c_kv_BTC).view(B, T, H, self.nope_dim + V)
        k_nope_BTHN, v_BTHV = kv_BTHX.split([self.nope_dim, V], dim=-1)
        k_BTHQ = torch.cat((k_nope_BTHN, k_rope_BTR[:, :, None].expand(B, T, H, self.rope_dim).to(k_nope_BTHN)), -1)
        q_BTHQ = torch.cat((q_nope_BTHN, q_rope_BTHR.to(q_nope_BTHN.dtype)), dim=-1)
        Q = q_BTHQ.shape[-1]
        pad = Q - V if (q_BTHQ.is_cuda and V < Q) else 0  # GPU flash kernels want equal q/k/v head dims
        if pad:
            v_BTHV = F.pad(v_BTHV, (0, pad))
        mask = None if cu_seqlens is None else dsa_ref.causal_mask(T, q_BTHQ.device, cu_seqlens)
        o_BHTV = F.scaled_dot_product_attention(
            q_BTHQ.transpose(1, 2),
            k_BTHQ.transpose(1, 2),
            v_BTHV.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
        )
        return o_BHTV.transpose(1, 2)[..., :V]

    def _sparse_attention(
        self,
        q_nope_BTHN: torch.Tensor,
        q_rope_BTHR: torch.Tensor,
        kv_BTX: torch.Tensor,
        q_idx: torch.Tensor,
        k_idx: torch.Tensor,
        w: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k selection -> sparse MQA attention over the latent -> (o [B,T,H,V], KL loss over the selected set)."""
        idx_BTK = dsa_ops.indexer_topk_from_inputs(
            q_idx.detach(), k_idx.detach(), w.detach(), self.indexer.top_k, cu_seqlens=cu_seqlens,
            backend=self.dsa_backend,
        )
        q_abs_BTHX = self._absorb_query(q_nope_BTHN, q_rope_BTHR)
        o_lat_BTHC, lse_BTH = dsa_ops.sparse_mqa_attention(q_abs_BTHX, kv_BTX, idx_BTK, self.kv_lora_rank, self.scale,
                                                         backend=self.dsa_backend)
        _, w_uv_HVC = self._kv_b_heads()
        o_BTHV = torch.einsum("bthc,hvc->bthv", o_lat_BTHC, w_uv_HVC.to(o_lat_BTHC.dtype))
        target_BTK = dsa_ops.attention_probs_target(
            q_abs_BTHX.detach(), kv_BTX.detach(), self.scale, lse=lse_BTH.detach(), idx=idx_BTK,
            backend=self.dsa_backend,
        )
        scores_BTK = dsa_ops.indexer_scores_at(q_idx, k_idx, w, idx_BTK, backend=self.dsa_backend)
        return o_BTHV, dsa_ops.indexer_kl_loss(scores_BTK, target_BTK, backend=self.dsa_backend)
