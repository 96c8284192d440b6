"""FP8 grouped GEMM (forward / dX) for many rows per expert on sm_90, in Gluon: one persistent launch, no host sync.

    y[rows of e] = sum over 128-slices k of (qx[rows, k] @ qw[e][k, :]) * sx[row, k] * sw[e, k, col // 128]

The same contract and numbers as fp8_tma.grouped_mm (1x128 activation tiles, 128x128 weight blocks, fp32
promotion per slice; bitwise equal outputs, and equal to the per-expert cuBLAS path's), for the shapes where v3
runs torch._scaled_mm once per expert (fp8_scaled_mm.rows_mm, which needs the offsets on the host). v3 takes it with
MOESTACK_FP8_ROWS_GEMM=gluon: the FP8 forward then has no host sync (the weight gradient reads the offsets in
backward from a pinned copy queued in the forward, or with MOESTACK_FP8_TMA_WGRAD=1 runs fp8_tma's kernel).

The blockwise scales. Each 128-deep slice's product must be scaled before it joins the fp32 sum, so the tensor cores
wait while the CUDA cores promote it (fp8_tma.py's Triton kernel waits for every slice). Here:
- Warp specialisation: one producer warp (40 registers; 32 beside three consumers) walks the work items and keeps
  a ring of NS x / w tile pairs full by TMA (ready / empty mbarriers), running ahead across work items, so the
  loads continue through each tile's epilogue.
- Consumer warpgroups of 64 rows each, each a partition of its own (two: 232 registers; three, a 192-row x tile:
  160), meeting only at the ring's barriers (each arrives on a slot's empty barrier), so one's promotion and
  epilogue run under the others' MMAs.
- Slices go in pairs through two fp32 partials (PAIR, the two-warpgroup default): the second MMA is issued before
  the first is waited on, so the first slice's promotion runs under the second's MMA. Nothing is in flight across
  the loop's back-edge (ptxas serialises wgmma otherwise, see gluon_wgrad.py); four slices per iteration spilled
  ~700 bytes. Without PAIR (the only choice at three warpgroups, whose registers hold one partial) each slice is
  waited on and promoted while the other warpgroups' MMAs run. A slot is released (a barrier over the partition's
  warps, then one arrive) as soon as its MMA is done.
- Operands by TMA (host descriptors): x tiles [64, 128] (one per consumer warpgroup) of the row-major qx [N, K];
  weight tiles [BF, 128] of the 2D view [E * F, K] of the cached fp8 weight (memory [E, F, K], K contiguous:
  fp8_weight_cache's layouts), both K-major in shared memory as fp8 wgmma requires. A tile past an expert's last
  row reads the next expert's rows (masked at the store); K past the end is zero-filled by TMA (an odd slice count
  runs one zero slice).
- Row scales in quantize_dual's expert-major layout (each expert's [nk, Mp_e] block contiguous along the rows):
  coalesced loads, and the quantiser's cheaper store pattern (its row-major layout cost 3.2 ms more per K3 EP16
  layer step in the profile).
- Schedule: work items (expert, f-tile, token-tile) in expert order, taken round-robin by one program per SM;
  inside an expert, groups of GT token tiles with the token tiles fastest, so the programs running at once share
  weight tiles and a bounded set of x rows in L2 (GT = 16: +5-10% under Zipf-skewed loads, even when uniform).
- Epilogue: fp32 -> out dtype -> a coalescing layout -> masked plain stores; rows >= offs[-1] get zeros.

H200, K3 EP16 (56 experts x 2340 rows; benchmarks/fp8_grouped.py, benchmarks/RESULTS.md sessions 10-11): 817-941
TFLOP/s on the four forward / dX GEMMs across six runs (0.86-1.03x per-expert cuBLAS's 887-1049 in the same runs); three consumer
warpgroups (192x128 tiles) 881-953, no better overall, nor in the layer. feed_ceiling (the same kernel with the
promotion taken out) reaches 1117-1251: the promotion costs this kernel ~25%, and per-expert cuBLAS runs at ~1120
in the layer's profile, i.e. at this feed's ceiling already. cuBLAS stays v3's default.

BF = 128 (one weight scale per tile and slice). Requirements (`supported`): sm_90, fp8 e4m3 operands laid out as
above, K % 16 == 0. Legend as fp8_tma.py; NS ring slots, GT token tiles per group.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moestack.ops.moe.gluon_quant import supported as supported_device  # sm_90, as the quantiser

BK = 128  # fp8_quant.GROUP: one scale per 128-deep slice
BF = 128
# (consumer warpgroups, slices in pairs, ring slots, token-tile group): first = default, the others for
# benchmarks/fp8_grouped.py --configs all
CONFIGS = ((2, True, 4, 16), (2, True, 6, 16), (3, False, 4, 16), (2, False, 4, 16))
# registers per thread (the worker consumers, the producer warp's warpgroup), by consumer warpgroups; the default
# partition (consumer 0) gets what is left of 64K (Triton's AllocateWarpGroups): 232 of 2 x 4 + 4 warps at 168
# at launch; 168 of 3 x 4 + 4 warps at 128
REGISTERS = {2: (232, 40), 3: (160, 32)}


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _work_item(t, o_e, b_start, b_end, b_tiles, b_work_end, n_ftiles, BT: gl.constexpr, BF_: gl.constexpr,
               GT: gl.constexpr):
    """Work item t -> (expert, its first row of the tile, the expert's end row, first column). Inside an expert
    the items go in groups of GT token tiles (0: all of the expert's), token tiles fastest within a group: the
    programs running at once share weight tiles and a bounded set of x rows in L2."""
    e = gl.sum((b_work_end <= t).to(gl.int32), 0)
    sel = o_e == e
    tiles_e = gl.maximum(gl.sum(gl.where(sel, b_tiles, 0), 0), 1)
    local = t - (gl.sum(gl.where(sel, b_work_end, 0), 0) - tiles_e * n_ftiles)
    if GT == 0:
        i_f = local // tiles_e
        i_t = local % tiles_e
    else:
        first_t = local // (GT * n_ftiles) * GT
        g_size = gl.minimum(tiles_e - first_t, GT)
        within = local % (GT * n_ftiles)
        i_f = within // g_size
        i_t = first_t + within % g_size
    row0 = gl.sum(gl.where(sel, b_start, 0), 0) + i_t * BT
    return e, row0, gl.sum(gl.where(sel, b_end, 0), 0), i_f * BF_


@gluon.jit
def _expert_vectors(offs, E, F, BE: gl.constexpr, BT: gl.constexpr, BF_: gl.constexpr):
    """Per expert (lanes; every warp holds a copy, so the sums stay inside a warp): first row, end row, token
    tiles, cumulative work items; and the total of work items."""
    LE: gl.constexpr = gl.BlockedLayout([BE // 32], [32], [gl.num_warps()], [0])
    o_e = gl.arange(0, BE, layout=LE)
    m_e = o_e < E
    b_end = gl.load(offs + o_e, mask=m_e, other=0)
    b_start = gl.load(offs + o_e - 1, mask=m_e & (o_e > 0), other=0)
    b_tiles = gl.where(m_e, (gl.maximum(b_end - b_start, 0) + BT - 1) // BT, 0)
    n_ftiles = gl.cdiv(F, BF_)
    b_work_end = gl.associative_scan(b_tiles, 0, _add) * n_ftiles
    return o_e, b_start, b_end, b_tiles, b_work_end, gl.sum(b_tiles, 0) * n_ftiles


@gluon.jit
def _scale_blocks(b_start, b_end):
    """Per expert, its row scales in quantize_dual's expert-major layout: (first element / nk, rows rounded up to
    4). Expert e's block is [nk, Mp_e], contiguous along the rows, after nk * (the earlier experts' Mp)."""
    b_mp = (gl.maximum(b_end - b_start, 0) + 3) // 4 * 4
    return gl.associative_scan(b_mp, 0, _add) - b_mp, b_mp


@gluon.jit
def _producer(x_desc, w_desc, x_ring, w_ring, ready, empty, offs, F, E, nk, BE: gl.constexpr, BT: gl.constexpr,
              GT: gl.constexpr, PAIR: gl.constexpr):
    """One warp: walks the same work items as the consumers and keeps the ring full (per slot the x tile as one
    64-row TMA load per consumer warpgroup, and the w tile), running ahead across work items."""
    BF_: gl.constexpr = w_desc.block_type.shape[0]
    BK_: gl.constexpr = x_desc.block_type.shape[1]
    NS: gl.constexpr = w_ring.shape[0]
    NC: gl.constexpr = BT // 64
    o_e, b_start, b_end, b_tiles, b_work_end, total = _expert_vectors(offs, E, F, BE, BT, BF_)
    n_ftiles = gl.cdiv(F, BF_)
    steps = nk
    if PAIR:
        steps = gl.cdiv(nk, 2) * 2  # slices per item, rounded up to the consumer's pairs (zero-filled past K)
    c = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, row0, _, f0 = _work_item(t, o_e, b_start, b_end, b_tiles, b_work_end, n_ftiles, BT, BF_, GT)
        wrow0 = e * F + f0
        for k in range(steps):
            s = c % NS
            mbarrier.wait(empty.index(s), ((c // NS) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, NC * x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            for j in gl.static_range(NC):
                tma.async_copy_global_to_shared(x_desc, [row0 + j * 64, k * BK_], bar, x_ring.index(s * NC + j))
            tma.async_copy_global_to_shared(w_desc, [wrow0, k * BK_], bar, w_ring.index(s))
            c += 1


@gluon.jit
def _slice_scale(p_sx, mp, p_sw, m_rows, k, nk, stride_swk):
    """sx[rows, k] * sw[e, k, f-block] (0 past the last slice, whose tiles TMA zero-filled)."""
    return gl.load(p_sx + k * mp, mask=m_rows & (k < nk), other=0.0) * gl.load(p_sw + k * stride_swk, mask=k < nk,
                                                                                other=0.0)


@gluon.jit
def _mma_slice(x_ring, w_ring, ready, c, zero, WG: gl.constexpr):
    """Wait for ring slot c's tiles, issue the MMA of warpgroup WG's 64 rows of the x tile async."""
    NS: gl.constexpr = w_ring.shape[0]
    NC: gl.constexpr = x_ring.shape[0] // NS
    s = c % NS
    mbarrier.wait(ready.index(s), (c // NS) & 1)
    return warpgroup_mma(x_ring.index(s * NC + WG), w_ring.index(s).permute((1, 0)), zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _consumer(x_ring, w_ring, ready, empty, sx, sw, y, offs, F, E, nk, stride_swe, stride_swk,
              stride_yn, BE: gl.constexpr, BT: gl.constexpr, BF_: gl.constexpr, GT: gl.constexpr,
              PAIR: gl.constexpr, PROMOTE: gl.constexpr, WG: gl.constexpr):  # fmt: skip
    """Rows WG * 64 : + 64 of every tile (one warpgroup). PAIR: slices in pairs through two partial accumulators,
    so the first one's promotion runs under the second one's MMA; else one partial, each slice waited on and
    promoted while the other warpgroups' MMAs run. Then the epilogue."""
    NW: gl.constexpr = gl.num_warps()
    BTW: gl.constexpr = 16 * NW  # this partition's rows of a tile
    NS: gl.constexpr = w_ring.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                         instr_shape=[16, BF_, 32])  # fmt: skip
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BF_ // 8), BF_ // 8], [NW, 1], [1, 0])
    o_e, b_start, b_end, b_tiles, b_work_end, total = _expert_vectors(offs, E, F, BE, BT, BF_)
    b_base, b_mp = _scale_blocks(b_start, b_end)
    n_ftiles = gl.cdiv(F, BF_)
    zero = gl.zeros([BTW, BF_], gl.float32, layout=acc_layout)
    o_r = gl.arange(0, BTW, layout=gl.SliceLayout(1, acc_layout)) + WG * BTW
    st_r = gl.arange(0, BTW, layout=gl.SliceLayout(1, st_layout)) + WG * BTW
    st_c = gl.arange(0, BF_, layout=gl.SliceLayout(0, st_layout))
    c = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, row0, row_end, f0 = _work_item(t, o_e, b_start, b_end, b_tiles, b_work_end, n_ftiles, BT, BF_, GT)
        rows = row0 + o_r
        sel = o_e == e
        mp = gl.sum(gl.where(sel, b_mp, 0), 0)
        first = gl.sum(gl.where(sel, b_base, 0), 0).to(gl.int64) * nk - gl.sum(gl.where(sel, b_start, 0), 0)
        p_sx = sx + first + rows  # coalesced: a block's rows are contiguous
        m_rows = rows < row_end
        p_sw = sw + e.to(gl.int64) * stride_swe + f0 // BF_
        acc = zero
        if PAIR:
            for j in range(gl.cdiv(nk, 2)):
                pa = _mma_slice(x_ring, w_ring, ready, c, zero, WG)
                pb = _mma_slice(x_ring, w_ring, ready, c + 1, zero, WG)
                b_s = _slice_scale(p_sx, mp, p_sw, m_rows, 2 * j, nk, stride_swk)
                pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa, ))
                gl.thread_barrier()  # this partition's warps are done reading the slot
                mbarrier.arrive(empty.index(c % NS), count=1)
                acc = acc + pa * b_s[:, None]  # under the second slice's MMA
                b_s = _slice_scale(p_sx, mp, p_sw, m_rows, 2 * j + 1, nk, stride_swk)
                pb = warpgroup_mma_wait(num_outstanding=0, deps=(pb, ))
                gl.thread_barrier()
                mbarrier.arrive(empty.index((c + 1) % NS), count=1)
                acc = acc + pb * b_s[:, None]
                c += 2
        elif not PROMOTE:  # feed_ceiling: the MMAs accumulate on the tensor cores, unscaled (not a product)
            for k in range(nk):
                s = c % NS
                mbarrier.wait(ready.index(s), (c // NS) & 1)
                acc = warpgroup_mma(x_ring.index(s * (BT // 64) + WG), w_ring.index(s).permute((1, 0)), acc,
                                    use_acc=True, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                gl.thread_barrier()
                mbarrier.arrive(empty.index(s), count=1)
                c += 1
        else:
            for k in range(nk):
                pa = _mma_slice(x_ring, w_ring, ready, c, zero, WG)
                b_s = _slice_scale(p_sx, mp, p_sw, m_rows, k, nk, stride_swk)
                pa = warpgroup_mma_wait(num_outstanding=0, deps=(pa, ))
                gl.thread_barrier()
                mbarrier.arrive(empty.index(c % NS), count=1)
                acc = acc + pa * b_s[:, None]  # under the other warpgroups' MMAs
                c += 1
        out = gl.convert_layout(acc.to(y.dtype.element_ty), st_layout)
        r = row0 + st_r
        cols = f0 + st_c
        p_y = y + r.to(gl.int64)[:, None] * stride_yn + cols[None, :]
        gl.store(p_y, out, mask=(r < row_end)[:, None] & (cols < F)[None, :])


@gluon.jit
def fp8_gg_gluon_kernel(x_desc, w_desc, sx, sw, y, offs, N, K, F, E, nk, stride_swe, stride_swk,
                        stride_yn, BE: gl.constexpr, BT: gl.constexpr, NS: gl.constexpr, GT: gl.constexpr,
                        PAIR: gl.constexpr, REGS: gl.constexpr, PREGS: gl.constexpr,
                        PROMOTE: gl.constexpr):  # fmt: skip
    """See the module doc; a persistent grid. One consumer partition per 64-row warpgroup of the x tile (2 or 3,
    num_warps = 4 each), one producer warp; REGS: the consumers' registers."""
    NW: gl.constexpr = gl.num_warps()
    BF_: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(NW == 4 and x_desc.block_type.shape[0] == 64, "a partition per 64-row warpgroup")
    gl.static_assert(BT == 128 or BT == 192, "two or three consumer warpgroups")
    gl.static_assert(PROMOTE or not PAIR, "feed_ceiling runs the single-partial loop")
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [NS * (BT // 64)] + x_desc.block_type.shape, x_desc.layout)
    w_ring = gl.allocate_shared_memory(w_desc.dtype, [NS] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=BT // 64)  # one arrive per consumer partition
    fence_async_shared()
    if BT == 128:
        gl.warp_specialize([
            (_consumer, (x_ring, w_ring, ready, empty, sx, sw, y, offs, F, E, nk, stride_swe, stride_swk,
                         stride_yn, BE, BT, BF_, GT, PAIR, PROMOTE, 0)),
            (_consumer, (x_ring, w_ring, ready, empty, sx, sw, y, offs, F, E, nk, stride_swe, stride_swk,
                         stride_yn, BE, BT, BF_, GT, PAIR, PROMOTE, 1)),
            (_producer, (x_desc, w_desc, x_ring, w_ring, ready, empty, offs, F, E, nk, BE, BT, GT, PAIR)),
        ], [4, 1], [REGS, PREGS])
    else:
        gl.warp_specialize([
            (_consumer, (x_ring, w_ring, ready, empty, sx, sw, y, offs, F, E, nk, stride_swe, stride_swk,
                         stride_yn, BE, BT, BF_, GT, PAIR, PROMOTE, 0)),
            (_consumer, (x_ring, w_ring, ready, empty, sx, sw, y, offs, F, E, nk, stride_swe, stride_swk,
                         stride_yn, BE, BT, BF_, GT, PAIR, PROMOTE, 1)),
            (_consumer, (x_ring, w_ring, ready, empty, sx, sw, y, offs, F, E, nk, stride_swe, stride_swk,
                         stride_yn, BE, BT, BF_, GT, PAIR, PROMOTE, 2)),
            (_producer, (x_desc, w_desc, x_ring, w_ring, ready, empty, offs, F, E, nk, BE, BT, GT, PAIR)),
        ], [4, 4, 1], [REGS, REGS, PREGS])
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BF_ // 8), BF_ // 8], [NW, 1], [1, 0])
    st_r = gl.arange(0, 64, layout=gl.SliceLayout(1, st_layout))
    st_c = gl.arange(0, BF_, layout=gl.SliceLayout(0, st_layout))
    n_ftiles = gl.cdiv(F, BF_)
    used = gl.load(offs + E - 1)
    for t2 in range(gl.program_id(0), gl.cdiv(N - used, 64) * n_ftiles, gl.num_programs(0)):  # rows past the end
        r = used + (t2 // n_ftiles) * 64 + st_r
        cols = (t2 % n_ftiles) * BF_ + st_c
        p_y = y + r.to(gl.int64)[:, None] * stride_yn + cols[None, :]
        gl.store(p_y, gl.zeros([64, BF_], y.dtype.element_ty, layout=st_layout),
                 mask=(r < N)[:, None] & (cols < F)[None, :])


def supported(qx: torch.Tensor, qw: torch.Tensor) -> bool:
    """qx [N, K] row-major fp8, qw [E, K, F] with memory [E, F, K], 16-byte aligned, on an sm_90 GPU."""
    K, F = qx.shape[1], qw.shape[2]
    return (qx.is_cuda and qx.dtype == torch.float8_e4m3fn and qw.dtype == qx.dtype
            and supported_device(qx.device.index if qx.device.index is not None else torch.cuda.current_device())
            and qx.stride(1) == 1 and qx.stride(0) % 16 == 0 and qx.data_ptr() % 16 == 0
            and qw.stride(1) == 1 and qw.stride(2) == K and qw.stride(0) == F * K and K % 16 == 0
            and qw.data_ptr() % 16 == 0)  # fmt: skip


@functools.cache
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def grouped_mm(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, offs_E: torch.Tensor,
               out_dtype: torch.dtype, config: tuple[int, bool, int, int] | None = None,
               _promote: bool = True) -> torch.Tensor:
    """y [N, F] (out_dtype) from qx [N, K] with its row scales sx in quantize_dual's expert-major layout (flat;
    quantize_dual(..., expert_major=True)) and qw [E, K, F] (memory [E, F, K]) with block scales sw [E, K/128,
    F/128] contiguous; rows >= offs[-1] zero. Requires supported(qx, qw). config: as CONFIGS, default CONFIGS[0]."""
    N, K = qx.shape
    E, _, F = qw.shape
    assert sx.dim() == 1 and sw.is_contiguous()
    y = torch.empty((N, F), device=qx.device, dtype=out_dtype)
    if N == 0 or F == 0:
        return y
    n_consumers, pair, ns, group_t = config or CONFIGS[0]
    nk = triton.cdiv(K, BK)
    bt = 64 * n_consumers  # a consumer warpgroup per 64 rows of the x tile
    x_layout = gl.NVMMASharedLayout.get_default_for([64, BK], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([BF, BK], gl.float8e4nv)
    x_desc = TensorDescriptor(qx, [N, K], [qx.stride(0), 1], [64, BK], x_layout)
    w2 = torch.as_strided(qw, (E * F, K), (K, 1))
    w_desc = TensorDescriptor(w2, [E * F, K], [K, 1], [BF, BK], w_layout)
    work = (triton.cdiv(N, bt) + E) * triton.cdiv(F, BF)  # bound on the work items without reading offs
    dev = qx.device.index if qx.device.index is not None else torch.cuda.current_device()
    grid = (max(1, min(work, _sms(dev))),)  # one program per SM (the ring and epilogue scratch: 147-213 KB)
    fp8_gg_gluon_kernel[grid](
        x_desc, w_desc, sx, sw, y, offs_E, N, K, F, E, nk, sw.stride(0), sw.stride(1), y.stride(0),
        BE=max(32, triton.next_power_of_2(E)), BT=bt, NS=ns, GT=group_t, PAIR=pair and _promote,
        REGS=REGISTERS[n_consumers][0], PREGS=REGISTERS[n_consumers][1], PROMOTE=_promote, num_warps=4,
    )
    return y


def feed_ceiling(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, offs_E: torch.Tensor,
                 out_dtype: torch.dtype, config: tuple[int, bool, int, int] | None = None) -> torch.Tensor:
    """A benchmark instrument, not a product: grouped_mm's schedule, loads and epilogue with the per-slice promotion
    taken out (each tile's slices accumulate unscaled on the tensor cores, one partial). Its time is the ceiling of
    this kernel's feed (TMA, L2, shared memory, wgmma issue) at a config's tile; benchmarks/fp8_grouped.py."""
    return grouped_mm(qx, sx, qw, sw, offs_E, out_dtype, config, _promote=False)
