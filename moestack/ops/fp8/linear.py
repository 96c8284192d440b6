"""FP8 (e4m3) Linear layers with DeepSeek-V3's blockwise recipe (the projections `precision: fp8` converts).

A Linear y = x W^T (W: nn.Linear's weight [out, in]) is the expert GEMM of grouped_gemm.py with one expert:
x_ND = x [N, in], w_EDF = W^T viewed as [1, in, out], offs_E = [N]. So it reuses Fp8GroupedMM whole:
    forward  y  = x W^T      x: 1x128 tiles along in                 W^T: 128x128 blocks
    dgrad    dx = dy W       dy: 1x128 tiles along out               W: the same 128x128 blocks, transposed
    wgrad    dW = dy^T x     x and dy: 128x1 tiles along the N tokens (the reduction of this GEMM)
with fp32 scales = amax / 448 per tile / block and fp32 accumulation (module doc of grouped_gemm.py).

What backward saves: x as its fp8 128x1 token tiles (about half the bytes of bf16 x; exactly the wgrad operand),
the weight (the parameter itself, no copy) and the one-element offsets. The weight's fp8 blocks in both layouts
come from weight_cache.pair, keyed on the parameter behind the view W.t().unsqueeze(0): quantised once per
optimizer step / parameter version and shared by every micro-batch, as for the experts.

Which kernels run: cuBLAS (one torch._scaled_mm blockwise call per GEMM, scaled_mm.py) when N >= cublas_min_rows
(KernelSpec.fp8.cublas_min_rows, 512) and in, out are multiples of 512 on an sm90 GPU whose probe accepts it (the
weight gradient alone with in, out multiples of 16); else the Triton kernels. The K3 / DeepSeek-V3 projections
(7168 <-> 3584, thousands of tokens) take cuBLAS throughout.

Sync-free: the row count N is known on the host, so it is passed as the host offsets (Fp8GroupedMM's host_ends) and
the device offsets are made by a fill kernel: no device-to-host read on either path (after the one-time cuBLAS probe
per device), and the expert GEMMs' cached host offsets (scaled_mm.host_offsets keeps one entry) are left alone.

The conversion (convert_to_fp8_linear; convert.py applies it) keeps the Parameter objects, so optimizer state, FSDP,
checkpoints and state_dict keys do not change. Bias is not supported (the projections have none).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from moestack.ops.fp8.grouped_gemm import CUBLAS_MIN_ROWS, Fp8GroupedMM
from moestack.ops.fp8.reference import FP8
from moestack.ops.opaque import opaque


@opaque
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, *, q_dtype: torch.dtype = FP8,
               cublas_min_rows: int = CUBLAS_MIN_ROWS, cache_mode: str = "on") -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T in FP8 (module doc), differentiable in x and weight. Output in the autocast
    dtype inside autocast, else the promoted dtype of x and weight (x's in practice), as grouped_gemm.grouped_mm.
    q_dtype float32 runs the same kernels on unrounded scaled values (interpreter tests)."""
    from moestack.ops.moe.reference import _compute_dtype

    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x [..., {x.shape[-1]}] does not match weight {tuple(weight.shape)} [out, in]")
    dtype = _compute_dtype(x, weight)
    x_ND = x.reshape(-1, x.shape[-1]).to(dtype)
    N = x_ND.shape[0]
    offs_E = torch.full((1,), N, dtype=torch.int32, device=x.device)  # a fill kernel, no host-to-device copy
    # W^T as [1, in, out]: a view of the parameter, so the fp8 weight cache keys on the parameter itself
    y = Fp8GroupedMM.apply(x_ND, weight.t().unsqueeze(0), offs_E, q_dtype, cublas_min_rows, [N], cache_mode)
    return y.view(*x.shape[:-1], weight.shape[0])


class Fp8Linear(nn.Linear):
    """nn.Linear without bias whose forward is fp8_linear (module doc). Same parameters and state_dict as
    nn.Linear; made by convert_to_fp8_linear from an existing Linear (which sets the fp8_* choices), or built
    directly. fp8_q_dtype float32: the interpreter tests' unrounded mode."""

    fp8_q_dtype: torch.dtype = FP8
    fp8_cublas_min_rows: int = CUBLAS_MIN_ROWS
    fp8_cache_mode: str = "on"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        if bias:
            raise ValueError(f"Fp8Linear({in_features} -> {out_features}): bias is not supported; use bias=False")
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)

    # a compile boundary as a whole: were dynamo to compile this frame (it holds nothing but the opaque op), it would
    # recompile per input dtype and shape up to its recompile limit and then check those guards on every call
    @opaque
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            raise ValueError(f"{self}: bias is not supported by the FP8 Linear; remove it or revert to nn.Linear")
        return fp8_linear(x, self.weight, q_dtype=self.fp8_q_dtype, cublas_min_rows=self.fp8_cublas_min_rows,
                          cache_mode=self.fp8_cache_mode)


def convert_to_fp8_linear(module: nn.Module, names: Iterable[str], q_dtype: torch.dtype = FP8,
                          cublas_min_rows: int = CUBLAS_MIN_ROWS, cache_mode: str = "on") -> int:
    """Turn the named nn.Linear submodules of module (qualified names, each must exist) into Fp8Linear in place with
    these choices; returns how many were converted (already-FP8 ones get the choices, and are not counted). Raises for
    a named module that is not a plain nn.Linear or has a bias, before changing any."""
    chosen = [(n, module.get_submodule(n)) for n in names]
    for name, m in chosen:
        if type(m) is not nn.Linear and not isinstance(m, Fp8Linear):
            raise ValueError(f"convert_to_fp8_linear: {name or '<root>'} is {type(m).__name__}, not a plain nn.Linear")
        if m.bias is not None:
            raise ValueError(f"convert_to_fp8_linear: {name or '<root>'} has a bias, which Fp8Linear does not support")
    converted = 0
    for _, m in chosen:
        if type(m) is nn.Linear:
            # reassigning the class keeps the module object, its Parameter objects and hooks (optimizer state,
            # FSDP, checkpoints and state_dict keys unchanged); Fp8Linear adds no parameters or buffers
            m.__class__ = Fp8Linear
            converted += 1
        m.fp8_q_dtype, m.fp8_cublas_min_rows, m.fp8_cache_mode = q_dtype, cublas_min_rows, cache_mode
    return converted


def revert_fp8_linear(module: nn.Module) -> int:
    """Turn every Fp8Linear in module back into nn.Linear (same objects); returns how many."""
    reverted = 0
    for m in module.modules():
        if type(m) is Fp8Linear:
            m.__class__ = nn.Linear
            for attr in ("fp8_q_dtype", "fp8_cublas_min_rows", "fp8_cache_mode"):
                m.__dict__.pop(attr, None)
            reverted += 1
    return reverted
