"""KDA Triton backend: the autograd.Function and the two public entry points (the registry's "triton" backend).

    kda_triton(q, k, v, g, beta, ...)                   plain: q, k normalised, g an activated log-decay, beta in (0, 1)
    kda_fused(q, k, v, g, beta, A_log, dt_bias, ...)    fused: raw gate input, raw beta logits, un-normalised q, k

Save-vs-recompute policy (one switch, `recompute`): backward needs, per chunk, the forward intermediates of the
intra kernel (W, Qp, Kd [T, H, K] and U [T, H, V] in the input dtype, Aqk [T, H, 64], the cumulative log-decay
gc [T, H, K] fp32, inverse norms, b_last) and of the recurrence (D [T, H, V], the state entering each chunk
h [NC, H, K, V], and X, Akk [T, H, 64] for the WY backward). recompute=True (default) keeps only the inputs and
re-runs both forward kernels at the start of backward (+26% fwd+bwd time at 1x32768x32x128). recompute=False keeps
them from the forward: per token and head (3K + 2V + 64 + K*V/64) elements of the input dtype plus 4K + 8 bytes and
X / Akk (384 B in bf16), ~2.8 KB at K = V = 128. README.md ("Triton kernels") has the numbers.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences, NC chunk slots.
"""

from __future__ import annotations

import torch

from moestack.ops.kda.triton_bwd import kda_bwd_intra, kda_bwd_recurrence
from moestack.ops.kda.triton_fwd import (
    BT,
    GATE_K3,
    GATE_KIMI,
    GATE_NONE,
    kda_fwd_intra,
    kda_fwd_recurrence,
)

__all__ = ["kda_fused", "kda_triton", "kda_triton_backward"]

_GATES = {"none": GATE_NONE, "k3": GATE_K3, "kimi": GATE_KIMI}
# kda_fwd_intra's outputs, all kept by "save" (xinv, akk: written by the saving forward and by the recompute)
_INTRA = ("w", "u", "qp", "kd", "aqk", "gl", "gc", "rq", "rk", "flag", "xinv", "akk")


def _chunk_layout(cu_seqlens: torch.Tensor, T_total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk slots for packed sequences, without a host sync.

    cu_seqlens int [N + 1]. Returns chunk_map int32 [NC, 2] ((sequence, chunk in sequence), (-1, 0) for dead
    slots) and chunk_offsets int32 [N + 1] (first slot of each sequence). NC = T // 64 + N + 1 bounds the number
    of chunks, so the grid size needs no device-to-host copy.
    """
    N = cu_seqlens.numel() - 1
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    n_chunks = (lens + BT - 1) // BT
    offsets = torch.zeros(N + 1, dtype=torch.int64, device=cu_seqlens.device)
    offsets[1:] = torch.cumsum(n_chunks, 0)
    NC = T_total // BT + N + 1
    slot = torch.arange(NC, device=cu_seqlens.device)
    seq = torch.searchsorted(offsets[1:], slot, right=True).clamp(max=N - 1)
    live = slot < offsets[-1]
    chunk_map = torch.stack([torch.where(live, seq, -1), torch.where(live, slot - offsets[seq], 0)], dim=-1)
    return chunk_map.to(torch.int32).contiguous(), offsets.to(torch.int32)


def _inter_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _inputs(q, k, v, g, beta, initial_state, cu_seqlens):
    """The kernels' view of the inputs: flat [B * T, ...] tensors, the fp32 initial state, the int32 document
    offsets and the chunk layout, and the shapes (B, T, H, K, V, N)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    assert K <= 256 and V <= 256, f"Triton KDA supports K, V <= 256 (got K={K}, V={V})"
    if cu_seqlens is None:
        cu = torch.arange(B + 1, device=q.device, dtype=torch.int32) * T
    else:
        assert B == 1, f"cu_seqlens packs documents into one row: B must be 1, got {B}"
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    N = cu.numel() - 1
    chunk_map, chunk_offsets = _chunk_layout(cu, B * T)
    flat = [x.reshape(B * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.float().contiguous()
    return flat, h0, cu, chunk_map, chunk_offsets, (B, T, H, K, V, N)


def _intra(flat, A_log, dt_bias, chunk_map, cu, cfg, store_x):
    return kda_fwd_intra(*flat, A_log, dt_bias, chunk_map, cu, scale=cfg["scale"], gate=cfg["gate"],
                         lower_bound=cfg["lower_bound"], l2norm=cfg["l2norm"], l2_eps=cfg["l2_eps"],
                         beta_sigmoid=cfg["beta_sigmoid"], inter_dtype=_inter_dtype(flat[0]), store_x=store_x)


def _backward(flat, A_log, dt_bias, h0, cu, chunk_map, chunk_offsets, saved, cfg, shape, do, dht):
    """Every gradient from the inputs (and, where the forward kept them, its intermediates `saved`)."""
    q, k, v, g, beta = flat
    B, T, H, K, V, N = shape
    if saved is None:
        intra = _intra(flat, A_log, dt_bias, chunk_map, cu, cfg, store_x=True)
        _, _, h, d = kda_fwd_recurrence(intra, h0, chunk_offsets, cu, n_seqs=N, V=V, out_dtype=v.dtype,
                                        store_o=False, store_ht=False, store_states=True)
    else:
        intra = {n: t for n, t in zip(_INTRA, saved) if t is not None}
        h, d = saved[len(_INTRA):]
    do = do.reshape(B * T, H, V).contiguous()
    dht = None if dht is None else dht.float().contiguous()
    dh, dd, dh0 = kda_bwd_recurrence(intra, do, dht, chunk_offsets, cu, n_seqs=N, V=V, need_dh0=h0 is not None)
    dq, dk, dv, dg, dbeta, pd_dt, pd_alog = kda_bwd_intra(
        q, k, v, g, beta, A_log, dt_bias, intra, chunk_map, cu, h, dh, d, dd, do, scale=cfg["scale"],
        gate=cfg["gate"], lower_bound=cfg["lower_bound"], l2norm=cfg["l2norm"],
        beta_sigmoid=cfg["beta_sigmoid"])
    dA_log = None if A_log is None or pd_alog is None else pd_alog.sum(0).to(A_log.dtype)
    ddt = None if dt_bias is None or pd_dt is None else pd_dt.sum(0).reshape(dt_bias.shape).to(dt_bias.dtype)
    grads = [x.view(B, T, *x.shape[1:]) for x in (dq, dk, dv, dg, dbeta)]
    return grads, dA_log, ddt, dh0


class _KDATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cfg, output_final_state):
        flat, h0, cu, chunk_map, chunk_offsets, shape = _inputs(q, k, v, g, beta, initial_state, cu_seqlens)
        B, T, H, K, V, N = shape
        save = not cfg["recompute"]
        intra = _intra(flat, A_log, dt_bias, chunk_map, cu, cfg, store_x=save)  # X / Akk only when kept
        o, ht, h, d = kda_fwd_recurrence(intra, h0, chunk_offsets, cu, n_seqs=N, V=V, out_dtype=v.dtype,
                                         store_o=True, store_ht=output_final_state, store_states=save)
        saved = [intra.get(n) for n in _INTRA] + [h, d] if save else [None] * (len(_INTRA) + 2)
        ctx.save_for_backward(*flat, A_log, dt_bias, h0, cu, chunk_map, chunk_offsets, *saved)
        ctx.cfg, ctx.shape = cfg, shape
        return o.view(B, T, H, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, h0, cu, chunk_map, chunk_offsets, *saved = ctx.saved_tensors
        kept = None if ctx.cfg["recompute"] else saved
        grads, dA_log, ddt, dh0 = _backward([q, k, v, g, beta], A_log, dt_bias, h0, cu, chunk_map, chunk_offsets,
                                            kept, ctx.cfg, ctx.shape, do, dht)
        return (*grads, dA_log, ddt, dh0, None, None, None)


def kda_triton_backward(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht):
    """The plain entry's gradients (dq, dk, dv, dg, dbeta, dh0 or None) from its inputs alone, as `kda_triton`'s
    backward computes them (the forward kernels re-run first): the backward of the compiled graph's custom op."""
    flat, h0, cu, chunk_map, chunk_offsets, shape = _inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    grads, _, _, dh0 = _backward(flat, None, None, h0, cu, chunk_map, chunk_offsets, None,
                                 _config(q.shape[-1], "none", -5.0, False, 1e-6, False, scale, True), shape, do, dht)
    return (*grads, dh0)


def _config(K, gate, lower_bound, l2norm, l2_eps, beta_sigmoid, scale, recompute):
    return dict(scale=K**-0.5 if scale is None else float(scale), gate=_GATES[gate], lower_bound=float(lower_bound),
                l2norm=bool(l2norm), l2_eps=float(l2_eps), beta_sigmoid=bool(beta_sigmoid),
                recompute=bool(recompute))


def kda_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    *,
    gate: str = "k3",
    lower_bound: float = -5.0,
    l2norm: bool = True,
    l2_eps: float = 1e-6,
    beta_sigmoid: bool = True,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    recompute: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA with the elementwise prologue fused into the kernels. Differentiable in every tensor argument.

    q, k: [B, T, H, K] raw (L2-normalised in kernel when l2norm, as x * rsqrt(sum x^2 + l2_eps));
    v: [B, T, H, V]; g: [B, T, H, K] gate input x, turned into a log-decay by
        gate="k3":   lower_bound * sigmoid(exp(A_log) * (x + dt_bias))
        gate="kimi": -exp(A_log) * softplus(x + dt_bias)
        gate="none": x is already the log-decay (A_log, dt_bias unused);
    beta: [B, T, H] logits (sigmoid in kernel) when beta_sigmoid, else values in (0, 1).
    A_log: [H] fp32; dt_bias: [H * K] fp32 or None. scale defaults to K ** -0.5 (applied after the norm).
    initial_state: [N, H, K, V]; cu_seqlens: int [N + 1] with B == 1 (documents never share state).
    recompute: the save-vs-recompute switch for backward (module docstring).
    Returns (o [B, T, H, V] in v.dtype, final state [N, H, K, V] fp32 or None).
    """
    if gate not in _GATES:
        raise ValueError(f"gate must be one of {sorted(_GATES)}, got '{gate}'")
    if _GATES[gate] != GATE_NONE and A_log is None:
        raise ValueError(f"gate='{gate}' needs A_log [H]")
    cfg = _config(q.shape[-1], gate, lower_bound, l2norm, l2_eps, beta_sigmoid, scale, recompute)
    if _GATES[gate] == GATE_NONE:
        A_log, dt_bias = None, None
    return _KDATriton.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cfg, output_final_state)


def kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    recompute: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain entry with the dispatcher's contract: q, k already normalised, g an activated log-decay (<= 0),
    beta in (0, 1). Shapes as `kda_fused`. chunk_size is ignored (the kernels use 64)."""
    del chunk_size
    return kda_fused(q, k, v, g, beta, gate="none", l2norm=False, beta_sigmoid=False, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     recompute=recompute)
