"""FP8 (e4m3) Linear layers with DeepSeek-V3's blockwise recipe: the LatentMoE's down / up projections in FP8.

A Linear y = x W^T (W: nn.Linear's weight [out, in]) is the expert GEMM of fp8_grouped_gemm.py with one expert:
x_ND = x [N, in], w_EDF = W^T viewed as [1, in, out], offs_E = [N]. So it reuses Fp8GroupedMMv3 whole:
    forward  y  = x W^T      x: 1x128 tiles along in                 W^T: 128x128 blocks
    dgrad    dx = dy W       dy: 1x128 tiles along out               W: the same 128x128 blocks, transposed
    wgrad    dW = dy^T x     x and dy: 128x1 tiles along the N tokens (the reduction of this GEMM)
with fp32 scales = amax / 448 per tile / block and fp32 accumulation (module doc of fp8_grouped_gemm.py).

What backward saves: x as its fp8 128x1 token tiles (about half the bytes of bf16 x; exactly the wgrad operand),
the weight (the parameter itself, no copy) and the one-element offsets. The weight's fp8 blocks in both layouts
come from fp8_weight_cache.pair, keyed on the parameter behind the view W.t().unsqueeze(0): quantised once per
optimizer step / parameter version and shared by every micro-batch, as for the experts.

Which kernels run: cuBLAS (one torch._scaled_mm blockwise call per GEMM, fp8_scaled_mm.py) when N >=
MOESTACK_FP8_CUBLAS_MIN_ROWS (512) and in, out are multiples of 512 on an sm90 GPU whose probe accepts it; the
weight gradient alone from MOESTACK_FP8_CUBLAS_WGRAD_MIN_ROWS with in, out multiples of 16; else the Triton kernels
(swap-AB at N <= MOESTACK_FP8_SWAP_MAX_ROWS). The K3 / DeepSeek-V3 projections (7168 <-> 3584, thousands of
tokens) take cuBLAS throughout.

Sync-free: the row count N is known on the host, so it is passed as the host offsets (Fp8GroupedMMv3's
host_ends) and the device offsets are made by a fill kernel: no device-to-host read on either path (after the
one-time cuBLAS probe per device), and the expert GEMMs' cached host offsets (fsm.host_offsets keeps one
entry) are left alone.

Independent of MOESTACK_MOE_BACKEND / MOESTACK_FP8_V3: a layer is FP8 once converted (Fp8Linear,
convert_to_fp8_linear, enable_fp8_latent_projections); the conversion keeps the Parameter objects, so optimizer
state, FSDP, checkpoints and state_dict keys do not change. Bias is not supported (the projections have none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from moestack.ops.moe import fp8_quant as fq
from moestack.ops.moe.fp8_grouped_gemm import Fp8GroupedMMv3
from moestack.ops.opaque import opaque

NameFilter = Callable[[str, nn.Module], bool]


@opaque
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, *, q_dtype: torch.dtype | None = None,
               cublas_min_rows: int | None = None) -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T in FP8 (module doc), differentiable in x and weight. Output in the autocast
    dtype inside autocast, else the promoted dtype of x and weight (x's in practice), as fp8_grouped_gemm.grouped_mm.
    q_dtype None = fp8_quant.FP8 (looked up per call, as the expert backend does); float32 runs the same kernels on
    unrounded scaled values (interpreter tests); cublas_min_rows None = $MOESTACK_FP8_CUBLAS_MIN_ROWS."""
    from moestack.ops.moe.reference import _compute_dtype

    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x [..., {x.shape[-1]}] does not match weight {tuple(weight.shape)} [out, in]")
    q_dtype = fq.FP8 if q_dtype is None else q_dtype
    dtype = _compute_dtype(x, weight)
    x_ND = x.reshape(-1, x.shape[-1]).to(dtype)
    N = x_ND.shape[0]
    offs_E = torch.full((1,), N, dtype=torch.int32, device=x.device)  # a fill kernel, no host-to-device copy
    # W^T as [1, in, out]: a view of the parameter, so the fp8 weight cache keys on the parameter itself
    y = Fp8GroupedMMv3.apply(x_ND, weight.t().unsqueeze(0), offs_E, q_dtype, None, cublas_min_rows, [N])
    return y.view(*x.shape[:-1], weight.shape[0])


class Fp8Linear(nn.Linear):
    """nn.Linear without bias whose forward is fp8_linear (module doc). Same parameters and state_dict as
    nn.Linear; made by convert_to_fp8_linear from an existing Linear, or built directly."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        if bias:
            raise ValueError(f"Fp8Linear({in_features} -> {out_features}): bias is not supported; use bias=False")
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            raise ValueError(f"{self}: bias is not supported by the FP8 Linear; remove it or revert to nn.Linear")
        return fp8_linear(x, self.weight)


def _selected(module: nn.Module, names_or_filter: Iterable[str] | NameFilter) -> list[tuple[str, nn.Module]]:
    """(qualified name, submodule) pairs chosen by a list of names (each must exist) or a (name, module) filter."""
    if callable(names_or_filter):
        return [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear) and names_or_filter(n, m)]
    return [(n, module.get_submodule(n)) for n in names_or_filter]


def convert_to_fp8_linear(module: nn.Module, names_or_filter: Iterable[str] | NameFilter) -> int:
    """Turn the chosen nn.Linear submodules of module (qualified names, or a filter (name, module) -> bool over
    its Linear submodules) into Fp8Linear in place; returns how many were converted (already-FP8 ones are skipped).
    Raises for a chosen module that is not a plain nn.Linear or has a bias."""
    chosen = _selected(module, names_or_filter)
    for name, m in chosen:  # check all before changing any: a bad name leaves the module as it was
        if type(m) is not nn.Linear and not isinstance(m, Fp8Linear):
            raise ValueError(f"convert_to_fp8_linear: {name or '<root>'} is {type(m).__name__}, not a plain nn.Linear")
        if m.bias is not None:
            raise ValueError(f"convert_to_fp8_linear: {name or '<root>'} has a bias, which Fp8Linear does not support")
    converted = 0
    for _, m in chosen:
        if type(m) is nn.Linear:
            # reassigning the class keeps the module object, its Parameter objects and hooks (optimizer state,
            # FSDP, checkpoints and state_dict keys unchanged); Fp8Linear adds no state, so this is all it needs
            m.__class__ = Fp8Linear
            converted += 1
    return converted


def revert_fp8_linear(module: nn.Module) -> int:
    """Turn every Fp8Linear in module back into nn.Linear (same objects); returns how many."""
    reverted = 0
    for m in module.modules():
        if type(m) is Fp8Linear:
            m.__class__ = nn.Linear
            reverted += 1
    return reverted


def latent_projection_names(model_or_moe: nn.Module) -> list[str]:
    """Qualified names of every MoE's down_proj / up_proj (LatentMoE layers; plain MoE layers have none)."""
    from moestack.model.moe import MoE  # here, not at import: the model package imports moestack.ops.moe

    names = []
    for prefix, m in model_or_moe.named_modules():
        if isinstance(m, MoE):
            for proj in ("down_proj", "up_proj"):
                if getattr(m, proj) is not None:
                    names.append(f"{prefix}.{proj}" if prefix else proj)
    return names


def enable_fp8_latent_projections(model_or_moe: nn.Module) -> int:
    """Run the latent down / up projections of every MoE in model_or_moe (a MoE, a Transformer, a pipeline stage)
    in FP8; returns how many Linear layers were converted. DeepSeek-V3 ran every Linear but embedding, head and
    router in FP8, so these qualify; router, experts (their own FP8 backend) and shared experts are untouched."""
    return convert_to_fp8_linear(model_or_moe, latent_projection_names(model_or_moe))
