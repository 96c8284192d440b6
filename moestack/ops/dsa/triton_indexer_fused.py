"""Lightning-indexer top-k without a score block: sampled threshold, fused scoring + compaction, exact top-k of
the candidates (the "triton" backend's top-k on a GPU: triton_indexer.indexer_topk_triton routes here).

    I[t, s] = sum_j w[t, j] ReLU(q[t, j] . k[s])     s visible from t (causal, same document)

Per chunk of query rows [t0, t1) (candidate buffers bounded by CHUNK_BYTES):
1. threshold. Rows with at most CAP visible keys take them all (thr = -inf). For the others the scoring kernel
   writes the scores of a strided sample of keys (positions 0, STRIDE, 2 STRIDE, ...; [R, t1 / STRIDE] fp32) and
   thr[t] = the r-th largest visible sample, r = ceil(margin * k * n_samples / n_visible): about margin * k keys
   of the row score >= thr (a quantile estimate from n_visible / STRIDE samples).
2. candidates. The scoring kernel scores every visible (row, key) tile once and appends the keys with
   score >= thr[t] (score and position) to the row's candidate list [R, CAP]: per row a counter bumped by one
   atomic per tile, slots by a prefix sum of the tile's hits. Nothing T x T is written.
3. selection. Exact top-k of the <= CAP candidates of each row: topk_select_kernel (bisection for the k-th largest
   score, then compaction; candidate order) or torch.topk (descending); -1 where fewer than k.
4. exactness. Whenever count(score >= thr) >= k, the row's top-k lies inside its candidates, so the result equals
   the top-k of all visible keys (ties aside). Rows whose count is < min(k, n_visible) (thr too high) or > CAP
   (overflow) are recomputed exactly (all visible keys, torch fp32) - rare with margin 1.5 and CAP = 2k on any
   score distribution that the strided sample represents; correct on every input. One host sync per call
   (the list of such rows).

Cost: the scoring GEMM once (+ 1/STRIDE for the sample), no T x T HBM traffic, a top-k over [T, CAP].
Scoring tile [BLOCK_T rows, BLOCK_S keys], heads looped: each head's q [BLOCK_T, Di] is read per key tile, so the
q traffic per FLOP falls with BLOCK_S (64 x 256 at 8 warps: 1 byte per 256 FLOP). The candidate pass runs the Gluon
kernel (gluon_indexer_select.py) where it applies (sm_90, bf16 / fp16, an even number of heads), this Triton kernel
elsewhere. (An e4m3 scoring mode was removed: README.md.)

Shape legend: B batch, T tokens, R rows of a chunk, Hi indexer heads, Di their dim, K = top_k, CAP candidates.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moestack.ops.dsa import reference as ref
from moestack.ops.dsa.exact_rows import repair_missed_rows
from moestack.ops.dsa.triton_attn_fwd import INTERPRET, gluon_module

CHUNK_BYTES = 1 << 30  # candidate buffers (8 B per slot) + sample scores of one chunk of query rows
MODE_DENSE, MODE_SELECT = 0, 1


def _configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_T": 16, "BLOCK_S": 16}, num_warps=4, num_stages=1)]
    # sm_90 ptxas (benchmarks/tools/dsa_spill_report.py idx): (64, 256) 8 warps spills <= 32 B, the others 150-400 B
    tiles = [(64, 256, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3)]
    return [triton.Config({"BLOCK_T": bt, "BLOCK_S": bs}, num_warps=w, num_stages=s) for bt, bs, w, s in tiles]


def _prune(configs, named_args, **kwargs):
    """The configs that fit the device (moestack/ops/launch.py); the sampled (dense) pass is 1/STRIDE of the work:
    its first fitting config only (one compile, no tuning)."""
    from moestack.ops.launch import fit_configs

    args = {**named_args, **kwargs}
    kept = fit_configs(configs, args, "indexer")
    return kept[:1] if args.get("MODE") == MODE_DENSE else kept


# reset_to_zero CNT: each autotuning run appends from slot 0 again. No restore of OUT_S / OUT_I: every run writes
# the same hit count per row, so the real run overwrites all slots < CNT (the only ones read)
@triton.autotune(configs=_configs(), key=["Hi", "DP", "MODE", "KEY_STRIDE", "CAP"], reset_to_zero=["CNT"],
                 prune_configs_by={"early_config_prune": _prune})  # fmt: skip
@triton.jit(do_not_specialize=["t0", "t1", "Hi", "n_cols"])
def indexer_select_kernel(
    Q, KI, W, DSTART, THR, CNT, OUT_S, OUT_I,
    t0, t1, Hi, n_cols,
    s_qb, s_qt, s_qh, s_kb, s_ks, s_wb, s_wt, s_ob, s_or,
    Di: tl.constexpr, DP: tl.constexpr, KEY_STRIDE: tl.constexpr, MODE: tl.constexpr, CAP: tl.constexpr,
    HAS_DOC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Scores of rows [t0, t1) (this program: BLOCK_T of them) against key columns m (this program: BLOCK_S of
    them) at positions m * KEY_STRIDE, m < n_cols.
    MODE_DENSE: OUT_S[b, t - t0, m] = I[b, t, pos(m)] where visible (the caller pre-fills -inf).
    MODE_SELECT: visible keys with I >= THR[b, t - t0] are appended to row t's lists OUT_S (score) / OUT_I
    (position) [B, R, CAP] at slots from the counter CNT[b, t - t0] (which ends at the row's total hit count)."""
    row0 = t0 + tl.program_id(0) * BLOCK_T
    col0 = tl.program_id(1) * BLOCK_S
    b = tl.program_id(2).to(tl.int64)
    live = col0 * KEY_STRIDE <= row0 + BLOCK_T - 1  # tiles wholly above the diagonal see nothing
    if HAS_DOC:  # ... and tiles wholly before the first row's document
        live = live & ((col0 + BLOCK_S - 1) * KEY_STRIDE >= tl.load(DSTART + row0))
    if not live:
        return
    # scalar int64 bases + small int32 tile offsets: keeps 64-bit pointer tensors out of the live registers
    b_lr = tl.arange(0, BLOCK_T)  # [BT] local rows
    b_rows = row0 + b_lr  # [BT] positions
    b_cols = col0 + tl.arange(0, BLOCK_S)  # [BS] key columns
    b_pos = b_cols * KEY_STRIDE  # [BS] key positions
    offs_d = tl.arange(0, DP)
    mask_d = offs_d < Di
    mask_t = b_rows < t1
    mask_s = (b_cols < n_cols) & (b_pos < t1)
    k_base = KI + b * s_kb + (col0 * KEY_STRIDE).to(tl.int64) * s_ks
    b_k = tl.load(k_base + ((b_pos - col0 * KEY_STRIDE) * s_ks)[:, None] + offs_d[None, :],
                  mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [BS, DP]  # fmt: skip
    b_acc = tl.zeros([BLOCK_T, BLOCK_S], dtype=tl.float32)
    q_base = Q + b * s_qb + row0.to(tl.int64) * s_qt  # scalar, advanced per head
    w_base = W + b * s_wb + row0.to(tl.int64) * s_wt
    o_q = (b_lr * s_qt)[:, None] + offs_d[None, :]  # [BT, DP] int32
    mask_q = mask_t[:, None] & mask_d[None, :]
    b_kt = tl.trans(b_k)
    # head j + 1's q is loaded (registers) before head j's dot: Triton's pipeliner leaves this loop alone (no
    # async copies in the sm_90 TTGIR), so the L2 latency of the next q hides behind the current dot by hand
    b_q_next = tl.load(q_base + o_q, mask=mask_q, other=0.0)  # [BT, DP]
    b_w_next = tl.load(w_base + b_lr * s_wt, mask=mask_t, other=0.0).to(tl.float32)  # [BT]
    for j in range(Hi):
        b_q, b_w = b_q_next, b_w_next
        q_base += s_qh
        w_base += 1
        b_q_next = tl.load(q_base + o_q, mask=mask_q & (j + 1 < Hi), other=0.0)
        b_w_next = tl.load(w_base + b_lr * s_wt, mask=mask_t & (j + 1 < Hi), other=0.0).to(tl.float32)
        b_acc += tl.maximum(tl.dot(b_q, b_kt), 0.0) * b_w[:, None]
    b_vis = (b_pos[None, :] <= b_rows[:, None]) & mask_t[:, None] & mask_s[None, :]
    if HAS_DOC:
        b_vis = b_vis & (b_pos[None, :] >= tl.load(DSTART + b_rows, mask=mask_t, other=0)[:, None])
    o_base = b * s_ob + (row0 - t0).to(tl.int64) * s_or  # row0's row of the [B, R, *] outputs
    if MODE == 0:
        tl.store(OUT_S + o_base + (b_lr * s_or)[:, None] + b_cols[None, :], b_acc, mask=b_vis)
    else:
        r_base = b * (t1 - t0) + (row0 - t0)  # THR, CNT: [B, R] contiguous
        b_thr = tl.load(THR + r_base + b_lr, mask=mask_t, other=0.0)
        b_hit = (b_vis & (b_acc >= b_thr[:, None])).to(tl.int32)  # [BT, BS]
        b_cnt = tl.sum(b_hit, 1)  # [BT]
        b_old = tl.atomic_add(CNT + r_base + b_lr, b_cnt, mask=mask_t & (b_cnt > 0), sem="relaxed")  # [BT]
        b_slot = b_old[:, None] + tl.cumsum(b_hit, 1) - 1  # [BT, BS]
        keep = (b_hit > 0) & (b_slot < CAP)
        off = (b_lr * s_or)[:, None] + b_slot  # int32: s_or = CAP
        tl.store(OUT_S + o_base + off, b_acc, mask=keep)
        tl.store(OUT_I + o_base + off, b_pos[None, :] + tl.zeros([BLOCK_T, BLOCK_S], dtype=tl.int32), mask=keep)


@triton.jit
def _order_key(bits):
    """fp32 bits (int32) -> an int32 key in the floats' order (no NaN): negative floats flip their magnitude bits.
    Its own inverse (key -> fp32 bits)."""
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit(do_not_specialize=["R", "K"])
def topk_select_kernel(
    CS, CI, CNT, OUT, R, K, s_cb, s_cr, s_ob, s_or,
    CAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Exact top-K of one row's candidates CS/CI[b, r, :min(CNT, CAP)] -> OUT[b, r, :K] (positions, in candidate
    order, -1 after the last): the K-th largest score by bisection on order-preserving int32 keys (32 counts over
    the row), then every key above it and the first ties (in slot order) up to K."""
    r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n = tl.minimum(tl.load(CNT + b * R + r), CAP)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    row = b * s_cb + r.to(tl.int64) * s_cr
    b_x = tl.load(CS + row + offs, mask=valid, other=0.0)  # [BLOCK] fp32
    key = _order_key(b_x.to(tl.int32, bitcast=True))
    lo = tl.full([], -2147483648, tl.int64)  # invariant: count(key >= lo) >= K (when n >= K)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in tl.static_range(32):
        mid = lo + (hi - lo + 1) // 2
        c = tl.sum((valid & (key >= mid.to(tl.int32))).to(tl.int32), 0)  # mid is inside the int32 range
        lo = tl.where(c >= K, mid, lo)
        hi = tl.where(c >= K, hi, mid - 1)
    tau = lo.to(tl.int32)  # the K-th largest key
    gt = valid & (key > tau)
    eq = valid & (key == tau)
    need = K - tl.sum(gt.to(tl.int32), 0)
    sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
    sel = tl.where(n <= K, valid, sel)
    slot = tl.cumsum(sel.to(tl.int32), 0) - 1
    n_sel = tl.sum(sel.to(tl.int32), 0)
    o_row = OUT + b * s_ob + r.to(tl.int64) * s_or
    b_i = tl.load(CI + row + offs, mask=sel, other=-1)
    tl.store(o_row + slot, b_i, mask=sel)
    tl.store(o_row + offs, tl.full([BLOCK], -1, tl.int32), mask=(offs >= n_sel) & (offs < K))


@triton.jit(do_not_specialize=["n_cols"])
def kth_largest_kernel(
    S, RK, OUT, n_cols, s_sb, s_sr,
    BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
):  # fmt: skip
    """OUT[b, r] = the RK[r]-th largest of S[b, r, :n_cols] (fp32, -inf counts as a value; 1 <= RK[r] <= n_cols):
    the sampled threshold without sorting the samples. Bisection on order-preserving int32 keys (32 counts over
    the row); a row of <= BLOCK samples stays in registers (ONE_BLOCK), a longer one is re-read per count."""
    r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    R = tl.num_programs(0)
    kth = tl.load(RK + r)
    row = S + b * s_sb + r.to(tl.int64) * s_sr
    offs = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        key = _order_key(tl.load(row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.int32, bitcast=True))
    lo = tl.full([], -2147483648, tl.int64)  # invariant: count(key >= lo) >= kth
    hi = tl.full([], 2147483647, tl.int64)
    for _ in tl.static_range(32):
        mid = lo + (hi - lo + 1) // 2
        if ONE_BLOCK:
            c = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), 0)
        else:
            c = tl.zeros([], tl.int32)
            for c0 in range(0, n_cols, BLOCK):
                x = tl.load(row + c0 + offs, mask=c0 + offs < n_cols, other=float("-inf"))
                key = _order_key(x.to(tl.int32, bitcast=True))
                c += tl.sum(((key >= mid.to(tl.int32)) & (c0 + offs < n_cols)).to(tl.int32), 0)
        lo = tl.where(c >= kth, mid, lo)
        hi = tl.where(c >= kth, hi, mid - 1)
    tau = lo.to(tl.int32)
    tl.store(OUT + b * R + r, _order_key(tau).to(tl.float32, bitcast=True))


def kth_largest(samp: torch.Tensor, kth: torch.Tensor, kernel: bool | None = None, block: int = 8192) -> torch.Tensor:
    """samp [B, R, n] fp32, kth [R] int (1..n) -> [B, R] fp32: the kth[r]-th largest of each row. kernel: run
    kth_largest_kernel (default: on CUDA; off it torch.topk, which also keeps the interpreter's fused-path tests
    fast - tests call the kernel directly); block: samples held per program (a longer row is re-read per count)."""
    B, R, n = samp.shape
    if not (samp.is_cuda if kernel is None else kernel):
        top = samp.topk(int(kth.max()), dim=-1).values
        return top.gather(-1, (kth.long() - 1).expand(B, R)[..., None])[..., 0]
    samp = samp.contiguous()
    out = torch.empty((B, R), device=samp.device, dtype=torch.float32)
    block = min(triton.next_power_of_2(n), block)
    kth_largest_kernel[(R, B)](samp, kth.to(torch.int32).contiguous(), out, n, samp.stride(0), samp.stride(1),
                               BLOCK=block, ONE_BLOCK=n <= block, num_warps=8)  # fmt: skip
    return out


def _launch(q, k, w, dstart, thr, cnt, out_s, out_i, t0, t1, n_cols, key_stride, mode, cap):
    B, _, Hi, Di = q.shape
    DP = max(16, triton.next_power_of_2(Di))

    def grid(meta):
        return (triton.cdiv(t1 - t0, meta["BLOCK_T"]), triton.cdiv(n_cols, meta["BLOCK_S"]), B)

    # unused pointers get their own scratch, never out_s: the autotuner zeroes CNT (reset_to_zero) and restores
    # OUT_I around its benchmark runs, which must not touch the dense pass's -inf-filled output
    f32 = torch.zeros(1, device=q.device, dtype=torch.float32)
    i32 = torch.zeros(1, device=q.device, dtype=torch.int32)
    indexer_select_kernel[grid](
        q, k, w, i32 if dstart is None else dstart,
        f32 if thr is None else thr, i32 if cnt is None else cnt, out_s, i32 if out_i is None else out_i,
        t0, t1, Hi, n_cols,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), w.stride(0), w.stride(1),
        out_s.stride(0), out_s.stride(1),
        Di=Di, DP=DP, KEY_STRIDE=key_stride, MODE=mode, CAP=cap, HAS_DOC=dstart is not None,
    )  # fmt: skip


@torch.no_grad()
def sampling_stride(cap: int) -> int:
    """Every stride-th key scored for the threshold: a row just over `cap` visible keys gets >= 64 samples (at
    top-16 a stride of 16 left 2-4 samples per row and a third of the rows missed their threshold), at most 16."""
    return max(1, min(16, cap // 64))


def indexer_topk_fused(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w: torch.Tensor,
    top_k: int,
    cu_seqlens: torch.Tensor | None = None,
    stride: int | None = None,
    margin: float = 1.5,
    cap: int | None = None,
    select: str = "triton",
    chunk_bytes: int = CHUNK_BYTES,
    stats: dict | None = None,
    scorer: str | None = None,
    fallback_capacity: int | None = None,
) -> torch.Tensor:
    """q_idx [B,T,Hi,Di], k_idx [B,T,Di], w [B,T,Hi] -> idx [B,T,top_k] int32, -1 padded: the selected set of
    reference.indexer_topk_from_inputs. stride: key sampling step of the threshold pass (default sampling_stride:
    16 at K3's top-2048, denser for small top-k, whose rows would see too few samples); margin: expected candidates per
    row / top_k; cap: candidate slots per row (default 2 top_k, >= top_k); select: "triton" (topk_select_kernel, slots
    in candidate order, not sorted by score) or "torch" (torch.topk, descending as the reference). stats (optional dict)
    receives the rows whose threshold missed ("fallback_rows", recomputed exactly) and those of them beyond the exact
    fallback's capacity ("fallback_overflow"), device scalars; fallback_capacity: rows recomputed at most (default
    exact_rows.fallback_capacity). scorer: the candidate pass's kernel, "triton" (indexer_select_kernel), "gluon"
    (gluon_indexer_select: sm_90, bf16 / fp16, even head count; H200: 168 vs 207 ms at T = 131072, the same selection)
    or "auto" / None (gluon where it applies)."""
    if q_idx.dim() != 4 or k_idx.dim() != 3 or w.dim() != 3:
        raise ValueError("q_idx [B,T,Hi,Di], k_idx [B,T,Di], w [B,T,Hi] expected")
    B, T = q_idx.shape[:2]
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens (packed documents) needs batch size 1, got B = {B}")
    cap = cap or 2 * top_k
    stride = stride or sampling_stride(cap)
    if select not in ("triton", "torch"):
        raise ValueError(f"select = '{select}' is not one of triton, torch")
    scorer = scorer or "auto"
    if scorer not in ("auto", "triton", "gluon"):
        raise ValueError(f"scorer = '{scorer}' is not one of auto, triton, gluon")
    if cap < top_k or stride < 1 or margin <= 0:
        raise ValueError(f"need cap >= top_k, stride >= 1, margin > 0; got cap={cap}, stride={stride}, "
                         f"margin={margin}")  # fmt: skip
    dev = q_idx.device
    q, k, wq = q_idx.contiguous(), k_idx.to(q_idx.dtype).contiguous(), w.contiguous()
    gluon_select = None  # the Gluon candidate pass (gluon_indexer_select), where it applies and is asked for
    if scorer in ("auto", "gluon"):
        gluon_select = gluon_module("gluon_indexer_select")
        if gluon_select is not None and not gluon_select.applies(q, k):
            gluon_select = None
        if scorer == "gluon" and gluon_select is None:
            raise ValueError(f"scorer 'gluon' needs an sm_90 GPU, bf16 / fp16 and an even number of heads of 64 / "
                             f"128 / 256 dims (got {q.device} {q.dtype}, q {tuple(q.shape)}); use scorer='auto'")
    pos_T = torch.arange(T, device=dev)
    if cu_seqlens is None:
        dstart = None
        start_T = torch.zeros(T, device=dev, dtype=torch.int64)
    else:
        cu = cu_seqlens.to(dev, torch.int64)
        start_T = cu[ref.document_ids(cu, T)]
        dstart = start_T.to(torch.int32).contiguous()
    n_vis_T = pos_T - start_T + 1
    n_samp_T = pos_T // stride - (start_T + stride - 1) // stride + 1  # sampled positions in [start, t]
    r_bound = math.ceil(margin * top_k / stride + margin / 2) + 1  # >= r of every row with n_vis > cap
    rows = max(1, min(T, chunk_bytes // (B * (8 * cap + 4 * (T // stride + 1)))))
    out, bads = [], []
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        R = t1 - t0
        n_vis = n_vis_T[t0:t1]
        thr = torch.full((B, R), float("-inf"), device=dev, dtype=torch.float32)
        if t1 > cap:  # some row of the chunk may see more than cap keys: sampled threshold
            n_cols = (t1 - 1) // stride + 1
            samp = torch.full((B, R, n_cols), float("-inf"), device=dev, dtype=torch.float32)
            _launch(q, k, wq, dstart, None, None, samp, None, t0, t1, n_cols, stride, MODE_DENSE, cap)
            n_samp = n_samp_T[t0:t1]
            r = torch.ceil(margin * top_k * n_samp.double() / n_vis.double()).long().clamp(1, r_bound)
            r = torch.minimum(r, n_samp.clamp_min(1))
            est = kth_largest(samp, r.clamp_max(n_cols))  # [B, R]
            thr = torch.where((n_vis > cap).expand(B, R), est, thr)
            del samp
        cnt = torch.zeros((B, R), device=dev, dtype=torch.int32)
        if select == "torch":
            cand_s = torch.full((B, R, cap), float("-inf"), device=dev, dtype=torch.float32)
            cand_i = torch.full((B, R, cap), -1, device=dev, dtype=torch.int32)
        else:  # the select kernel reads slots < count only
            cand_s = torch.empty((B, R, cap), device=dev, dtype=torch.float32)
            cand_i = torch.empty((B, R, cap), device=dev, dtype=torch.int32)
        if gluon_select is not None:
            gluon_select.launch_select(q, k, wq, dstart, thr, cnt, cand_s, cand_i, t0, t1, cap)
        else:
            _launch(q, k, wq, dstart, thr, cnt, cand_s, cand_i, t0, t1, t1, 1, MODE_SELECT, cap)
        if select == "torch":
            vals, slot = cand_s.topk(top_k, dim=-1)  # descending
            idx = cand_i.gather(-1, slot).masked_fill(vals == float("-inf"), -1)
            del vals, slot
        else:
            idx = torch.empty((B, R, top_k), device=dev, dtype=torch.int32)
            topk_select_kernel[(R, B)](
                cand_s, cand_i, cnt, idx, R, top_k, cand_s.stride(0), cand_s.stride(1), idx.stride(0), idx.stride(1),
                CAP=cap, BLOCK=triton.next_power_of_2(cap), num_warps=8,
            )  # fmt: skip
        del cand_s, cand_i
        bads.append((cnt > cap) | (cnt < n_vis.clamp_max(top_k).to(torch.int32)))  # threshold missed
        out.append(idx)
    idx, missed, overflow = repair_missed_rows(torch.cat(out, dim=1), torch.cat(bads, dim=1), q_idx, k_idx, w,
                                               start_T, fallback_capacity)  # no host sync (exact_rows.py)
    if stats is not None:
        stats["fallback_rows"], stats["fallback_overflow"] = missed, overflow
    return idx


