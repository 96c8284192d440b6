"""AdamW with decay / no-decay parameter groups, the learning-rate schedule, and gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moestack.config.train_spec import OptimizerSpec, ScheduleSpec


def _no_decay(param: nn.Parameter) -> bool:
    # 1-D params are norm weights and biases; modules mark others (KDA A_log / dt_bias) with _no_weight_decay
    return param.ndim < 2 or bool(getattr(param, "_no_weight_decay", False))


def _router_lr_scales(model: nn.Module) -> dict[int, float]:
    """id(router weight) -> RouterSpec.lr_scale, for the routers whose scale is not 1."""
    from moestack.model.moe import Router

    return {id(m.weight): m.spec.lr_scale for m in model.modules()
            if isinstance(m, Router) and m.spec.lr_scale != 1.0}


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """[decay group (2-D+ weights, embeddings included), no-decay group], plus one decayed group per router
    learning-rate scale other than 1 (RouterSpec.lr_scale, as the group's "lr_scale"); frozen params are left out."""
    decay, no_decay = [], []
    scaled: dict[float, list[nn.Parameter]] = {}
    scales = _router_lr_scales(model)
    for param in model.parameters():  # parameters() de-duplicates tied weights
        if not param.requires_grad:
            continue
        if id(param) in scales:
            scaled.setdefault(scales[id(param)], []).append(param)
        else:
            (no_decay if _no_decay(param) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
            *({"params": ps, "weight_decay": weight_decay, "lr_scale": s, "name": f"router_lr_x{s:g}"}
              for s, ps in scaled.items())]


def build_optimizer(model: nn.Module, spec: OptimizerSpec) -> torch.optim.AdamW:
    """AdamW over two groups (see `param_groups`). The fused kernel is used only when every param is a CUDA
    floating tensor; otherwise torch's default (foreach where supported, else per-tensor)."""
    groups = param_groups(model, spec.weight_decay)
    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                             fused=fused or None)


def lr_factor(step: int, spec: ScheduleSpec, total_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based).

    Warm-up: (step+1)/(warmup+1) for step < warmup, so no step runs at lr 0 and step `warmup` is the peak.
    Cosine: from 1 at step `warmup` to min_lr_ratio at the last step (total_steps-1), then held there.
    """
    warmup = spec.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if spec.decay == "constant":
        return 1.0
    progress = min((step - warmup) / max(total_steps - 1 - warmup, 1), 1.0)
    return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, spec: ScheduleSpec, total_steps: int,
                    base_lr: float) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR giving lr = base_lr * lr_factor(step) (times a group's optional "lr_scale").

    Call `scheduler.step()` once after each optimizer step.
    """
    for group in optimizer.param_groups:
        group["lr"] = base_lr * group.get("lr_scale", 1.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, spec, total_steps))


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (fp32 scalar tensor, fp64 for fp64 gradients, measured BEFORE clipping);
    scales gradients in place so the norm is at most max_norm. max_norm 0 disables clipping (the norm is still
    returned)."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros((), dtype=torch.float32)
    total_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    if isinstance(total_norm, DTensor):  # sharded grads (FSDP2): the reduced norm, same on every rank
        total_norm = total_norm.full_tensor()
    return total_norm if total_norm.dtype == torch.float64 else total_norm.float()
