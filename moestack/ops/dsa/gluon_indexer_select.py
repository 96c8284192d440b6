"""The candidate pass of the fused lightning-indexer top-k (triton_indexer_fused, MODE_SELECT) for sm_90 in Gluon.

    I[t, s] = sum_j w[t, j] ReLU(q[t, j] . k[s]);  keys with I >= THR[t] are appended to row t's candidate list

In the Triton kernel every head is a synchronous dot followed by its epilogue (max, multiply, add over the whole
[BLOCK_T, BLOCK_S] tile), and at long T that scoring is most of the indexer's time. Here the q tiles of the next heads
stream into a ring of shared-memory stages by cp.async while the key tile stays resident. Heads go in steps of GROUP
(default 4) behind one CTA barrier: two products in flight, head h's epilogue runs under head h + 1's product, head h
+ 2's product is issued once h's registers are free, and nothing is in flight across the loop's back-edge. Two details
make the overlap real: the accumulator passes through every wgmma wait (otherwise LLVM sinks the epilogues below the
later waits), and no product crosses the back-edge (otherwise ptxas serialises all wgmmas, C7514). Fewer barriers per
head because the CTA barrier held the largest share of stall cycles (README.md, "Measured"). The epilogue after the
last head (threshold, per-row counter, slots, stores) is the Triton kernel's, with the hit matrix moved to a layout
whose rows live in one warp for the prefix sum.

Scope: bf16 / fp16 q and k, indexer head dim Di = 128 (64 .. 256, power of two), an even number of heads, key
stride 1 (the candidate pass; the sampled threshold pass stays in Triton), sm_90; a head count that is not a
multiple of GROUP runs in pairs. Same arguments and outputs as indexer_select_kernel's MODE_SELECT; packed
documents (DSTART) supported.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

# callers reach this module through triton_attn_fwd.gluon_module, which checks the Triton version
BLOCK_T = 64  # one wgmma M tile over 4 warps; the two warpgroups split the key columns
# (BLOCK_S, Q_STAGES, GROUP: heads per barrier step, even)
CONFIGS = ((256, 8, 4), (256, 4, 2), (256, 6, 2), (256, 8, 2))
DEFAULT_CONFIG = (256, 8, 4)


def smem_bytes(bs: int, stages: int, Di: int, elt: int = 2) -> int:
    """Shared memory of one program: the key tile [BLOCK_S, Di] and the q ring Q_STAGES x [BLOCK_T, Di]."""
    return (bs + stages * BLOCK_T) * Di * elt


@gluon.jit
def _issue_q(q_buf, q_base, head, s_qh, rows_ok, o_q):
    """cp.async of head `head`'s q rows [BLOCK_T, Di] into q_buf (rows past t1 zero-filled)."""
    # head * s_qh is int32: < 2^31 for any indexer (heads x head dim)
    async_copy.async_copy_global_to_shared(q_buf, q_base + head * s_qh + o_q, mask=rows_ok[:, None])


@gluon.jit
def _indexer_select_gluon_kernel(
    Q, KI, W, DSTART, THR, CNT, OUT_S, OUT_I,
    t0, t1, Hi,
    s_qb, s_qt, s_qh, s_kb, s_ks, s_wb, s_wt, s_ob, s_or,
    Di: gl.constexpr, CAP: gl.constexpr, HAS_DOC: gl.constexpr,
    BLOCK_T: gl.constexpr, BLOCK_S: gl.constexpr, Q_STAGES: gl.constexpr, GROUP: gl.constexpr,
):  # fmt: skip
    gl.static_assert(gl.num_warps() == 8, "two warpgroups: launch with num_warps=8")
    gl.static_assert(GROUP % 2 == 0 and Q_STAGES % GROUP == 0 and Q_STAGES // GROUP >= 2,
                     "an even head count per step (GROUP) and a ring of >= 2 whole groups (Q_STAGES)")
    dtype: gl.constexpr = Q.dtype.element_ty
    row0 = t0 + gl.program_id(0) * BLOCK_T
    col0 = gl.program_id(1) * BLOCK_S
    b = gl.program_id(2).to(gl.int64)
    live = col0 <= row0 + BLOCK_T - 1  # tiles wholly above the diagonal see nothing
    if HAS_DOC:  # ... and tiles wholly before the first row's document
        live = live & (col0 + BLOCK_S - 1 >= gl.load(DSTART + row0))
    if not live:
        return

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_S // 2, 16])  # fmt: skip
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])  # 16-byte vectors along a row
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_T, Di], dtype)
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_S, Di], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_S, Di], k_sl)
    q_ring = gl.allocate_shared_memory(dtype, [Q_STAGES, BLOCK_T, Di], q_sl)

    # the key tile (resident for all heads) and the first q tiles
    offs_d = gl.arange(0, Di, layout=gl.SliceLayout(0, ld))
    kc = col0 + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, ld))
    k_ptrs = KI + b * s_kb + kc.to(gl.int64)[:, None] * s_ks + offs_d[None, :]
    async_copy.async_copy_global_to_shared(k_smem, k_ptrs, mask=(kc < t1)[:, None])
    lr = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, ld))
    rows_ok = row0 + lr < t1
    q_base = Q + b * s_qb + row0.to(gl.int64) * s_qt
    o_q = (lr * s_qt)[:, None] + offs_d[None, :]
    for i in gl.static_range(Q_STAGES // GROUP - 1):
        if GROUP * i < Hi:
            for h in gl.static_range(GROUP):
                _issue_q(q_ring.index(GROUP * i + h), q_base, GROUP * i + h, s_qh, rows_ok, o_q)
        async_copy.commit_group()  # group i: q of heads GROUP i .. GROUP i + GROUP - 1 (group 0 also the keys)

    b_lr = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, s_layout))
    b_rows = row0 + b_lr
    mask_t = b_rows < t1
    w_ptrs = W + b * s_wb + b_rows.to(gl.int64) * s_wt
    acc = gl.zeros([BLOCK_T, BLOCK_S], gl.float32, layout=s_layout)
    zero = gl.zeros([BLOCK_T, BLOCK_S], gl.float32, layout=s_layout)

    acc = _grouped_heads(q_ring, k_smem, acc, zero, w_ptrs, mask_t, q_base, Hi, s_qh, rows_ok, o_q, Q_STAGES, GROUP)
    async_copy.wait_group(0)

    _append_candidates(acc, row0, col0, b, t0, t1, DSTART, THR, CNT, OUT_S, OUT_I, s_ob, s_or, CAP, HAS_DOC,
                       BLOCK_T, BLOCK_S)


@gluon.jit
def _grouped_heads(q_ring, k_smem, acc, zero, w_ptrs, mask_t, q_base, Hi, s_qh, rows_ok, o_q,
                   Q_STAGES: gl.constexpr, GROUP: gl.constexpr):  # fmt: skip
    """acc += sum_j w_j ReLU(q_j k^T), GROUP heads per step: two products in flight, head h's epilogue runs while
    head h + 1's product does, head h + 2's product is issued after it; nothing is in flight across the loop's
    back-edge (else ptxas serialises the wgmmas). One barrier per GROUP heads; the ring holds
    Q_STAGES // GROUP groups, the next ones loading."""
    NG: gl.constexpr = Q_STAGES // GROUP
    for j in range(0, Hi, GROUP):
        # group j / GROUP landed (the NG - 2 newer ones may still load) and every warp is past the previous group,
        # whose stages the copy of the group NG - 1 ahead then overwrites
        async_copy.wait_group(NG - 2)
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async proxy
        gl.thread_barrier()
        nxt = j + GROUP * (NG - 1)
        if nxt < Hi:
            st_n = (nxt // GROUP) % NG
            for h in gl.static_range(GROUP):
                _issue_q(q_ring.index(GROUP * st_n + h), q_base, nxt + h, s_qh, rows_ok, o_q)
        async_copy.commit_group()
        st = GROUP * ((j // GROUP) % NG)
        s_a = warpgroup_mma(q_ring.index(st), k_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        s_b = warpgroup_mma(q_ring.index(st + 1), k_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        for h in gl.static_range(GROUP):
            w_h = gl.load(w_ptrs + (j + h), mask=mask_t, other=0.0).to(gl.float32)
            # acc passes through each wait: otherwise LLVM sinks the epilogues below the later waits (no overlap)
            if h % 2 == 0:
                s_a, acc = warpgroup_mma_wait(num_outstanding=1 if h + 1 < GROUP else 0, deps=(s_a, acc))
                acc += gl.maximum(s_a, 0.0) * w_h[:, None]
                if h + 2 < GROUP:
                    s_a = warpgroup_mma(q_ring.index(st + h + 2), k_smem.permute((1, 0)), zero, use_acc=False,
                                        is_async=True)  # fmt: skip
            else:
                s_b, acc = warpgroup_mma_wait(num_outstanding=1 if h + 1 < GROUP else 0, deps=(s_b, acc))
                acc += gl.maximum(s_b, 0.0) * w_h[:, None]
                if h + 2 < GROUP:
                    s_b = warpgroup_mma(q_ring.index(st + h + 2), k_smem.permute((1, 0)), zero, use_acc=False,
                                        is_async=True)  # fmt: skip
    return acc


@gluon.jit
def _append_candidates(acc, row0, col0, b, t0, t1, DSTART, THR, CNT, OUT_S, OUT_I, s_ob, s_or,
                       CAP: gl.constexpr, HAS_DOC: gl.constexpr, BLOCK_T: gl.constexpr,
                       BLOCK_S: gl.constexpr):  # fmt: skip
    """The Triton kernel's MODE_SELECT epilogue: visible keys with I >= THR appended to their row's list, rows
    within one warp for the prefix sum."""
    rows_in_warp: gl.constexpr = gl.BlockedLayout([1, BLOCK_S // 32], [1, 32], [8, 1], [1, 0])
    acc = gl.convert_layout(acc, rows_in_warp)
    e_lr = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, rows_in_warp))
    e_rows = row0 + e_lr
    e_mask_t = e_rows < t1
    e_pos = col0 + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(0, rows_in_warp))
    vis = (e_pos[None, :] <= e_rows[:, None]) & e_mask_t[:, None] & (e_pos < t1)[None, :]
    if HAS_DOC:
        vis = vis & (e_pos[None, :] >= gl.load(DSTART + e_rows, mask=e_mask_t, other=0)[:, None])
    r_base = b * (t1 - t0) + (row0 - t0)  # THR, CNT: [B, R] contiguous
    thr = gl.load(THR + r_base + e_lr, mask=e_mask_t, other=0.0)
    hit = (vis & (acc >= thr[:, None])).to(gl.int32)
    cnt = gl.sum(hit, axis=1)
    old = gl.atomic_add(CNT + r_base + e_lr, cnt, mask=e_mask_t & (cnt > 0), sem="relaxed")
    slot = old[:, None] + gl.associative_scan(hit, 1, _add) - 1
    keep = (hit > 0) & (slot < CAP)
    o_base = b * s_ob + (row0 - t0).to(gl.int64) * s_or
    off = (e_lr * s_or)[:, None] + slot
    gl.store(OUT_S + o_base + off, acc, mask=keep)
    gl.store(OUT_I + o_base + off, e_pos[None, :] + gl.zeros([BLOCK_T, BLOCK_S], gl.int32, layout=rows_in_warp),
             mask=keep)  # fmt: skip


@gluon.jit
def _add(a, b):
    return a + b


def applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """sm_90, bf16 / fp16 scoring, head dim a power of two in 64..256, an even head count (the heads go at least in
    pairs)."""
    Hi, Di = q.shape[-2:]
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and k.dtype == q.dtype and Di in (64, 128, 256) and Hi % 2 == 0
            and torch.cuda.get_device_capability(q.device)[0] == 9)  # fmt: skip


def launch_select(q, k, w, dstart, thr, cnt, out_s, out_i, t0: int, t1: int, cap: int,
                  config: tuple[int, int, int] | None = None) -> None:  # fmt: skip
    """indexer_select_kernel's MODE_SELECT (key stride 1) with this kernel; same tensors (triton_indexer_fused)."""
    B, _, Hi, Di = q.shape
    bs, stages, group = config or DEFAULT_CONFIG
    if Hi % group:  # a head count that is not a multiple of the group: pairs (applies() asked for an even one)
        stages, group = 4, 2
    from moestack.ops.launch import fits

    if not fits(smem_bytes(bs, stages, Di, q.element_size()), q.device, warps=8):
        bs, stages, group = 128, 4, 2  # Di = 256 on sm_90: a smaller key tile and ring (128 KB: fits every sm_90)
    i32 = torch.zeros(1, device=q.device, dtype=torch.int32)
    grid = (triton.cdiv(t1 - t0, BLOCK_T), triton.cdiv(t1, bs), B)
    _indexer_select_gluon_kernel[grid](
        q, k, w, i32 if dstart is None else dstart, thr, cnt, out_s, out_i,
        t0, t1, Hi,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), w.stride(0), w.stride(1),
        out_s.stride(0), out_s.stride(1),
        Di=Di, CAP=cap, HAS_DOC=dstart is not None, BLOCK_T=BLOCK_T, BLOCK_S=bs, Q_STAGES=stages, GROUP=group,
        num_warps=8,
    )  # fmt: skip
