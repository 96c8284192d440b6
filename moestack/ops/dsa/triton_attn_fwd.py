"""Sparse MQA attention forward in Triton: every head of a token attends to that token's selected latent rows.

One program per (token, block of heads, slice of the value dims). Heads are the M dimension of the tiles: in MQA
form all heads of a token read the same K selected rows, so one gather of a [BLOCK_K, D] key block feeds a
[BLOCK_H, BLOCK_K] score tile for BLOCK_H heads at once. Head counts that are not a multiple of BLOCK_H (20, 96)
are padded and masked. The key latent is split into its value part (first V dims, V = kv_lora = 512) and its
rope part (R = D - V = 64) because Triton tiles need power-of-two widths. With V = 512 a [64, 512] fp32
accumulator is 128 KB of registers, so the value dims may be split across programs (BLOCK_V = V / 2): each
slice recomputes the scores, trading ~50% more QK^T work for half the accumulator (autotune picks).

Shape legend: B batch, T queries, S keys, H heads, D = V + R latent dims, K selected slots per query.
"""

from __future__ import annotations

import importlib
import os

import torch
import triton
import triton.language as tl

# TRITON_INTERPRET=1 must be set before this module is imported (CPU tests do it).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # used inside kernels: must be a constexpr global


def prune_head_blocks(configs, named_args, **kwargs):
    """Head blocks no wider than needed, value slices clamped to the padded value dims VP (a config asking for
    more is the same config with BLOCK_V = VP: the value dims are never split then), duplicates dropped, then
    whatever does not fit the device's shared memory (moestack/ops/launch.py)."""
    from moestack.ops.launch import fit_configs

    args = {**named_args, **kwargs}
    H, VP = args["H"], args.get("VP", 1 << 30)
    cap = max(64, triton.next_power_of_2(H))  # 64 kept for few heads too: wgmma needs 64 rows, may beat mma.sync
    kept, seen = [], set()
    for c in configs:
        if c.kwargs["BLOCK_H"] > cap and any(d.kwargs["BLOCK_H"] <= cap for d in configs):
            continue
        if c.kwargs.get("BLOCK_V", 0) > VP:
            c = triton.Config({**c.kwargs, "BLOCK_V": VP}, num_warps=c.num_warps, num_stages=c.num_stages,
                              maxnreg=c.maxnreg, pre_hook=c.pre_hook)
        key = (tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages, c.maxnreg)
        if key not in seen:
            seen.add(key)
            kept.append(c)
    return fit_configs(kept, args, "dsa")


def fwd_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_H": 16, "BLOCK_K": 16, "BLOCK_V": 32}, num_warps=4, num_stages=1)]
    out = []
    # sm_90 compile (ptxas) of each: no spills, shared memory 94-221 KB; BLOCK_H 64 runs wgmma, 32 / 16 mma.sync.
    # (64, 64, 512): phase B. With 8 warps Triton puts all warps on the head axis of the score tile (it feeds the
    # P V dot), so both warpgroups compute the same [64, BLOCK_K] scores from shared memory; 64 slots per step
    # halve the passes over the resident Q tile per key (shared-memory reads of Q K^T -33% by count; 221 KB)
    for bh, bk, bv, w, s in [
        (64, 64, 512, 8, 2),
        (64, 32, 512, 8, 3),  # phase B: one more gather in flight (148 KB, no spills)
        (64, 32, 512, 8, 2),
        (64, 32, 256, 8, 2),
        (64, 16, 512, 8, 3),
        (32, 64, 512, 8, 2),
        (16, 64, 512, 4, 2),
    ]:
        out.append(triton.Config({"BLOCK_H": bh, "BLOCK_K": bk, "BLOCK_V": bv}, num_warps=w, num_stages=s))
    return out


@triton.autotune(
    configs=fwd_configs(),
    key=["H", "K", "V", "R"],
    prune_configs_by={"early_config_prune": prune_head_blocks},
)
@triton.jit(do_not_specialize=["T", "H", "K"])
def _sparse_mqa_fwd_kernel(
    Q, KV, IDX, O, LSE,
    T, H, K, scale_log2,
    s_qb, s_qt, s_qh,
    s_kb, s_ks,
    s_ib, s_it,
    s_ob, s_ot, s_oh,
    V: tl.constexpr, R: tl.constexpr, VP: tl.constexpr, RP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_v = tl.program_id(2)
    b = pid_t // T
    t = pid_t % T
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = tl.arange(0, VP)  # value dims, padded to a power of two (VP == V == 512 in MLA)
    offs_r = tl.arange(0, RP)  # rope dims, padded (RP == R == 64 in MLA; R may be 0)
    mask_c = offs_c < V
    mask_r = offs_r < R
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)

    q_rows = Q + b.to(tl.int64) * s_qb + t.to(tl.int64) * s_qt + offs_h[:, None] * s_qh
    q_c = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)  # [BH, VP]
    q_r = tl.load(q_rows + V + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # [BH, RP]
    kv_base = KV + b.to(tl.int64) * s_kb
    idx_base = IDX + b.to(tl.int64) * s_ib + t.to(tl.int64) * s_it

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ids = tl.load(idx_base + offs_k, mask=offs_k < K, other=-1)
        valid = ids >= 0
        rows = kv_base + tl.where(valid, ids, 0).to(tl.int64) * s_ks
        k_c = tl.load(rows[:, None] + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)  # [BK, VP]
        k_r = tl.load(rows[:, None] + V + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)
        s = tl.dot(q_c, tl.trans(k_c)) + tl.dot(q_r, tl.trans(k_r))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no valid key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if BLOCK_V == VP:
            v = k_c
        else:
            v = tl.load(rows[:, None] + offs_v[None, :], mask=valid[:, None] & (offs_v < V)[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a query with no key: o = 0, lse = -inf (as the reference)
    o = acc / l_safe[:, None]
    o_ptrs = O + b.to(tl.int64) * s_ob + t.to(tl.int64) * s_ot + offs_h[:, None] * s_oh + offs_v[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=mask_h[:, None] & (offs_v < V)[None, :])
    if pid_v == 0:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
        tl.store(LSE + pid_t.to(tl.int64) * H + offs_h, lse, mask=mask_h)  # lse contiguous [B*T, H]


# gluon: the sm_90 Gluon kernel with the score tile split over the warpgroups (gluon_attn_fwd.py), the default where
# it applies (H200, T=32768, H=64: 29.1 ms vs 35.9 for the Triton kernel); elsewhere the Triton kernel ("default").
# "auto" picks; the others are for tests and benchmarks.
FWD_VARIANTS = ("auto", "default", "gluon")


def padded_dims(V: int, R: int) -> tuple[int, int]:
    """Tile widths (powers of two >= 16) of the value part and the rope part of the latent."""
    return max(16, triton.next_power_of_2(V)), max(16, triton.next_power_of_2(max(R, 1)))


def check_inputs(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, v_dim: int) -> None:
    """One-line ValueErrors for shapes the kernels cannot take."""
    if q.dim() != 4 or kv.dim() != 3 or idx.dim() != 3:
        raise ValueError(f"q [B,T,H,D], kv [B,S,D], idx [B,T,K] expected; got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}, {tuple(idx.shape)}")  # fmt: skip
    B, T, _H, D = q.shape
    if kv.shape[0] != B or kv.shape[2] != D or idx.shape[:2] != (B, T):
        raise ValueError(f"kv {tuple(kv.shape)} / idx {tuple(idx.shape)} do not match q {tuple(q.shape)}")
    if not 0 < v_dim <= D:
        raise ValueError(f"v_dim = {v_dim} must be in 1..{D} (the value part of the latent kv[..., :v_dim])")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be int32 (got {idx.dtype}); -1 marks an empty slot")
    if kv.dtype != q.dtype:
        raise ValueError(f"kv dtype {kv.dtype} must equal q dtype {q.dtype}")


# the Gluon kernels are written against Triton 3.6's Gluon API (experimental: it changes between releases)
GLUON_TRITON = (3, 6)


def gluon_module(name: str):
    """moestack.ops.dsa.<name> (a Gluon kernel module), or None where it cannot run: under the interpreter, or on a
    Triton other than the one its API was written for (GLUON_TRITON) or without Gluon."""
    if INTERPRET or tuple(int(x) for x in triton.__version__.split(".")[:2]) < GLUON_TRITON:
        return None
    try:
        return importlib.import_module(f"moestack.ops.dsa.{name}")
    except ImportError:
        return None


def sparse_mqa_fwd(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, v_dim: int, scale: float, variant: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,T,H,D], kv [B,S,D], idx [B,T,K] int32 -> (o [B,T,H,v_dim] q.dtype, lse [B,T,H] fp32).

    variant: "default" (the Triton kernel: autotuned, value dims optionally split over programs) or "gluon"
    (gluon_attn_fwd: sm_90, bf16 / fp16, 512 + 64 latent dims); "auto" (None): "gluon" where it applies, else
    "default"."""
    variant = variant or "auto"
    if variant not in FWD_VARIANTS:
        raise ValueError(f"forward variant '{variant}' is not one of {FWD_VARIANTS}")
    check_inputs(q, kv, idx, v_dim)
    B, T, H, D = q.shape
    if variant in ("auto", "gluon"):  # before the Triton kernels' NaN-poisoned outputs: the Gluon path has its own
        gluon = gluon_module("gluon_attn_fwd")
        if gluon is not None and gluon.supported(q, kv, v_dim):
            return gluon.sparse_mqa_fwd_gluon(q, kv, idx, v_dim, scale)
        if variant == "gluon":
            raise ValueError(f"forward variant 'gluon' needs an sm_90 GPU, bf16 / fp16 and a 512 + 64 latent (got "
                             f"{q.device} {q.dtype}, D={D}, v_dim={v_dim}); use 'auto'")  # fmt: skip
        variant = "default"
    K = idx.shape[-1]
    q, kv = q.contiguous(), kv.contiguous()
    idx = idx.to(torch.int32).contiguous()
    o = torch.full((B, T, H, v_dim), float("nan"), device=q.device, dtype=q.dtype)
    lse = torch.full((B, T, H), float("nan"), device=q.device, dtype=torch.float32)

    VP, RP = padded_dims(v_dim, D - v_dim)
    def grid(meta):
        return (B * T, triton.cdiv(H, meta["BLOCK_H"]), VP // min(meta["BLOCK_V"], VP))

    _sparse_mqa_fwd_kernel[grid](
        q, kv, idx, o, lse,
        T, H, K, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        idx.stride(0), idx.stride(1),
        o.stride(0), o.stride(1), o.stride(2),
        V=v_dim, R=D - v_dim, VP=VP, RP=RP,
    )  # fmt: skip
    return o, lse
