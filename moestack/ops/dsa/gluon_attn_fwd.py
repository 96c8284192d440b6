"""Sparse MQA attention forward for sm_90 in Gluon (Triton's explicit-layout dialect): the score tile split over
the two warpgroups.

Why a Gluon kernel: in the Triton kernel (triton_attn_fwd.py) a dot that feeds another dot (S -> P -> P V) gets
warpsPerCTA = [8, 1], so with a 64-head tile both warpgroups compute the same [64, BLOCK_K] score tile and
softmax; every Triton form that splits S made the compiler rematerialise the softmax in a second layout. Gluon lets
the kernel say the layouts itself:

  S  = Q K^T      [64 heads, BLOCK_K keys]  wgmma, warps [4, 2]: warpgroup w computes keys w*BLOCK_K/2 ...
  m  = row max of S over both halves        (the compiler's cross-warp reduction, one shared-memory round trip)
  P  = exp2(S - m) -> bf16 -> shared memory (both warpgroups need all of P's columns for the next product)
  O += P V        [64, 512]                 wgmma, warps [4, 2]: warpgroup w owns value columns w*256 ...

Tensor work per warpgroup per BLOCK_K keys: 64 x BLOCK_K/2 x 576 + 64 x BLOCK_K x 256, against 64 x BLOCK_K x 576
+ 64 x BLOCK_K x 256 when the score tile is replicated (-35%). The selected latent rows are gathered with cp.async
into a NUM_STAGES ring of shared-memory tiles (the next blocks load while this one computes); the same tile is the
K operand (transposed view) of the score product and the V operand of the value product.

Scope: V = 512 value dims + R = 64 rope dims (MLA's latent), bf16 / fp16, sm_90; one program per (token, block of 64
heads); head counts that are not a multiple of 64 are masked. Same contract as triton_attn_fwd.sparse_mqa_fwd.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from moestack.ops.dsa.triton_attn_fwd import LOG2E

# callers reach this module through triton_attn_fwd.gluon_module, which checks the Triton version
LN2 = gl.constexpr(0.6931471805599453)
BLOCK_H = 64  # one wgmma M tile: 4 warps x 16 rows
# (BLOCK_K, NUM_STAGES): shared memory = Q 72 KB + NUM_STAGES x BLOCK_K x 1152 B + P; sm_90 allows 227 KB (ptxas on
# sm_90, no spills: 223-243 registers). A variant that kept block i - 1's P V in flight during block i's softmax (P
# double-buffered, NUM_STAGES >= 3) measured 36.7 ms at (32, 3): removed (benchmarks/RESULTS.md, DSA run 7)
CONFIGS = ((64, 2), (32, 3), (32, 2), (16, 4))
DEFAULT_CONFIG = (64, 2)  # H200, T=32768, H=64: 29.1 ms; (32, 3) 40.0, (32, 2) 40.2, (16, 4) 64.5


@gluon.jit
def _issue_gather(kc_buf, kr_buf, kv_base, idx_base, k0, K, s_ks,
                  V: gl.constexpr, R: gl.constexpr, BLOCK_K: gl.constexpr,
                  gather_c: gl.constexpr, gather_r: gl.constexpr):  # fmt: skip
    """cp.async of the latent rows kv[idx[k0 : k0 + BLOCK_K]] into (kc_buf [BLOCK_K, V], kr_buf [BLOCK_K, R]);
    empty slots (-1) and slots past K are zero-filled."""
    offs_k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, gather_c))
    ids = gl.load(idx_base + offs_k, mask=offs_k < K, other=-1)
    valid = ids >= 0
    rows = kv_base + gl.where(valid, ids, 0).to(gl.int64) * s_ks
    offs_c = gl.arange(0, V, layout=gl.SliceLayout(0, gather_c))
    async_copy.async_copy_global_to_shared(kc_buf, rows[:, None] + offs_c[None, :], mask=valid[:, None])
    rows_r = gl.convert_layout(rows, gl.SliceLayout(1, gather_r))
    valid_r = gl.convert_layout(valid, gl.SliceLayout(1, gather_r))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, gather_r))
    async_copy.async_copy_global_to_shared(kr_buf, rows_r[:, None] + V + offs_r[None, :], mask=valid_r[:, None])


@gluon.jit
def _sparse_mqa_fwd_gluon_kernel(
    Q, KV, IDX, O, LSE,
    T, H, K, scale_log2,
    s_qb, s_qt, s_qh,
    s_kb, s_ks,
    s_ib, s_it,
    s_ob, s_ot, s_oh,
    V: gl.constexpr, R: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    gl.static_assert(gl.num_warps() == 8, "two warpgroups: launch with num_warps=8")
    dtype: gl.constexpr = Q.dtype.element_ty
    pid_t = gl.program_id(0)
    pid_h = gl.program_id(1)
    b = pid_t // T
    t = pid_t % T

    # register layouts: the two products split over the warpgroups along N (keys for S, value columns for O)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_K // 2, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, V // 2, 16])  # fmt: skip
    # 16-byte vectors along a latent row for the loads
    gather_c: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    gather_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    # shared memory (wgmma operands: NVMMA swizzled layouts)
    qc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, V], dtype)
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], dtype)
    kc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, V], dtype)
    kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, R], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_K], dtype)
    qc_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, V], qc_sl)
    qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, R], qr_sl)
    kc_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, V], kc_sl)
    kr_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, R], kr_sl)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_K], p_sl)

    kv_base = KV + b.to(gl.int64) * s_kb
    idx_base = IDX + b.to(gl.int64) * s_ib + t.to(gl.int64) * s_it
    n_blocks = gl.cdiv(K, BLOCK_K)

    # the first NUM_STAGES - 1 gathers go out before Q is staged
    for i in gl.static_range(NUM_STAGES - 1):
        if i < n_blocks:
            _issue_gather(kc_ring.index(i), kr_ring.index(i), kv_base, idx_base, i * BLOCK_K, K, s_ks,
                          V, R, BLOCK_K, gather_c, gather_r)  # fmt: skip
        async_copy.commit_group()

    offs_hq = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, gather_c))
    q_rows = Q + b.to(gl.int64) * s_qb + t.to(gl.int64) * s_qt + offs_hq.to(gl.int64) * s_qh
    offs_c = gl.arange(0, V, layout=gl.SliceLayout(0, gather_c))
    qc_smem.store(gl.load(q_rows[:, None] + offs_c[None, :], mask=(offs_hq < H)[:, None], other=0.0))
    offs_hr = gl.convert_layout(offs_hq, gl.SliceLayout(1, gather_r))
    q_rows_r = gl.convert_layout(q_rows, gl.SliceLayout(1, gather_r))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, gather_r))
    qr_smem.store(gl.load(q_rows_r[:, None] + V + offs_r[None, :], mask=(offs_hr < H)[:, None], other=0.0))

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_part = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)  # row sums folded once at the end
    acc = gl.zeros([BLOCK_H, V], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)
    offs_ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))
    for i in range(n_blocks):
        # block i has landed (this thread's copies), then everyone's: the barrier also retires iteration i - 1,
        # whose stage and P tile the next gather and this iteration's P store overwrite
        async_copy.wait_group(NUM_STAGES - 2)
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async proxy
        gl.thread_barrier()
        nxt = i + NUM_STAGES - 1
        if nxt < n_blocks:
            stage_n = nxt % NUM_STAGES
            _issue_gather(kc_ring.index(stage_n), kr_ring.index(stage_n), kv_base, idx_base, nxt * BLOCK_K, K,
                          s_ks, V, R, BLOCK_K, gather_c, gather_r)  # fmt: skip
        async_copy.commit_group()

        stage = i % NUM_STAGES
        kc = kc_ring.index(stage)
        kr = kr_ring.index(stage)
        s = warpgroup_mma(qc_smem, kc.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qr_smem, kr.permute((1, 0)), s, is_async=True)
        ids = gl.load(idx_base + i * BLOCK_K + offs_ks, mask=i * BLOCK_K + offs_ks < K, other=-1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        p, alpha, m_i, l_part = _online_softmax(s, ids, m_i, l_part, scale_log2)

        p_smem.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(p_smem, kc, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    async_copy.wait_group(0)

    l_i = gl.sum(l_part, axis=1)
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)  # a query with no key: o = 0, lse = -inf (as the reference)
    o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    offs_ho = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    offs_v = gl.arange(0, V, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (O + b.to(gl.int64) * s_ob + t.to(gl.int64) * s_ot + offs_ho.to(gl.int64)[:, None] * s_oh
              + offs_v[None, :])  # fmt: skip
    gl.store(o_ptrs, o.to(dtype), mask=(offs_ho < H)[:, None])
    offs_hl = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
    lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    gl.store(LSE + pid_t.to(gl.int64) * H + offs_hl, lse, mask=offs_hl < H)


@gluon.jit
def _online_softmax(s, ids, m_i, l_part, scale_log2):
    """One key block of the running softmax in the log2 domain: (P, alpha, new row max, row-sum partials)."""
    s = gl.where((ids >= 0)[None, :], s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no valid key yet
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_part * alpha[:, None] + p


def smem_bytes(config: tuple[int, int], V: int = 512, R: int = 64, elt: int = 2) -> int:
    """Shared memory of one program: Q [BLOCK_H, V + R], the key ring NUM_STAGES x [BLOCK_K, V + R], P."""
    bk, ns = config
    return elt * (BLOCK_H * (V + R) + ns * bk * (V + R) + BLOCK_H * bk)


def fitting_config(device: torch.device) -> tuple[int, int] | None:
    """The first of CONFIGS (DEFAULT_CONFIG first) whose shared memory fits `device`; None if none does."""
    from moestack.ops.launch import fits

    for config in (DEFAULT_CONFIG, *CONFIGS):
        if fits(smem_bytes(config), device, warps=8):
            return config
    return None


def supported(q: torch.Tensor, kv: torch.Tensor, v_dim: int) -> bool:
    """The shapes and device this kernel covers: sm_90, bf16 / fp16, latent = 512 value + 64 rope dims, and a config
    that fits the device's shared memory."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype
            and v_dim == 512 and q.shape[-1] == 576 and torch.cuda.get_device_capability(q.device)[0] == 9
            and fitting_config(q.device) is not None)  # fmt: skip


def sparse_mqa_fwd_gluon(q, kv, idx, v_dim: int, scale: float,
                         config: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """q [B,T,H,576], kv [B,S,576], idx [B,T,K] int32 -> (o [B,T,H,512], lse [B,T,H] fp32); see the module doc.
    config: (BLOCK_K, NUM_STAGES), one of CONFIGS (default: DEFAULT_CONFIG, or the first that fits the device)."""
    B, T, H, D = q.shape
    K = idx.shape[-1]
    bk, ns = config or fitting_config(q.device) or DEFAULT_CONFIG
    q, kv, idx = q.contiguous(), kv.contiguous(), idx.to(torch.int32).contiguous()
    o = torch.empty((B, T, H, v_dim), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, T, H), device=q.device, dtype=torch.float32)
    _sparse_mqa_fwd_gluon_kernel[(B * T, triton.cdiv(H, BLOCK_H))](
        q, kv, idx, o, lse,
        T, H, K, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        idx.stride(0), idx.stride(1),
        o.stride(0), o.stride(1), o.stride(2),
        V=v_dim, R=D - v_dim, BLOCK_H=BLOCK_H, BLOCK_K=bk, NUM_STAGES=ns,
        num_warps=8,
    )  # fmt: skip
    return o, lse
