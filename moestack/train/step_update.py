"""The end of a training step without host syncs: clip, optimizer update and the non-finite skip as device work, and
the step's numbers read back to the host once.

Why: every host read (`.item()`, `float(norm)`) waits for the device to drain, and the host idles instead of
queueing the next kernels. So:

    loss      accumulated on the device (float64, the same sums as Python floats)
    clip      the coefficient min(1, max_norm / (norm + 1e-6)) computed on the device
    skip      torch's fused Adam / AdamW take `found_inf` (the AMP grad-scaler hook): a non-finite loss or norm skips
              the update inside the kernel (parameters, moments and step counts untouched); other optimizers (Muon,
              bf16 AdamW, the host-offload ones, AdamW on CPU) read the flag once before stepping
    fold      with the fused kernel on one device the clip is folded into it as `grad_scale` = 1 / coefficient (the
              kernel divides each gradient by it as it streams them): one pass over the gradients fewer
              (8 bytes per parameter). The quotient g / (1 / c) may differ from the product g * c in the last bit.
    read      loss, norm, the skip flag and the aux losses in one `.tolist()` at the end of the step, after the
              optimizer update was queued: the one sync of the step, which the step time needed anyway.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def fused_skip_supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether optimizer.step() honours `found_inf` / `grad_scale` on the device: torch's Adam / AdamW with every
    param group fused, and StreamingAdamW."""
    from moestack.train.optim import StreamingAdamW

    groups = optimizer.param_groups
    return (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW, StreamingAdamW) and bool(groups)
            and all(g.get("fused") for g in groups))


def _fold_clip_supported(optimizer: torch.optim.Optimizer) -> bool:
    """grad_scale folding: plain fp32 / bf16 / fp16 tensors only (the kernel reads an fp32 scale: fp64 parameters
    would be clipped with a rounded coefficient; DTensor parameters would mix a plain tensor into their op)."""
    return all(not isinstance(p, DTensor) and p.dtype != torch.float64
               for g in optimizer.param_groups for p in g["params"])


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)) as a float64 device scalar (1 where norm is not finite: the step is skipped).
    float64 so that it equals the Python-float arithmetic bit for bit."""
    coef = (max_norm / (norm.double() + CLIP_EPS)).clamp(max=1.0)
    return torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))


def step_optimizer(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], norm: torch.Tensor,
                   finite: torch.Tensor, max_norm: float, clipped: bool) -> bool | None:
    """Clip (unless `clipped`: the caller did) and step, skipping the update when `finite` (device bool) is False.

    Returns None when the skip was decided on the device (the flag is read with the step's numbers later), else the
    host value of `finite` (read here: the optimizer cannot skip by itself).
    """
    fused = fused_skip_supported(optimizer)
    fold = fused and not clipped and max_norm > 0 and _fold_clip_supported(optimizer)
    if not clipped and max_norm > 0 and not fold:
        coef = clip_coefficient(norm, max_norm)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:  # DTensor gradients: their local shards, in place
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, grads in by_dtype.items():
            torch._foreach_mul_(grads, coef.to(dtype))
    if not fused:
        ok = bool(finite)  # the one mid-step read, for optimizers without an on-device skip
        if ok:
            optimizer.step()
        return ok
    # fp32 like torch.amp.GradScaler's (the kernel reads a float); on the parameters' device
    device = optimizer.param_groups[0]["params"][0].device
    optimizer.found_inf = (~finite).to(device=device, dtype=torch.float32).reshape(())
    if fold:
        optimizer.grad_scale = (1.0 / clip_coefficient(norm, max_norm)).to(device=device, dtype=torch.float32)
    try:
        optimizer.step()
    finally:
        for name in ("found_inf", "grad_scale"):
            optimizer.__dict__.pop(name, None)
    return None


def read_stats(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """{name: scalar tensor} -> {name: float} with one device-to-host copy (all on the first one's device)."""
    names = list(values)
    if not names:
        return {}
    device = values[names[0]].device
    flat = torch.stack([values[n].detach().reshape(()).to(device=device, dtype=torch.float64)
                        for n in names]).tolist()
    return dict(zip(names, flat, strict=True))
