"""FP8 grouped weight gradient on sm_90, in Gluon: one persistent launch over every expert, no host sync.

    out[e, a, b] = sum over e's 128-token tiles g of (P[a, g-tile] @ Q[b, g-tile]^T) * sP[g, a] * sQ[g, b]

The contract and numbers of fp8_tma.wgrad (bitwise equal outputs): the token-tile operands of
fp8_quant.quantize_dual (qT [width, P], tokens contiguous, scales [G, width]), both weight layouts, zeros for empty
experts. v3 ran it as one torch._scaled_mm per expert (fp8_scaled_mm.wgrad), which needs the offsets on the host;
with MOESTACK_FP8_ROWS_GEMM=gluon the whole FP8 expert GEMM (forward, dX, dW) runs without host syncs.

The design of gluon_fp8_gemm.py, with the reduction over each expert's token tiles:
- One producer warp feeds a ring of (P, Q) tile pairs by TMA; it runs ahead across work items. The reduction depth
  varies per expert; a depth rounded up to the consumer's two slices reads a tile column past the end of qT, which
  TMA fills with zeros (the columns after an expert's tiles hold other experts' tokens or never-written memory).
- Eight consumer warps: slices through two fp32 partials in turn, the first one's promotion under the second's
  MMA. The promotion scales both ways, (part * sP[:, None]) * sQ[None, :], in fp8_tma.wgrad's order.
- Work items (expert, a-tile, b-tile), b fastest: the programs running at once share an a-tile of P and sweep Q;
  one expert's P and Q (K3 EP16 gate-up: 3584 + 6144 columns x ~2.4k tokens, 24 MB) stay in L2.
- Epilogue: fp32 -> out dtype -> coalescing layout -> plain stores (A and B are multiples of 128 where it is used).

Requirements (`supported`): sm_90, fp8 e4m3 token tiles of widths that are multiples of 128, out with a contiguous
last dim. Legend as fp8_tma.py; BA / BB the output tile.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moestack.ops.moe.gluon_fp8_gemm import MAXNREG, _mma_slice, _sms, supported_device
from moestack.ops.moe.triton_grouped_gemm import empty_grad_like

TILE = 128  # BA = BB = the token tile (fp8_quant.GROUP)
NS = gl.constexpr(4)  # ring slots (tile pairs of 32 KB)
SPLIT = True  # default: one consumer partition per warpgroup


@gluon.jit
def _expert_tiles(offs, E, e, BE: gl.constexpr):
    """Expert e's first token tile and its number of tiles (quantize_dual's numbering: experts in order)."""
    LE: gl.constexpr = gl.BlockedLayout([BE // 32], [32], [gl.num_warps()], [0])
    o_e = gl.arange(0, BE, layout=LE)
    m_e = o_e < E
    b_end = gl.load(offs + o_e, mask=m_e, other=0)
    b_start = gl.load(offs + o_e - 1, mask=m_e & (o_e > 0), other=0)
    b_tiles = gl.where(m_e, (gl.maximum(b_end - b_start, 0) + 127) // 128, 0)
    return gl.sum(gl.where(o_e < e, b_tiles, 0), 0), gl.sum(gl.where(o_e == e, b_tiles, 0), 0)


@gluon.jit
def _wgrad_producer(p_desc, q_desc, p_ring, q_ring, ready, empty, sp, sq, out, offs, A, B, E, Ptok, stride_oe,
                    stride_oa, BE: gl.constexpr, BA: gl.constexpr, BB: gl.constexpr):  # fmt: skip
    G: gl.constexpr = p_desc.block_type.shape[1]
    NS_: gl.constexpr = p_ring.shape[0]
    n_a = A // BA
    n_b = B // BB
    c = 0
    for t in range(gl.program_id(0), E * n_a * n_b, gl.num_programs(0)):
        e = t // (n_a * n_b)
        local = t % (n_a * n_b)
        a0 = (local // n_b) * BA
        b0 = (local % n_b) * BB
        g0, n = _expert_tiles(offs, E, e, BE)
        for k in range(gl.cdiv(n, 2) * 2):
            s = c % NS_
            mbarrier.wait(empty.index(s), ((c // NS_) & 1) ^ 1)
            col = gl.where(k < n, (g0 + k) * G, Ptok)  # past the expert's tiles: a zero-filled box
            bar = ready.index(s)
            mbarrier.expect(bar, p_desc.block_type.nbytes + q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(p_desc, [a0, col], bar, p_ring.index(s))
            tma.async_copy_global_to_shared(q_desc, [b0, col], bar, q_ring.index(s))
            c += 1


@gluon.jit
def _wgrad_consumer(p_ring, q_ring, ready, empty, sp, sq, out, offs, A, B, E, stride_oe, stride_oa,
                    BE: gl.constexpr, BA: gl.constexpr, BB: gl.constexpr, WG: gl.constexpr):  # fmt: skip
    """Rows WG * 16 * warps : + 16 * warps of every output tile (all BA rows with BA / 16 warps)."""
    NW: gl.constexpr = gl.num_warps()
    BAW: gl.constexpr = 16 * NW
    NS_: gl.constexpr = p_ring.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                         instr_shape=[16, BB, 32])  # fmt: skip
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BB // 8), BB // 8], [NW, 1], [1, 0])
    n_a = A // BA
    n_b = B // BB
    zero = gl.zeros([BAW, BB], gl.float32, layout=acc_layout)
    o_a = gl.arange(0, BAW, layout=gl.SliceLayout(1, acc_layout)) + WG * BAW
    o_b = gl.arange(0, BB, layout=gl.SliceLayout(0, acc_layout))
    st_a = gl.arange(0, BAW, layout=gl.SliceLayout(1, st_layout)) + WG * BAW
    st_b = gl.arange(0, BB, layout=gl.SliceLayout(0, st_layout))
    c = 0
    for t in range(gl.program_id(0), E * n_a * n_b, gl.num_programs(0)):
        e = t // (n_a * n_b)
        local = t % (n_a * n_b)
        a0 = (local // n_b) * BA
        b0 = (local % n_b) * BB
        g0, n = _expert_tiles(offs, E, e, BE)
        p_sp = sp + a0 + o_a
        p_sq = sq + b0 + o_b
        acc = zero
        for j in range(gl.cdiv(n, 2)):
            pa = _mma_slice(p_ring, q_ring, ready, c, zero, WG * BAW)
            pb = _mma_slice(p_ring, q_ring, ready, c + 1, zero, WG * BAW)
            for u in gl.static_range(2):
                k = 2 * j + u
                g = (g0 + k).to(gl.int64)
                b_sp = gl.load(p_sp + g * A, mask=(k < n) & (o_a < A), other=0.0)
                b_sq = gl.load(p_sq + g * B, mask=(k < n) & (o_b < BB), other=0.0)
                if u == 0:
                    pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa, ))
                else:
                    pb = warpgroup_mma_wait(num_outstanding=0, deps=(pb, ))
                gl.thread_barrier()  # this partition's warpgroups are done reading this slot
                mbarrier.arrive(empty.index((c + u) % NS_), count=1)
                if u == 0:
                    acc = acc + (pa * b_sp[:, None]) * b_sq[None, :]  # under the second slice's MMA
                else:
                    acc = acc + (pb * b_sp[:, None]) * b_sq[None, :]
            c += 2
        res = gl.convert_layout(acc.to(out.dtype.element_ty), st_layout)
        p_o = out + e.to(gl.int64) * stride_oe + (a0 + st_a).to(gl.int64)[:, None] * stride_oa + (b0 + st_b)[None, :]
        gl.store(p_o, res)


@gluon.jit
def _wgrad_worker_consumer(p_desc, q_desc, p_ring, q_ring, ready, empty, sp, sq, out, offs, A, B, E, Ptok,
                           stride_oe, stride_oa, BE: gl.constexpr, BA: gl.constexpr, BB: gl.constexpr):  # fmt: skip
    _wgrad_consumer(p_ring, q_ring, ready, empty, sp, sq, out, offs, A, B, E, stride_oe, stride_oa, BE, BA, BB, 1)


@gluon.jit
def fp8_wgrad_gluon_kernel(p_desc, q_desc, sp, sq, out, offs, A, B, E, Ptok, stride_oe, stride_oa,
                           BE: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
    """See the module doc; a persistent grid. SPLIT: one consumer partition per warpgroup (num_warps = 4)."""
    NW: gl.constexpr = gl.num_warps()
    BA: gl.constexpr = p_desc.block_type.shape[0]
    BB: gl.constexpr = q_desc.block_type.shape[0]
    gl.static_assert(BA == (32 if SPLIT else 16) * NW, "BA = 64 rows per warpgroup")
    p_ring = gl.allocate_shared_memory(p_desc.dtype, [NS] + p_desc.block_type.shape, p_desc.layout)
    q_ring = gl.allocate_shared_memory(q_desc.dtype, [NS] + q_desc.block_type.shape, q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2 if SPLIT else 1)
    fence_async_shared()
    if SPLIT:
        gl.warp_specialize([
            (_wgrad_consumer, (p_ring, q_ring, ready, empty, sp, sq, out, offs, A, B, E, stride_oe, stride_oa,
                               BE, BA, BB, 0)),
            (_wgrad_worker_consumer, (p_desc, q_desc, p_ring, q_ring, ready, empty, sp, sq, out, offs, A, B, E,
                                      Ptok, stride_oe, stride_oa, BE, BA, BB)),
            (_wgrad_producer, (p_desc, q_desc, p_ring, q_ring, ready, empty, sp, sq, out, offs, A, B, E, Ptok,
                               stride_oe, stride_oa, BE, BA, BB)),
        ], [4, 1], [232, 40])
    else:
        gl.warp_specialize([
            (_wgrad_consumer, (p_ring, q_ring, ready, empty, sp, sq, out, offs, A, B, E, stride_oe, stride_oa,
                               BE, BA, BB, 0)),
            (_wgrad_producer, (p_desc, q_desc, p_ring, q_ring, ready, empty, sp, sq, out, offs, A, B, E, Ptok,
                               stride_oe, stride_oa, BE, BA, BB)),
        ], [1], [40])


def supported(qxT: torch.Tensor, qdyT: torch.Tensor, like: torch.Tensor) -> bool:
    """Token tiles in fp8 e4m3 on an sm_90 GPU, contiguous, widths (and so dW's A, B) multiples of 128."""
    return all(t.is_cuda and t.dtype == torch.float8_e4m3fn and t.is_contiguous() and t.data_ptr() % 16 == 0
               and t.shape[0] % TILE == 0 and t.shape[1] % TILE == 0 for t in (qxT, qdyT)) \
        and supported_device(qxT.device.index if qxT.device.index is not None else torch.cuda.current_device()) \
        and like.dtype in (torch.float32, torch.bfloat16, torch.float16)  # fmt: skip


def wgrad(qxT: torch.Tensor, sx: torch.Tensor, qdyT: torch.Tensor, sdy: torch.Tensor, offs_E: torch.Tensor,
          like: torch.Tensor, split: bool = SPLIT) -> torch.Tensor:
    """dw [E, D, F] as fp8_tma.wgrad (same arguments, same layout rules). Requires supported(qxT, qdyT, like).
    split: one consumer partition per warpgroup (else one of two warpgroups)."""
    D, Ptok = qxT.shape
    F, E = qdyT.shape[0], like.shape[0]
    dw = empty_grad_like(like, D, F)
    if like.transpose(1, 2).is_contiguous():
        out, P, sP, Q, sQ = dw.transpose(1, 2), qdyT, sdy, qxT, sx  # out[e, f, d] = sum_t dy[t, f] x[t, d]
    else:
        out, P, sP, Q, sQ = dw, qxT, sx, qdyT, sdy
    A, B = out.shape[1], out.shape[2]
    assert out.stride(2) == 1 and sP.is_contiguous() and sQ.is_contiguous()
    if E == 0:
        return dw
    nw = 4 if split else 8
    layout = gl.NVMMASharedLayout.get_default_for([TILE, TILE], gl.float8e4nv)
    p_desc = TensorDescriptor(P, [A, Ptok], [Ptok, 1], [TILE, TILE], layout)
    q_desc = TensorDescriptor(Q, [B, Ptok], [Ptok, 1], [TILE, TILE], layout)
    dev = qxT.device.index if qxT.device.index is not None else torch.cuda.current_device()
    work = E * (A // TILE) * (B // TILE)
    fp8_wgrad_gluon_kernel[(max(1, min(work, _sms(dev))),)](
        p_desc, q_desc, sP, sQ, out, offs_E, A, B, E, Ptok, out.stride(0), out.stride(1),
        BE=max(32, triton.next_power_of_2(E)), SPLIT=split, num_warps=nw, maxnreg=MAXNREG,
    )
    return dw
