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


def autotune_off() -> bool:
    """MOESTACK_DSA_AUTOTUNE=0: one config per DSA kernel (one compile, no autotuning)."""
    return os.environ.get("MOESTACK_DSA_AUTOTUNE", "1") == "0"


def _prune_head_blocks(configs, named_args, **kwargs):
    """Drop head blocks wider than needed and value slices wider than the padded value dims."""
    H, V = named_args["H"], kwargs.get("VP", named_args.get("VP", 1 << 30))
    cap = max(64, triton.next_power_of_2(H))  # 64 kept for few heads too: wgmma needs 64 rows, may beat mma.sync
    kept = [c for c in configs if c.kwargs["BLOCK_H"] <= cap and c.kwargs.get("BLOCK_V", 0) <= V]
    return kept or configs[:1]


def fwd_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_H": 16, "BLOCK_K": 16, "BLOCK_V": 32}, num_warps=4, num_stages=1)]
    out = []
    if autotune_off():
        return [triton.Config({"BLOCK_H": 64, "BLOCK_K": 32, "BLOCK_V": 512}, num_warps=8, num_stages=2)]
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
    prune_configs_by={"early_config_prune": _prune_head_blocks},
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


# ------------------------------------------------------------------ variant "splits": score tile split over warpgroups
# MOESTACK_DSA_FWD=splits (opt-in until GPU-confirmed). Triton gives a dot whose result feeds another dot (S -> P -> PV)
# warpsPerCTA = [num_warps, 1] (AccelerateMatmul's chained-dot rule, decided on the dot's SSA forward slice). With a
# 64-head tile and 8 warps both warpgroups then compute the same [64, BLOCK_K] score tile and softmax. Here each of
# the two score dots sits in its own scf.if on a runtime flag (ONE = 1): the forward slice of a dot inside an if
# region ends at its scf.yield, so Triton sees no chain and splits S over the warpgroups by keys ([4, 2]); the row
# max / sum then cross warpgroups through shared memory and P is re-laid out (shared memory) as the A operand of
# P V, whose [64, 512] accumulator is split by value columns as before. Tensor work per warpgroup per 64 keys:
# 64 x 32 x 576 + 64 x 64 x 256 instead of 64 x 64 x 576 + 64 x 64 x 256 (-35%). From the sm_90 TTGIR
# (sm90_report.py): Triton rematerialises the softmax in the dot-operand layout (fp32 S through shared memory, exp2
# once split for the row sums and once per warpgroup for P): 1.5x the exp2 work of the replicated kernel. The
# (64, 64) tile at 2 stages does not get its gathers pipelined (197 KB); (64, 32) at 3 stages does (131 KB).


def fwd_split_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_H": 16, "BLOCK_K": 16}, num_warps=4, num_stages=1)]
    # sm_90 ptxas (sm90_report.py): (64, 32) 131 KB, 64 B spills, gathers pipelined; (64, 64) 197 KB, ~0.6 KB spills,
    # gathers not pipelined; a 32-head tile (mma.sync, 4 warps) spills 1.6 KB: not listed
    tiles = [(64, 32, 8, 3), (64, 32, 8, 2), (64, 64, 8, 2)]
    if autotune_off():
        tiles = tiles[:1]
    return [triton.Config({"BLOCK_H": bh, "BLOCK_K": bk}, num_warps=w, num_stages=s) for bh, bk, w, s in tiles]


@triton.jit
def _gather_rows(kv_base, ids, s_ks, offs_c, offs_r, mask_c, mask_r, V: tl.constexpr):
    """Latent rows kv[ids] split as value part [BK, VP] and rope part [BK, RP]; zeros at -1 slots."""
    valid = ids >= 0
    rows = kv_base + tl.where(valid, ids, 0).to(tl.int64) * s_ks
    b_kc = tl.load(rows[:, None] + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)
    b_kr = tl.load(rows[:, None] + V + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)
    return b_kc, b_kr


@triton.jit
def _prefetch_rows(kv_base, ids, s_ks, PF_LINES: tl.constexpr, PF_P2: tl.constexpr, LEVEL: tl.constexpr):
    """prefetch.global.L1 (LEVEL 1) or .L2 (LEVEL 2) of the 128-byte lines of rows kv[ids] (PF_LINES per row, PF_P2
    = its next power of two; -1 slots hint row 0)."""
    line = tl.minimum(tl.arange(0, PF_P2), PF_LINES - 1) * (1024 // kv_base.dtype.element_ty.primitive_bitwidth)
    ptr = kv_base + tl.where(ids >= 0, ids, 0).to(tl.int64)[:, None] * s_ks + line[None, :]
    if LEVEL == 1:
        tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


@triton.autotune(configs=fwd_split_configs(), key=["H", "K", "V", "R", "SPLIT", "PREFETCH"],
                 prune_configs_by={"early_config_prune": _prune_head_blocks})  # fmt: skip
@triton.jit(do_not_specialize=["T", "H", "K", "ONE"])
def _sparse_mqa_fwd_kernel_splits(
    Q, KV, IDX, O, LSE,
    T, H, K, scale_log2, ONE,
    s_qb, s_qt, s_qh,
    s_kb, s_ks,
    s_ib, s_it,
    s_ob, s_ot, s_oh,
    V: tl.constexpr, R: tl.constexpr, VP: tl.constexpr, RP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    PF_LINES: tl.constexpr, PF_P2: tl.constexpr,
):  # fmt: skip
    """As _sparse_mqa_fwd_kernel with BLOCK_V = VP (one program per (token, head block)); ONE must be 1.
    SPLIT: score tile split over warpgroups (above); PREFETCH 1 / 2: L1 / L2 prefetch hints for the next block's
    rows (PF_LINES 128-byte lines per row), 0: none (GPU only: inline PTX)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = pid_t // T
    t = pid_t % T
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = tl.arange(0, VP)
    offs_r = tl.arange(0, RP)
    mask_c = offs_c < V
    mask_r = offs_r < R

    q_rows = Q + b.to(tl.int64) * s_qb + t.to(tl.int64) * s_qt + offs_h[:, None] * s_qh
    b_qc = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)  # [BH, VP]
    b_qr = tl.load(q_rows + V + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # [BH, RP]
    kv_base = KV + b.to(tl.int64) * s_kb
    idx_base = IDX + b.to(tl.int64) * s_ib + t.to(tl.int64) * s_it

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, VP], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        ids = tl.load(idx_base + k0 + offs_k, mask=k0 + offs_k < K, other=-1)
        if PREFETCH:
            nxt = k0 + BLOCK_K + offs_k
            ids_nx = tl.load(idx_base + nxt, mask=nxt < K, other=-1)
        b_kc, b_kr = _gather_rows(kv_base, ids, s_ks, offs_c, offs_r, mask_c, mask_r, V)
        if PREFETCH:
            # hint the rows of block k0 + BLOCK_K into L1 (prefetch.global.L1: no registers held; a register
            # prefetch of the next tile spills ~1.4 KB here) while block k0's gather is in flight. Triton's
            # pipeliner async-copies the current slot ids only; the row gathers stay synchronous loads in the loop.
            _prefetch_rows(kv_base, ids_nx, s_ks, PF_LINES, PF_P2, PREFETCH)
        valid = ids >= 0
        if SPLIT:
            # each dot in its own if region: no dot in its forward slice -> warps split over keys, no replica
            # (two different conditions: ifs on the same one get merged, and the first dot would feed the second)
            if ONE > 0:
                b_s = tl.dot(b_qc, tl.trans(b_kc))  # [BH, BK]
            else:
                b_s = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
            if ONE < 2:
                b_s2 = tl.dot(b_qr, tl.trans(b_kr), b_s)
            else:
                b_s2 = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)  # never taken; constant: b_s single-use
        else:
            b_s2 = tl.dot(b_qr, tl.trans(b_kr), tl.dot(b_qc, tl.trans(b_kc)))  # replicated over warpgroups
        b_s2 = tl.where(valid[None, :], b_s2 * scale_log2, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(b_s2, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        b_p = tl.exp2(b_s2 - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(b_p, 1)
        acc = tl.dot(b_p.to(b_kc.dtype), b_kc, acc * alpha[:, None])
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_ptrs = O + b.to(tl.int64) * s_ob + t.to(tl.int64) * s_ot + offs_h[:, None] * s_oh + offs_c[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=mask_h[:, None] & mask_c[None, :])
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    tl.store(LSE + pid_t.to(tl.int64) * H + offs_h, lse, mask=mask_h)


# pf: + L1 prefetch hints for the next block's gather; pf2: L2 hints (kv beyond L2: T = 131072 is 151 MB)
# gluon: the sm_90 Gluon kernel with the score tile split over the warpgroups (gluon_attn_fwd.py); auto: gluon where
# it applies (H200, T=32768, H=64: 29.1 ms vs 35.9 for "default"), else "default"
FWD_VARIANTS = ("auto", "default", "splits", "splits_pf", "splits_pf2", "pf", "gluon")
FWD_ENV_VAR = "MOESTACK_DSA_FWD"


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


def gluon_module(name: str):
    """moestack.ops.dsa.<name> (a Gluon kernel module), or None where it cannot run: under the interpreter, or on a
    Triton without Gluon (an experimental API; the modules also check the version in their applicability test)."""
    if INTERPRET:
        return None
    try:
        return importlib.import_module(f"moestack.ops.dsa.{name}")
    except ImportError:
        return None


def sparse_mqa_fwd(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, v_dim: int, scale: float, variant: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,T,H,D], kv [B,S,D], idx [B,T,K] int32 -> (o [B,T,H,v_dim] q.dtype, lse [B,T,H] fp32).

    variant: "default" (autotuned, value dims optionally split over programs), "splits" (score tile split over
    the warpgroups, see _sparse_mqa_fwd_kernel_splits), "splits_pf" / "splits_pf2" (splits + L1 / L2 prefetch hints for
    the next block's rows), "pf" (prefetch only, replicated scores) or "gluon" (gluon_attn_fwd: sm_90, bf16 / fp16,
    512 + 64 latent dims); "auto": "gluon" where it applies, else "default"; None reads MOESTACK_DSA_FWD (default
    "auto")."""
    variant = variant or os.environ.get(FWD_ENV_VAR, "auto")
    if variant not in FWD_VARIANTS:
        raise ValueError(f"forward variant '{variant}' is not one of {FWD_VARIANTS} (argument or {FWD_ENV_VAR})")
    check_inputs(q, kv, idx, v_dim)
    B, T, H, D = q.shape
    if variant in ("auto", "gluon"):  # before the Triton kernels' NaN-poisoned outputs: the Gluon path has its own
        gluon = gluon_module("gluon_attn_fwd")
        if gluon is not None and gluon.supported(q, kv, v_dim):
            return gluon.sparse_mqa_fwd_gluon(q, kv, idx, v_dim, scale)
        if variant == "gluon":
            raise ValueError(f"forward variant 'gluon' needs an sm_90 GPU, bf16 / fp16 and a 512 + 64 latent (got "
                             f"{q.device} {q.dtype}, D={D}, v_dim={v_dim}); use 'auto' (or unset "
                             f"{FWD_ENV_VAR})")  # fmt: skip
        variant = "default"
    K = idx.shape[-1]
    q, kv = q.contiguous(), kv.contiguous()
    idx = idx.to(torch.int32).contiguous()
    o = torch.full((B, T, H, v_dim), float("nan"), device=q.device, dtype=q.dtype)
    lse = torch.full((B, T, H), float("nan"), device=q.device, dtype=torch.float32)

    VP, RP = padded_dims(v_dim, D - v_dim)
    if variant != "default":
        lines = triton.cdiv(D * q.element_size(), 128)  # 128-byte lines per latent row (9 at 576 bf16)
        _sparse_mqa_fwd_kernel_splits[lambda meta: (B * T, triton.cdiv(H, meta["BLOCK_H"]))](
            q, kv, idx, o, lse,
            T, H, K, scale * LOG2E, 1,
            q.stride(0), q.stride(1), q.stride(2),
            kv.stride(0), kv.stride(1),
            idx.stride(0), idx.stride(1),
            o.stride(0), o.stride(1), o.stride(2),
            V=v_dim, R=D - v_dim, VP=VP, RP=RP, SPLIT=variant != "pf",
            PREFETCH=0 if variant == "splits" or INTERPRET else 2 if variant == "splits_pf2" else 1, PF_LINES=lines,
            PF_P2=triton.next_power_of_2(lines),
        )  # fmt: skip
        return o, lse

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
