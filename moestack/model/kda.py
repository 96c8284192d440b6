"""Kimi Delta Attention layer (MODEL.md "KDA"; Kimi Linear, arXiv:2510.26692).

    q, k, v = SiLU(ShortConv(W_{q,k,v} x));  q, k L2-normalised per head
    g       = gate(f_b(f_a(x)))              log-decay per key channel (or per head), fp32
    beta    = sigmoid(b_proj x)
    o       = chunk_kda(q, k, v, g, beta)
    y       = o_proj(RMSNorm_head(o) * sigmoid(g_proj x))      (silu instead of sigmoid: Gated DeltaNet)

With spec.num_v_heads = HV > H (Gated DeltaNet / Qwen3-Next, per-head decay only) v, g, beta and the output have
HV heads and value head j reads q/k head j // (HV / H), as fla's GVA does.

Shape legend: B batch, T tokens, D hidden, H q/k heads, HV value heads, K = V head dim, W conv kernel width,
N packed documents.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moestack.config.model_spec import KDASpec
from moestack.model.norm import RMSNorm
from moestack.ops.kda import chunk_kda, kda_gate_k3, kda_gate_kimi_linear

# Initial decay rates: per-token log-decay -exp(A_log) * dt with dt log-uniform in [DT_MIN, DT_MAX] (Mamba-2 /
# Kimi Linear). With A = exp(A_log) in [1, 16] this spans memories of ~1 to ~1000 tokens across channels.
DT_MIN, DT_MAX = 1e-3, 1e-1


def _doc_positions(T: int, cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Position of each packed token inside its own document: [T] int64."""
    starts_N = cu_seqlens[:-1].to(device=device, dtype=torch.long)
    t_T = torch.arange(T, device=device)
    doc_T = torch.searchsorted(starts_N, t_T, right=True) - 1  # index of the document holding token t
    return t_T - starts_N[doc_T]


class ShortConv(nn.Module):
    """Depthwise causal conv1d without bias, that never reads across packed-document boundaries.

    Written as a sum over the W taps (y_t = sum_j w[W-1-j] * x_{t-j}) so that a tap reaching before the start of
    the token's document can be masked; W is tiny (4), so this costs a few elementwise ops.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))  # nn.Conv1d / HF layout

    def forward(self, x_BTC: torch.Tensor, pos_T: torch.Tensor | None = None) -> torch.Tensor:
        """x_BTC: [B, T, C]; pos_T: position of each token inside its document (packed input) or None."""
        W, T = self.kernel_size, x_BTC.shape[1]
        w_CW = self.weight[:, 0, :].to(x_BTC.dtype)
        x_pad = F.pad(x_BTC, (0, 0, W - 1, 0))  # [B, W-1+T, C], causal history of zeros
        y = x_BTC * w_CW[:, W - 1]
        for j in range(1, W):  # tap j reads x_{t-j}
            x_j = x_pad[:, W - 1 - j : W - 1 - j + T]
            if pos_T is not None:
                x_j = x_j * (pos_T >= j).to(x_j.dtype)[None, :, None]
            y = y + x_j * w_CW[:, W - 1 - j]
        return y

    def init_weights(self, std: float) -> None:
        # nn.Conv1d's default (uniform in +-1/sqrt(fan_in), fan_in = W): a short conv needs O(1) taps, a
        # std-0.02 init would shrink v by ~50x at the start of training.
        del std
        bound = 1.0 / math.sqrt(self.kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)


# The layer's elementwise ops run as fused Triton kernels (fp32 inside, one pass each way) with layer_ops "triton",
# or "auto" on CUDA below fp64; otherwise ("torch", CPU, fp64 reference checks) the PyTorch forms below (the
# kernels' specs). KernelSpec.kda.layer_ops sets KDAAttention.layer_ops at build time.


def _fused_ops(x: torch.Tensor, mode: str) -> bool:
    return mode == "triton" or (mode == "auto" and x.is_cuda and x.dtype != torch.float64)


def _gated_norm(norm: RMSNorm, o: torch.Tensor, z: torch.Tensor, act: str, mode: str = "auto") -> torch.Tensor:
    """RMSNorm(o) * act(z) per head (ops/kda/gated_norm.py when fused)."""
    if _fused_ops(o, mode):
        from moestack.ops.kda.gated_norm import gated_rmsnorm  # imports Triton: only where it runs

        return gated_rmsnorm(o, z, norm.weight, norm.eps, act)
    gate = torch.sigmoid(z) if act == "sigmoid" else F.silu(z)
    return norm(o).to(gate.dtype) * gate


def _conv_silu(conv: ShortConv, x_BTC: torch.Tensor, pos_T: torch.Tensor | None, mode: str = "auto"
               ) -> torch.Tensor:
    """silu(conv(x)) (ops/kda/short_conv.py when fused)."""
    if _fused_ops(x_BTC, mode):
        from moestack.ops.kda.short_conv import short_conv_silu  # imports Triton: only where it runs

        return short_conv_silu(x_BTC, conv.weight, pos_T)
    return F.silu(conv(x_BTC, pos_T))


def _fp32_or_wider(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim, in fp32 or wider (the in-kernel form fla/Kimi use)."""
    x32 = x.to(_fp32_or_wider(x))
    return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)


class KDAAttention(nn.Module):
    """KDA token mixer. forward(x_BTD, cu_seqlens=None) -> y_BTD; no parallelism, no biases."""

    def __init__(self, hidden_size: int, spec: KDASpec, norm_eps: float):
        super().__init__()
        self.spec = spec
        H, HV, K = spec.num_heads, spec.value_heads, spec.head_dim
        HK, HVK = H * K, HV * K
        self.num_heads, self.num_v_heads, self.head_dim = H, HV, K
        self.kda_backend, self.layer_ops = "auto", "auto"  # KernelSpec.kda (moestack/model/kernels.py)
        gate_dim = HVK if spec.decay == "channel" else HV
        self.q_proj = nn.Linear(hidden_size, HK, bias=False)
        self.k_proj = nn.Linear(hidden_size, HK, bias=False)
        self.v_proj = nn.Linear(hidden_size, HVK, bias=False)
        self.q_conv = ShortConv(HK, spec.conv_kernel_size)
        self.k_conv = ShortConv(HK, spec.conv_kernel_size)
        self.v_conv = ShortConv(HVK, spec.conv_kernel_size)
        if spec.gate_rank is None:
            self.f_proj = nn.Linear(hidden_size, gate_dim, bias=False)
        else:
            self.f_a_proj = nn.Linear(hidden_size, spec.gate_rank, bias=False)
            self.f_b_proj = nn.Linear(spec.gate_rank, gate_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(HV, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(gate_dim, dtype=torch.float32))
        self._tag_no_weight_decay()
        self.b_proj = nn.Linear(hidden_size, HV, bias=False)
        if spec.output_gate_rank is None:
            self.g_proj = nn.Linear(hidden_size, HVK, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden_size, spec.output_gate_rank, bias=False)
            self.g_b_proj = nn.Linear(spec.output_gate_rank, HVK, bias=False)
        self.o_norm = RMSNorm(K, eps=norm_eps)
        self.o_proj = nn.Linear(HVK, hidden_size, bias=False)

    def _tag_no_weight_decay(self) -> None:
        # A Python attribute on a Parameter is lost by to_empty()/.to(dtype), so init_weights tags again.
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True

    def _decay_input(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.spec.gate_rank is None:
            return self.f_proj(x_BTD)
        return self.f_b_proj(self.f_a_proj(x_BTD))

    def _output_gate(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.spec.output_gate_rank is None:
            return self.g_proj(x_BTD)
        return self.g_b_proj(self.g_a_proj(x_BTD))

    def _gate(self, f_BTHk: torch.Tensor) -> torch.Tensor:
        if self.spec.gate == "k3":
            return kda_gate_k3(f_BTHk, self.A_log, self.dt_bias, self.spec.gate_lower_bound)
        return kda_gate_kimi_linear(f_BTHk, self.A_log, self.dt_bias)

    def forward(self, x_BTD: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x_BTD: [B, T, D] -> [B, T, D]. cu_seqlens: int [N + 1] document offsets (B == 1): no state and no
        conv history crosses a document boundary."""
        B, T, _ = x_BTD.shape
        K = self.head_dim  # the head counts come from the projections' widths (a TP rank holds some of the heads)
        pos_T = None
        if cu_seqlens is not None:
            assert B == 1, f"packed documents (cu_seqlens) need B == 1, got B={B}"
            pos_T = _doc_positions(T, cu_seqlens, x_BTD.device)

        q = _conv_silu(self.q_conv, self.q_proj(x_BTD), pos_T, self.layer_ops).view(B, T, -1, K)
        k = _conv_silu(self.k_conv, self.k_proj(x_BTD), pos_T, self.layer_ops).view(B, T, -1, K)
        v = _conv_silu(self.v_conv, self.v_proj(x_BTD), pos_T, self.layer_ops).view(B, T, -1, K)
        H, HV = q.shape[2], v.shape[2]
        q, k = _l2norm(q, self.spec.l2_eps), _l2norm(k, self.spec.l2_eps)
        if HV != H:  # value head j reads q/k head j // (HV / H)
            q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)

        g_BTHK = self._gate(self._decay_input(x_BTD).view(B, T, HV, -1)).expand(B, T, HV, K)  # fp32
        b_BTH = self.b_proj(x_BTD)
        beta_BTH = torch.sigmoid(b_BTH.to(_fp32_or_wider(b_BTH)))

        # The op gets fp32 (fp64 stays fp64) on CPU; on GPU the fused kernels take the autocast dtype.
        op_dtype = _fp32_or_wider(v) if v.device.type == "cpu" else v.dtype
        o_BTHV, _ = chunk_kda(
            q.to(op_dtype),
            k.to(op_dtype),
            v.to(op_dtype),
            g_BTHK,
            beta_BTH,
            scale=K**-0.5,
            cu_seqlens=cu_seqlens,
            chunk_size=self.spec.chunk_size,
            backend=self.kda_backend,
        )
        z_BTHV = self._output_gate(x_BTD).view(B, T, HV, K)
        o_BTHV = _gated_norm(self.o_norm, o_BTHV, z_BTHV, self.spec.output_gate_act, self.layer_ops)
        return self.o_proj(o_BTHV.reshape(B, T, HV * K))

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Linear weights ~ N(0, std); convs as nn.Conv1d; o_norm to 1; A_log and dt_bias as below."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=std)
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            conv.init_weights(std)
        self.o_norm.weight.fill_(1.0)
        # A = exp(A_log) ~ U(1, 16) per head (Kimi Linear / Mamba-2).
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        # dt_bias: at x = 0 the per-token log-decay starts at -A * dt, dt log-uniform in [1e-3, 1e-1] per channel,
        # for both gates: channels start with memories from ~1 to ~1000 tokens, away from saturation.
        #   kimi_linear: -A * softplus(dt_bias) = -A * dt   =>  dt_bias = softplus^-1(dt)
        #   k3:          lb * sigmoid(A * dt_bias) = -A * dt =>  dt_bias = logit(A * dt / |lb|) / A  (A*dt/|lb| <= 0.32)
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(DT_MIN), math.log(DT_MAX)).exp()
        A_c = self.A_log.exp().repeat_interleave(self.dt_bias.numel() // self.num_v_heads)  # A per dt_bias entry
        if self.spec.gate == "kimi_linear":
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        else:
            p = (A_c * dt / abs(self.spec.gate_lower_bound)).clamp(max=1 - 1e-6)
            self.dt_bias.copy_(torch.logit(p) / A_c)
        self._tag_no_weight_decay()
