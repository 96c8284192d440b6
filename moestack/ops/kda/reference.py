"""Kimi Delta Attention in plain PyTorch: the spec (token loop), the chunkwise-parallel form, and the gates.

Recurrence per head (MODEL.md "KDA"), state S in R^{K x V}, alpha_t = exp(g_t) per key channel:

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T ;   o_t = S_t^T (scale * q_t)

Shape legend (fla layout):
    B batch, T tokens, H heads, K key/query head dim, V value head dim,
    N sequences (= B, or the number of documents when `cu_seqlens` packs them into a B == 1 batch),
    M chunks (all sequences, each padded to a multiple of C), C chunk size, b sub-block rows inside a chunk.

The chunked derivation is in README.md next to this file. Both functions compute in fp32 (fp64 stays fp64) with
autocast disabled, and return `o` in the dtype of `v` and the final state in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SUB_BLOCK = 8  # rows per diagonal sub-block in _decayed_scores: bounds its [b, b, K] temporary


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> tuple[int, int]:
    """Validate shapes; return (N sequences, K)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    assert k.shape == (B, T, H, K), f"k {tuple(k.shape)} != q {tuple(q.shape)}"
    assert v.shape[:3] == (B, T, H), f"v {tuple(v.shape)} must be [B, T, H, V] with q {tuple(q.shape)}"
    assert g.shape == (B, T, H, K), f"g {tuple(g.shape)} must be [B, T, H, K] (expand a per-head decay to K)"
    assert beta.shape == (B, T, H), f"beta {tuple(beta.shape)} must be [B, T, H]"
    if cu_seqlens is not None:
        assert B == 1, f"cu_seqlens packs documents into one row: B must be 1, got {B}"
        assert cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 2, "cu_seqlens must be [N + 1] offsets"
        assert int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == T, f"cu_seqlens must run from 0 to T={T}"
        N = cu_seqlens.numel() - 1
    else:
        N = B
    if initial_state is not None:
        assert initial_state.shape == (N, H, K, V), f"initial_state {tuple(initial_state.shape)} != {(N, H, K, V)}"
    return N, K


def _sequence_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """[start, end) of each sequence in the flattened [B * T] token axis (a host sync: fine for a reference)."""
    if cu_seqlens is None:
        return [(b * T, (b + 1) * T) for b in range(B)]
    offsets = cu_seqlens.tolist()
    return list(zip(offsets[:-1], offsets[1:]))


# ----------------------------------------------------------------------------------------------------------------
# Gates (log-space decays, fp32)
# ----------------------------------------------------------------------------------------------------------------


def _gate_params(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None):
    H, D = x.shape[-2], x.shape[-1]
    assert A_log.numel() == H, f"A_log has {A_log.numel()} entries, expected H={H}"
    dt = _compute_dtype(x)
    x32 = x.to(dt)
    if dt_bias is not None:
        assert dt_bias.numel() == H * D, f"dt_bias has {dt_bias.numel()} entries, expected H*{D}={H * D}"
        x32 = x32 + dt_bias.to(dt).view(H, D)
    return x32, A_log.to(dt).exp().view(H, 1)


def kda_gate_k3(
    x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None, lower_bound: float
) -> torch.Tensor:
    """K3 gate: g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias)), a log-decay in (lower_bound, 0).

    x: [B, T, H, K] (per-channel decay) or [B, T, H, 1] (per-head decay), any float dtype.
    A_log: [H]; dt_bias: [H*K] (or [H]) or None. Returns fp32 (fp64 for fp64 x), shaped like x.
    """
    assert lower_bound < 0, f"lower_bound must be negative, got {lower_bound}"
    x32, A = _gate_params(x, A_log, dt_bias)
    return lower_bound * torch.sigmoid(A * x32)


def kda_gate_kimi_linear(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Kimi Linear gate: g = -exp(A_log) * softplus(x + dt_bias), a log-decay in (-inf, 0).

    Shapes and dtype as `kda_gate_k3`.
    """
    x32, A = _gate_params(x, A_log, dt_bias)
    return -A * F.softplus(x32)


# ----------------------------------------------------------------------------------------------------------------
# Token-by-token recurrence: the spec
# ----------------------------------------------------------------------------------------------------------------


def kda_recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA by the literal recurrence, one token at a time (slow; the ground truth for every other path).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (<= 0); beta: [B, T, H] in (0, 1).
    scale: query scale, default K ** -0.5. initial_state: [N, H, K, V] or None (zeros).
    cu_seqlens: int [N + 1] document offsets into a B == 1 batch; each document starts from its own
    initial-state row and no state crosses documents. Without it N = B.
    Returns o [B, T, H, V] in v.dtype and, if output_final_state, the final state [N, H, K, V] (fp32 or fp64).
    """
    B, T, H, _ = q.shape
    N, K = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = _compute_dtype(v)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
        S0_NHKV = initial_state.to(dt) if initial_state is not None else q.new_zeros(N, H, K, V, dtype=dt)
        if cu_seqlens is None:  # B sequences of equal length: scan them together
            o, S = _scan(q, k, v, g, beta, S0_NHKV, scale)
        else:  # one document at a time, each from its own initial state
            o_docs, S_docs = [], []
            for n, (s, e) in enumerate(_sequence_bounds(B, T, cu_seqlens)):
                o_n, S_n = _scan(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], S0_NHKV[n : n + 1], scale)
                o_docs.append(o_n)
                S_docs.append(S_n)
            o, S = torch.cat(o_docs, dim=1), torch.cat(S_docs)
    return o.to(v.dtype), (S if output_final_state else None)


def _scan(q, k, v, g, beta, S_RHKV, scale):
    """Token loop over R sequences of equal length L: q, k, g [R, L, H, K], v [R, L, H, V], beta [R, L, H],
    S [R, H, K, V] -> (o [R, L, H, V], S_L)."""
    o = []
    for t in range(q.shape[1]):
        k_RHK1 = k[:, t, :, :, None]
        S_RHKV = g[:, t].exp()[..., None] * S_RHKV  # Diag(alpha_t) S_{t-1}
        # (I - b k k^T) S + b k v^T  ==  S + k (b (v - S^T k))^T
        delta_RHV = beta[:, t, :, None] * (v[:, t] - (k_RHK1 * S_RHKV).sum(-2))
        S_RHKV = S_RHKV + k_RHK1 * delta_RHV[..., None, :]
        o.append((S_RHKV * (scale * q[:, t])[..., None]).sum(-2))  # S_t^T (scale q_t)
    o_RLHV = torch.stack(o, dim=1) if o else v.new_zeros(v.shape)
    return o_RLHV, S_RHKV


# ----------------------------------------------------------------------------------------------------------------
# Chunkwise-parallel form
# ----------------------------------------------------------------------------------------------------------------


def _exp(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """exp of an fp64 log-decay difference, in `dtype`: only the subtraction needs fp64, not the exp."""
    return x64.to(dtype).exp()


def _decayed_scores(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, strict: bool) -> torch.Tensor:
    """P[..., r, i] = sum_c a[r, c] b[i, c] exp(G[r, c] - G[i, c]) for i < r (strict) or i <= r; 0 above.

    a, b: [..., C, K]; G: [..., C, K] fp64, non-increasing along C (a cumulative sum of log-decays). Every
    exponent used is <= 0, so nothing overflows however strong the decay: rows are split into sub-blocks of
    _SUB_BLOCK; columns in earlier sub-blocks go through a matmul with both factors measured from the sub-block's
    first row (exp(G_r - G_ref) <= 1, exp(G_ref - G_i) <= 1); the diagonal sub-block uses exact pairwise
    differences, masked before the exp. Returns [..., C, C] in a.dtype.
    """
    C = a.shape[-2]
    blk = min(_SUB_BLOCK, C)
    tri_bb = torch.ones(blk, blk, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    rows = []
    for s in range(0, C, blk):
        e = min(s + blk, C)
        a_r, b_r, G_r = a[..., s:e, :], b[..., s:e, :], G[..., s:e, :]
        n = e - s
        diff_rik = (G_r[..., :, None, :] - G_r[..., None, :, :]).to(a.dtype)  # [..., n, n, K]
        decay_rik = diff_rik.masked_fill(~tri_bb[:n, :n, None], float("-inf")).exp()
        diag = (a_r[..., :, None, :] * b_r[..., None, :, :] * decay_rik).sum(-1)  # [..., n, n]
        parts = []
        if s > 0:
            G_ref = G[..., s : s + 1, :]
            left = a_r * _exp(G_r - G_ref, a.dtype)  # [..., n, K]
            right = b[..., :s, :] * _exp(G_ref - G[..., :s, :], a.dtype)  # [..., s, K]
            parts.append(left @ right.transpose(-1, -2))  # [..., n, s]
        parts.append(diag)
        if e < C:
            parts.append(a.new_zeros(*a.shape[:-2], n, C - e))
        rows.append(torch.cat(parts, dim=-1))
    return torch.cat(rows, dim=-2)


def _pack_chunks(x_LD: torch.Tensor, index_P: torch.Tensor, valid_P: torch.Tensor, C: int) -> torch.Tensor:
    """Gather tokens into chunk layout, zero-filling padding: [L, H, D] -> [M, H, C, D]."""
    x_PHD = x_LD[index_P] * valid_P.view(-1, *([1] * (x_LD.dim() - 1))).to(x_LD.dtype)
    return x_PHD.reshape(-1, C, *x_LD.shape[1:]).transpose(1, 2)


def kda_chunked_reference(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA in the chunkwise-parallel (WY) form; same contract as `kda_recurrent_reference`, differentiable.

    chunk_size: C, any positive int (64 is the kernels' choice). Each sequence is zero-padded to a multiple of C;
    a padded token has k = v = q = 0, beta = 0 and g = 0, so it leaves the state unchanged.
    Work is vectorised over sequences, heads and chunks; only the chunk-to-chunk state recurrence loops.
    """
    B, T, H, _ = q.shape
    N, K = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    V = v.shape[-1]
    C = chunk_size
    assert C > 0
    scale = K**-0.5 if scale is None else scale
    dt = _compute_dtype(v)
    dev = q.device
    bounds = _sequence_bounds(B, T, cu_seqlens)

    # Chunk layout: sequence n owns chunks first[n] .. first[n] + n_chunks[n] - 1 of M chunks in all.
    n_chunks = [-(-(e - s) // C) for s, e in bounds]
    first = [sum(n_chunks[:n]) for n in range(N)]
    index, valid, keep = [], [], []
    for (s, e), nc, f in zip(bounds, n_chunks, first):
        pos = torch.arange(s, s + nc * C, device=dev)
        valid.append(pos < e)
        index.append(pos.clamp(max=max(e - 1, 0)))
        keep.append(torch.arange(f * C, f * C + e - s, device=dev))  # the real tokens' rows (no mask: no sync)
    index_P = torch.cat(index) if index else torch.zeros(0, dtype=torch.long, device=dev)
    valid_P = torch.cat(valid) if valid else torch.zeros(0, dtype=torch.bool, device=dev)

    with torch.autocast(dev.type, enabled=False):
        q_MHCK = _pack_chunks(q.reshape(B * T, H, K).to(dt), index_P, valid_P, C) * scale
        k_MHCK = _pack_chunks(k.reshape(B * T, H, K).to(dt), index_P, valid_P, C)
        v_MHCV = _pack_chunks(v.reshape(B * T, H, V).to(dt), index_P, valid_P, C)
        g_MHCK = _pack_chunks(g.reshape(B * T, H, K).to(dt), index_P, valid_P, C)
        beta_MHC = _pack_chunks(beta.reshape(B * T, H, 1).to(dt), index_P, valid_P, C)[..., 0]

        # Intra-chunk (all chunks at once). G: cumulative log-decay inside the chunk, Gamma = exp(G) <= 1.
        # G is kept in fp64: in fp32 a difference G_r - G_i of two cumsums of size ~C*|g| would lose
        # ~C*|g|*6e-8 absolute, i.e. ~1e-5 relative on exp(G_r - G_i) for strong gates.
        G_MHCK = g_MHCK.double().cumsum(dim=-2)
        G_last_MHK = G_MHCK[..., -1, :]
        # A[r, i] = beta_r k_r^T Diag(Gamma_r / Gamma_i) k_i for i < r; M = (I + A)^-1 Diag(beta).
        A_MHCC = beta_MHC[..., :, None] * _decayed_scores(k_MHCK, k_MHCK, G_MHCK, strict=True)
        eye_CC = torch.eye(C, dtype=dt, device=dev)
        rhs = beta_MHC[..., None] * torch.cat([k_MHCK * _exp(G_MHCK, dt), v_MHCV], dim=-1)
        WU = torch.linalg.solve_triangular(A_MHCC + eye_CC, rhs, upper=False, unitriangular=True)
        W_MHCK, U_MHCV = WU[..., :K], WU[..., K:]  # W = M (Gamma * K), U = M V
        P_MHCC = _decayed_scores(q_MHCK, k_MHCK, G_MHCK, strict=False)  # Tril((Gamma*Q)(K/Gamma)^T), stable
        qg_MHCK = q_MHCK * _exp(G_MHCK, dt)  # Gamma * Q
        gl_MHK = _exp(G_last_MHK, dt)  # Gamma_C: the whole chunk's decay
        kd_MHCK = k_MHCK * _exp(G_last_MHK[..., None, :] - G_MHCK, dt)  # Gamma^{i->C} * K

        # Inter-chunk: step j advances the j-th chunk of every sequence that has one.
        S_NHKV = (
            initial_state.to(dt) if initial_state is not None else q.new_zeros(N, H, K, V, dtype=dt)
        )
        S_start, delta, order = [], [], []
        for j in range(max(n_chunks, default=0)):
            seqs = [n for n in range(N) if n_chunks[n] > j]
            seq_idx = torch.tensor(seqs, device=dev)
            chunk_idx = torch.tensor([first[n] + j for n in seqs], device=dev)
            S_sHKV = S_NHKV if len(seqs) == N else S_NHKV[seq_idx]
            D_sHCV = U_MHCV[chunk_idx] - W_MHCK[chunk_idx] @ S_sHKV  # U - W S: the chunk's state deltas
            S_next = gl_MHK[chunk_idx][..., None] * S_sHKV + kd_MHCK[chunk_idx].transpose(-1, -2) @ D_sHCV
            S_NHKV = S_next if len(seqs) == N else S_NHKV.index_copy(0, seq_idx, S_next)
            S_start.append(S_sHKV)
            delta.append(D_sHCV)
            order.append(chunk_idx)

        M = index_P.numel() // C
        if M:
            inverse = torch.empty(M, dtype=torch.long, device=dev)
            inverse[torch.cat(order)] = torch.arange(M, device=dev)
            S0_MHKV = torch.cat(S_start)[inverse]
            D_MHCV = torch.cat(delta)[inverse]
            o_MHCV = qg_MHCK @ S0_MHKV + P_MHCC @ D_MHCV
            o_PHV = o_MHCV.transpose(1, 2).reshape(M * C, H, V)
            o = o_PHV.index_select(0, torch.cat(keep)).reshape(B, T, H, V)
        else:
            o = v.new_zeros(B, T, H, V, dtype=dt)
    return o.to(v.dtype), (S_NHKV if output_final_state else None)
