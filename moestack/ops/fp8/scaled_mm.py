"""FP8 expert GEMMs one expert at a time through torch._scaled_mm's blockwise recipes (cuBLAS: the many-rows path).

torch 2.11's grouped scaled GEMM (`torch._scaled_grouped_mm`, F.scaled_grouped_mm) takes only rowwise / MX /
NVFP4 scales, but the dense `torch._scaled_mm` takes DeepSeek-V3's recipes on sm90 (cuBLAS >= 12.9):
(1x128, 128x128) and (1x128, 1x128), scales given as fp32 dequantisation factors (amax / 448, what quant.py
writes). So with many rows per expert one cuBLAS call per expert is the fast kernel; the loop needs the offsets
on the host (one device-to-host copy per offsets tensor, cached: the gate/up and down GEMMs of a layer and their
backward share it). Below a few hundred rows per expert the launches dominate and the Triton kernels win, so
grouped_gemm.py only takes this path at mean rows per expert >= KernelSpec.fp8.cublas_min_rows (512).

Layouts torch._scaled_mm expects (v1 API, recipe inferred from the scale shapes), per expert e:
    forward / dX   a = q[r0 : r0 + Mp]     [Mp, K] row-major, Mp = rows rounded up to 4 (cuBLAS wants the scale
                                            leading dim aligned; rows past the expert get scale 0 and their output
                                            rows are overwritten by the next expert's call, or zeroed at the end)
                   scale_a [Mp, K/128]      stride (1, Mp): quantize_dual(expert_major=True)'s block for e
                   b = qw[e]                [K, F] column-major (the weight's reduction dim contiguous)
                   scale_b [K/128, F/128]   stride (1, K/128): the block scales of w^T, i.e. the other layout's
                                            scales (quantize_blocks_pair's sT for the forward, s for dX)
    wgrad          dw[e] (or dw[e]^T, whichever is row-major) = qxT[:, tiles of e] @ qdyT[:, tiles of e]^T with
                   both operands' 128x1 token tiles as 1x128 scales along the reduction (tokens):
                   scale_a = s_tiles[g0:g1]^T [D, ng] stride (1, D), scale_b = s_tiles[g0:g1] [ng, F] row-major.
                   With a single tile (ng = 1) torch reads the scales as rowwise, which is the same product.

`SCALED_MM` is the one call site; CPU tests replace it with an emulation that checks these shapes and strides
(tests/ops/test_fp8.py). `available(device)` probes the real call once per device against the dequantised
product (with out= or a copy, 128x128 scales K-block-major as torch's tests pass them or row-major) and says no
(the caller falls back to Triton) if every way raises or disagrees; it prints what it found.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from moestack.ops.fp8 import quant as fq
from moestack.ops.fp8 import reference as fref
from moestack.ops.moe.triton_grouped_gemm import empty_grad_like


def _torch_scaled_mm(a, b, scale_a, scale_b, out_dtype, out):
    if _state["out_kwarg"]:
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype, out=out)
    return out.copy_(torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype))


SCALED_MM = _torch_scaled_mm
# probe results: per device ok; whether _scaled_mm takes out=; whether 128x128 scales go K-block-major (torch's
# tests: [K/128, N/128] with stride (1, K/128)) or row-major [K/128, N/128]
# wgrad of an expert with one 128-token tile (torch reads its scales as rowwise) into fp32: None = untried
_state: dict = {"probe": {}, "host": None, "out_kwarg": True, "b128_kmajor": True, "rowwise_fp32": None}


def _scaled_mm_into(a, b, scale_a, scale_b, out: torch.Tensor) -> None:
    SCALED_MM(a, b, scale_a, scale_b, out.dtype, out)


def host_offsets(offs_E: torch.Tensor) -> list[int]:
    """offs_E.tolist(), cached for the last offsets tensor seen (while it is alive and unmodified)."""
    hit = _state["host"]
    if hit is not None and hit[0]() is offs_E and hit[1] == offs_E._version:
        return hit[2]
    ends = offs_E.tolist()
    _state["host"] = (weakref.ref(offs_E), offs_E._version, ends)
    return ends


def shapes_ok(K: int, F: int) -> bool:
    """Both weight layouts' 128x128 scale grids have a multiple of 4 blocks along the reduction (cuBLAS's
    block-scale layout; the K3 / DeepSeek-V3 widths all do)."""
    return K % 512 == 0 and F % 512 == 0


def rows_mm(qa: torch.Tensor, sa_flat: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, sbT: torch.Tensor,
            ends: list[int], out_dtype: torch.dtype) -> torch.Tensor:
    """y [N, F] = per expert a_e b_e. qa [N, K] (a view of quantize_dual's [N + 3, K] buffer), sa_flat its
    expert-major scales, qb [E, K, F] with K contiguous, its 128x128 block scales sb [E, K/128, F/128] and the
    same transposed, sbT [E, F/128, K/128], both contiguous. Rows >= ends[-1] are zero."""
    N, K = qa.shape
    E, _, F = qb.shape
    nk = K // fref.GROUP
    assert qa.stride() == (K, 1) and qb.stride(1) == 1 and qb.stride(2) == K
    assert sb.is_contiguous() and sbT.is_contiguous()
    assert K % fref.GROUP == 0
    kmajor = _state["b128_kmajor"]
    assert qa._base is not None and qa._base.shape[0] >= N + 3, "qa must come from quant.quantize_dual"
    qa_full = qa._base[:N + 3]  # the buffer's zero rows past N
    y_full = torch.empty((N + 3, F), device=qa.device, dtype=out_dtype)
    starts = [0] + ends[:-1]
    counts = [max(b - a, 0) for a, b in zip(starts, ends)]
    base, mp = fref.expert_major_layout(counts)
    # views by as_strided (one call each: at a few hundred rows per expert this loop's host time is what limits)
    st = torch.as_strided
    a0, s0, y0, b0 = qa_full.storage_offset(), sa_flat.storage_offset(), y_full.storage_offset(), qb.storage_offset()
    sbs = sbT if kmajor else sb
    sb0, nf = sbs.storage_offset(), sb.shape[2]
    sb_stride = (1, nk) if kmajor else (nf, 1)
    for e in range(E):
        if counts[e] == 0:
            continue
        r0, m = starts[e], mp[e]
        _scaled_mm_into(st(qa_full, (m, K), (K, 1), a0 + r0 * K),
                        st(qb, (K, F), (1, K), b0 + e * qb.stride(0)),
                        st(sa_flat, (m, nk), (1, m), s0 + base[e] * nk),  # [m, nk], stride (1, m)
                        st(sbs, (nk, nf), sb_stride, sb0 + e * nk * nf),
                        st(y_full, (m, F), (F, 1), y0 + r0 * F))
    y = y_full[:N]
    y_full[ends[-1] if ends else 0:].zero_()  # rows past the last expert, and the 3 spare rows
    return y


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def wgrad(qxT: torch.Tensor, sx: torch.Tensor, qdyT: torch.Tensor, sdy: torch.Tensor, ends: list[int],
          like: torch.Tensor) -> torch.Tensor:
    """dw [E, D, F] (like's dtype; laid out as like when like is the transposed view of a contiguous [E, F, D]
    parameter) from the 128x1 token tiles of x (qxT [D, P], sx [G, D]) and dy (qdyT [F, P], sdy [G, F]).
    Each expert's GEMM writes only its own dw[e], so every other one runs on a side stream (ordered after the
    current stream's work so far; the current stream waits for it before returning): one expert's last partial
    wave of tiles runs beside the next one's first (faster per layer: benchmarks/RESULTS.md)."""
    D, F = qxT.shape[0], qdyT.shape[0]
    transposed = like.transpose(1, 2).is_contiguous()
    dw = empty_grad_like(like, D, F)
    main = torch.cuda.current_stream(dw.device) if dw.is_cuda else None
    side = _side_stream(dw.device) if main is not None else None
    if side is not None:
        side.wait_stream(main)  # the operands and dw were written / allocated on the current stream
    g0 = 0
    start = 0
    launched = 0
    for e, end in enumerate(ends):
        g1 = g0 + (max(end - start, 0) + fref.GROUP - 1) // fref.GROUP
        start = end
        if g1 == g0:
            dw[e].zero_()
            continue
        with torch.cuda.stream(side) if side is not None and launched % 2 else contextlib.nullcontext():
            _expert_wgrad(qxT, sx, qdyT, sdy, dw, e, g0, g1, transposed)
        launched += 1
        g0 = g1
    if side is not None:
        main.wait_stream(side)
    return dw


def _expert_wgrad(qxT, sx, qdyT, sdy, dw, e: int, g0: int, g1: int, transposed: bool) -> None:
    cols = slice(g0 * fref.GROUP, g1 * fref.GROUP)
    if transposed:  # dw[e]^T [F, D] = dy_e^T x_e
        args = (qdyT[:, cols], qxT[:, cols].t(), sdy[g0:g1].t(), sx[g0:g1], dw[e].t())
    else:
        args = (qxT[:, cols], qdyT[:, cols].t(), sx[g0:g1].t(), sdy[g0:g1], dw[e])
    if g1 - g0 == 1 and dw.dtype != torch.bfloat16 and _state["rowwise_fp32"] is False:
        _rowwise_via_bf16(*args)
    elif g1 - g0 == 1 and dw.dtype != torch.bfloat16 and _state["rowwise_fp32"] is None:
        try:  # one token tile: torch reads the scales as rowwise, whose fp32 output may be refused
            _scaled_mm_into(*args)
            _state["rowwise_fp32"] = True
        except RuntimeError:
            _state["rowwise_fp32"] = False
            _rowwise_via_bf16(*args)
    else:
        _scaled_mm_into(*args)


def _rowwise_via_bf16(a, b, scale_a, scale_b, out):
    tmp = torch.empty(out.shape, device=out.device, dtype=torch.bfloat16)
    _scaled_mm_into(a, b, scale_a, scale_b, tmp)
    out.copy_(tmp)


def available(device: torch.device) -> bool:
    """Whether the per-expert torch._scaled_mm path runs here and matches the dequantised product (probed once
    per device on a small case: two experts, forward and wgrad, bf16 and fp32 outputs)."""
    if SCALED_MM is not _torch_scaled_mm:
        return True  # an emulation installed by a test
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    key = str(device)
    if key not in _state["probe"]:
        _state["probe"][key] = _probe_all(device)
    return _state["probe"][key]


def _probe_all(device: torch.device) -> bool:
    """Try the layouts (out= or a copy; K-block-major 128x128 scales or row-major) until one matches."""
    for out_kwarg in (True, False):
        for kmajor in (True, False):
            _state["out_kwarg"], _state["b128_kmajor"] = out_kwarg, kmajor
            with torch.autocast("cuda", enabled=False), torch.no_grad():  # the first call may come from inside
                ok, msg = _probe(device)
            if ok:
                print(f"moestack.ops.fp8.scaled_mm: torch._scaled_mm blockwise per-expert path on (out= {out_kwarg}, "
                      f"128x128 scales K-block-major {kmajor}); {msg}")
                return True
            print(f"moestack.ops.fp8.scaled_mm: probe (out= {out_kwarg}, K-block-major {kmajor}) failed: {msg}")
    print("moestack.ops.fp8.scaled_mm: torch._scaled_mm blockwise unusable here; the Triton FP8 kernels run instead")
    return False


def _probe(device: torch.device) -> tuple[bool, str]:
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        counts = [130, 6]
        K, F = 512, 512
        x = torch.randn(sum(counts), K, generator=g).to(device, torch.bfloat16)
        w = torch.randn(2, F, K, generator=g).div(K**0.5).to(device).transpose(1, 2)
        dy = torch.randn(sum(counts), F, generator=g).to(device, torch.bfloat16)
        offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        ends = offs.tolist()
        qx, sx, qxT, sxT = fq.quantize_dual(x, offs, expert_major=True)
        (qw, sw), (_, swT) = fq.quantize_blocks_pair(w)
        y = rows_mm(qx, sx, qw, sw, swT, ends, torch.bfloat16)
        _, _, qdyT, sdyT = fq.quantize_dual(dy, offs, expert_major=True)
        dw = wgrad(qxT, sxT, qdyT, sdyT, ends, like=w)
        y_ref = fref.grouped_mm_fp8_reference(x, w, offs)
        dw_ref = torch.stack([x[a:b].float().t() @ dy[a:b].float() for a, b in ((0, 130), (130, 136))])
        err_y = float((y.float() - y_ref).norm() / y_ref.norm())
        err_w = float((dw.float() - dw_ref).norm() / dw_ref.norm())
        return err_y < 1e-2 and err_w < 6e-2, f"rel. error vs the dequantised product: y {err_y:.3g}, dw {err_w:.3g}"
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable this way
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
