"""Grouped weight gradient for few rows per expert on sm_90, in Gluon: the stores and loads run under the MMAs.

    out[e, a, b] = sum over the expert's rows r of P[r, a] Q[r, b]      (dW in the parameter's layout, b contiguous)

At <= a few hundred rows per expert dW is a write stream: each output tile is written once after a reduction of
depth = the expert's rows. The Triton kernels in gg_tma.py wait for each tile's MMA, then store it from registers
while the tensor cores idle. Here the overlap is explicit:

- One program per (a-tile of BA = 16 x warps columns, expert); the default configs run 4 warps and fit two programs
  per SM. The expert's P[rows, a-tile] is copied to shared memory once (cp.async, rows past the expert
  zero-filled) and is the MMA's A operand (transposed view) for every b-tile.
- Q[rows, b-tile] tiles stream in by TMA through a per-expert device-side descriptor of shape [end, B]: rows past
  the expert are zero-filled by the copy engine, never read (the tensor's tail rows may hold anything). The ring
  holds Q_ROWS rows, i.e. Q_ROWS / depth tiles, so the shallower the reduction the further ahead the loads run;
  one mbarrier per slot.
- b-tiles go in pairs (nothing in flight across the loop's back-edge: ptxas serialises wgmma otherwise, C7514):
  both MMAs are issued async; the first tile's epilogue (fp32 -> out dtype -> coalescing layout -> plain global
  stores) runs under the second MMA; after one CTA barrier the freed slots are refilled. Plain stores beat TMA
  stores from shared-memory buffers here, and so does the layout conversion before them (README.md, "Measured").
- The reduction depth is the expert's rows rounded up to KS, 2 KS or RMAX (a constexpr path each, picked at run
  time; shared-memory views need power-of-two shapes): the MMA work follows the rows present.
- Experts with more than RMAX rows are left to gg_tma.gg_wgrad_kernel_resident's chunked path (a second launch in
  which the small experts exit at once); empty experts store zero tiles.

At 16-32 rows per expert the chunked kernel stays faster, so gg_tma's auto choice starts at 64; two 4-warp programs
per SM beat one 8-warp program (times in README.md and benchmarks/RESULTS.md).

No atomics; each output element is written once in a fixed order (bitwise reproducible; equal to the chunked
kernel's result in every measured case). Requirements (checked by `supported`): sm_90, bf16 / fp16 operands,
out [E, A, B] with unit last stride and stride(0) = A * stride(1), A % 64 == 0, B % 128 == 0. Legend as
gg_tma.py; BA/BB dW tile, KS reduction slice.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

TILE_A = 64  # BA per warpgroup: wgmma's M (4 warps: BA = 64, 8 warps: BA = 128)
SLICE = 64  # KS: the reduction depth is the expert's rows rounded up to this
KS = gl.constexpr(SLICE)
SMEM_BYTES = 232448  # sm_90's shared memory per block
# (BB, Q_ROWS, num_warps) per RMAX: the fastest measured (H200, K3 EP16 shapes); shared memory = RMAX * BA * 2 (P)
# + Q_ROWS * BB * 2 (Q ring) + BA * BB * out bytes (the epilogue's layout conversion); fit_config shrinks BB to fit
CONFIGS = {64: (128, 256, 4), 128: (128, 256, 4), 256: (64, 512, 4)}


@gluon.jit
def _issue_rows(buf, base, stride_n, col0, start, end, R: gl.constexpr, C: gl.constexpr, layout: gl.constexpr):
    """cp.async of base[start : start + R, col0 : col0 + C] into buf [R, C]; rows at or past end zero-filled."""
    rows = start + gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    ptrs = base + rows.to(gl.int64)[:, None] * stride_n + cols[None, :]
    async_copy.async_copy_global_to_shared(buf, ptrs, mask=(rows < end)[:, None])


@gluon.jit
def _load_tile(q_desc, q_tiles, bars, slot, start, b0, DEPTH: gl.constexpr, BB: gl.constexpr):
    """TMA of Q[start : start + DEPTH, b0 : b0 + BB] into ring slot `slot` (DEPTH / KS boxes, one barrier)."""
    bar = bars.index(slot)
    buf = q_tiles.index(slot)
    mbarrier.expect(bar, DEPTH * BB * q_desc.dtype.primitive_bitwidth // 8)
    for k in gl.static_range(DEPTH // KS):
        tma.async_copy_global_to_shared(q_desc, [start + k * KS, b0], bar, buf.slice(k * KS, KS))


@gluon.jit
def _tma_pairs(q_desc, OUT, stride_o, p_smem, q_ring, bars, start, row0, n_pairs,
               DEPTH: gl.constexpr, BA: gl.constexpr, BB: gl.constexpr, Q_ROWS: gl.constexpr,
               acc_layout: gl.constexpr, st_layout: gl.constexpr):  # fmt: skip
    """The b-tile loop at reduction depth DEPTH with TMA loads: the ring holds Q_ROWS / DEPTH tiles (so the
    shallower the depth, the further ahead the loads run); one CTA barrier per pair of tiles."""
    NSLOT: gl.constexpr = Q_ROWS // DEPTH
    HALF: gl.constexpr = NSLOT // 2  # pairs in flight
    q_tiles = q_ring._reinterpret(q_ring.dtype, [NSLOT, DEPTH, BB], q_ring.layout)  # the bytes as NSLOT tiles
    for j in gl.static_range(HALF):
        if j < n_pairs:
            _load_tile(q_desc, q_tiles, bars, 2 * j, start, 2 * j * BB, DEPTH, BB)
            _load_tile(q_desc, q_tiles, bars, 2 * j + 1, start, (2 * j + 1) * BB, DEPTH, BB)
    zero = gl.zeros([BA, BB], gl.float32, layout=acc_layout)
    p_t = p_smem.slice(0, DEPTH, dim=0).permute((1, 0))  # [BA, DEPTH]: the A operand, MN-major
    o_rows = (row0 + gl.arange(0, BA, layout=gl.SliceLayout(1, st_layout))).to(gl.int64) * stride_o
    o_cols = gl.arange(0, BB, layout=gl.SliceLayout(0, st_layout))
    o_ptrs = OUT + o_rows[:, None] + o_cols[None, :]
    for i in range(n_pairs):
        s0 = (2 * i) % NSLOT
        phase = (i // HALF) & 1
        mbarrier.wait(bars.index(s0), phase)
        mbarrier.wait(bars.index(s0 + 1), phase)
        acc0 = warpgroup_mma(p_t, q_tiles.index(s0), zero, use_acc=False, is_async=True)
        acc1 = warpgroup_mma(p_t, q_tiles.index(s0 + 1), zero, use_acc=False, is_async=True)
        acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, ))
        gl.store(o_ptrs + 2 * i * BB, gl.convert_layout(acc0.to(OUT.dtype.element_ty), st_layout))
        acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, ))
        gl.store(o_ptrs + (2 * i + 1) * BB, gl.convert_layout(acc1.to(OUT.dtype.element_ty), st_layout))
        gl.thread_barrier()  # pair i's MMAs are done in every warp: its slots may be refilled
        nxt = i + HALF
        if nxt < n_pairs:  # into the slots pair i just released
            _load_tile(q_desc, q_tiles, bars, s0, start, 2 * nxt * BB, DEPTH, BB)
            _load_tile(q_desc, q_tiles, bars, s0 + 1, start, (2 * nxt + 1) * BB, DEPTH, BB)


@gluon.jit
def _wgrad_gluon_kernel(P, Q, OUT, offs, A, B, stride_pn, stride_qn, stride_o,
                        RMAX: gl.constexpr, BB: gl.constexpr, Q_ROWS: gl.constexpr):  # fmt: skip
    """See the module doc; grid (A // BA, E)."""
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == 4 or NW == 8, "one or two warpgroups: num_warps 4 or 8")
    gl.static_assert(Q_ROWS >= 2 * RMAX, "the ring must hold a pair of tiles at the deepest depth")
    BA: gl.constexpr = 16 * NW
    dtype: gl.constexpr = P.dtype.element_ty
    i_a = gl.program_id(0)
    e = gl.program_id(1)
    end = gl.load(offs + e)
    start = gl.load(offs + gl.maximum(e - 1, 0))
    start = gl.where(e > 0, start, 0)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                         instr_shape=[16, BB, 16])  # fmt: skip
    p_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BA // 8), BA // 8], [NW, 1], [1, 0])
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([RMAX, BA], dtype)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KS, BB], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [RMAX, BA], p_sl)
    q_ring = gl.allocate_shared_memory(dtype, [Q_ROWS, BB], q_sl)
    OB: gl.constexpr = 8 if OUT.dtype.element_ty.primitive_bitwidth == 16 else 4  # 16-byte vectors
    TPC: gl.constexpr = BB // OB if BB // OB < 32 else 32  # noqa: FURB136
    st_layout: gl.constexpr = gl.BlockedLayout([1, OB], [32 // TPC, TPC], [NW, 1], [1, 0])
    bars = gl.allocate_shared_memory(gl.int64, [Q_ROWS // KS, 1], mbarrier.MBarrierLayout())
    rows = end - start
    if rows <= RMAX:  # larger experts: gg_tma's chunked path (a separate launch)
        a0 = i_a * BA
        row0 = e * A + a0
        n_pairs = B // (2 * BB)
        if rows == 0:  # an empty expert: zero tiles (no descriptor over zero rows)
            z_rows = (row0 + gl.arange(0, BA, layout=gl.SliceLayout(1, st_layout))).to(gl.int64) * stride_o
            z_ptrs = OUT + z_rows[:, None] + gl.arange(0, BB, layout=gl.SliceLayout(0, st_layout))[None, :]
            for j in range(2 * n_pairs):
                gl.store(z_ptrs + j * BB, gl.zeros([BA, BB], OUT.dtype.element_ty, layout=st_layout))
        else:
            for k in gl.static_range(Q_ROWS // KS):
                mbarrier.init(bars.index(k), count=1)
            q_desc = tma.make_tensor_descriptor(Q, [end, B], [stride_qn, 1], [KS, BB], q_sl)
            depth = gl.cdiv(rows, KS)  # KS-row slices the MMA needs
            _issue_rows(p_smem, P, stride_pn, a0, start, end, RMAX, BA, p_load)
            async_copy.commit_group()
            async_copy.wait_group(0)
            fence_async_shared()  # P (cp.async, generic proxy) and the barrier inits, before wgmma / TMA use them
            gl.thread_barrier()
            D2: gl.constexpr = 2 * KS if 2 * KS < RMAX else RMAX  # noqa: FURB136
            if RMAX == KS:
                _tma_pairs(q_desc, OUT, stride_o, p_smem, q_ring, bars, start, row0, n_pairs,
                           RMAX, BA, BB, Q_ROWS, acc_layout, st_layout)  # fmt: skip
            else:
                if depth == 1:
                    _tma_pairs(q_desc, OUT, stride_o, p_smem, q_ring, bars, start, row0, n_pairs,
                               KS, BA, BB, Q_ROWS, acc_layout, st_layout)  # fmt: skip
                elif depth == 2:
                    _tma_pairs(q_desc, OUT, stride_o, p_smem, q_ring, bars, start, row0, n_pairs,
                               D2, BA, BB, Q_ROWS, acc_layout, st_layout)  # fmt: skip
                else:
                    _tma_pairs(q_desc, OUT, stride_o, p_smem, q_ring, bars, start, row0, n_pairs,
                               RMAX, BA, BB, Q_ROWS, acc_layout, st_layout)  # fmt: skip
            for k in gl.static_range(Q_ROWS // KS):
                mbarrier.invalidate(bars.index(k))


def rmax_for(bt_max: int) -> int:
    """Rows an expert may have for this kernel: twice the mean (bucketed as BT_MAX), at least 64, at most 256."""
    return min(256, max(64, 2 * bt_max))


def supported(P: torch.Tensor, Q: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether _wgrad_gluon_kernel takes these operands (see the module doc); else the Triton kernels run."""
    A, B = out.shape[1], out.shape[2]
    ok_dtype = P.dtype in (torch.bfloat16, torch.float16) and Q.dtype == P.dtype
    return (P.is_cuda and ok_dtype and torch.cuda.get_device_capability(P.device)[0] == 9
            and P.stride(1) == 1 and Q.stride(1) == 1 and out.stride(2) == 1 and out.stride(0) == A * out.stride(1)
            and A % TILE_A == 0 and B % 128 == 0 and out.data_ptr() % 16 == 0
            and (out.stride(1) * out.element_size()) % 16 == 0 and out.dtype in (torch.bfloat16, torch.float16,
                                                                                   torch.float32))  # fmt: skip


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for the device-side TMA descriptors (128 bytes per program)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def smem_bytes(rmax: int, bb: int, q_rows: int, num_warps: int, out_bytes: int) -> int:
    """Shared memory of one program: P, the Q ring, the epilogue's layout-conversion scratch, the barriers."""
    ba = TILE_A * num_warps // 4
    return 2 * rmax * ba + 2 * q_rows * bb + ba * bb * out_bytes + 8 * (q_rows // SLICE)


def fit_config(config: tuple[int, int, int], rmax: int, A: int, B: int, out_bytes: int,
               smem_limit: int = SMEM_BYTES) -> tuple[int, int, int]:
    """config adjusted to the operands: BB divides B in pairs, 4 warps where A is not a multiple of 128, and BB
    halved (then the ring) until the program fits `smem_limit` bytes of shared memory (fp32 gradients double the
    conversion scratch)."""
    bb, q_rows, nw = config
    while B % (2 * bb):
        bb //= 2
    if A % (TILE_A * nw // 4):
        nw = 4
    while smem_bytes(rmax, bb, q_rows, nw, out_bytes) > smem_limit - 1024 and (bb > 16 or q_rows > 2 * rmax):
        if bb > 16:
            bb //= 2
        else:
            q_rows //= 2
    return bb, q_rows, nw


def wgrad_gluon(P: torch.Tensor, Q: torch.Tensor, out: torch.Tensor, offs_E: torch.Tensor, rmax: int,
                config: tuple[int, int, int] | None = None) -> None:
    """out[e] = P[rows of e]^T @ Q[rows of e] for the experts of <= rmax rows (others untouched: the caller's
    chunked kernel writes them). Requires supported(P, Q, out). config: (BB, Q_ROWS, num_warps), default
    CONFIGS[rmax], fitted to the operands and the device's shared memory by fit_config."""
    from moestack.ops.launch import device_limits

    E, A, B = out.shape
    limit = device_limits(P.device.index if P.device.index is not None else torch.cuda.current_device()).smem
    bb, q_rows, nw = fit_config(config or CONFIGS[rmax], rmax, A, B, out.element_size(), limit)
    out2 = torch.as_strided(out, (E * A, B), (out.stride(1), 1))  # [e * A + a, b]
    triton.set_allocator(_scratch)  # a context variable: set on the thread that launches (autograd's too)
    _wgrad_gluon_kernel[(A // (TILE_A * nw // 4), E)](
        P, Q, out2, offs_E, A, B, P.stride(0), Q.stride(0), out2.stride(0), RMAX=rmax, BB=bb, Q_ROWS=q_rows,
        num_warps=nw,
    )  # fmt: skip
