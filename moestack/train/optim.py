"""AdamW with decay / no-decay parameter groups, the learning-rate schedule, and gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moestack.config.train_spec import OptimizerSpec, ScheduleSpec
from moestack.ops.adamw import adamw_triton, triton_takes

STREAMING_MIN_NUMEL = 1 << 22  # StreamingAdamW: smaller parameters take torch's multi-tensor kernel (one launch)


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


class StreamingAdamW(torch.optim.AdamW):
    """torch.optim.AdamW(fused=True) - its state, checkpoints and on-device skip (found_inf, grad_scale) - whose step
    runs moestack/ops/adamw's Triton pass on every parameter of at least `min_numel` elements: one launch each, which
    also writes the parameter's bf16 compute copy where one is attached (moestack.memory.compute_weights calls
    attach_compute_copies). The smaller ones (norms, biases, small projections: few bytes, many tensors, where one
    launch each would cost the host more than their bytes cost the GPU) take torch's fused multi-tensor step, and
    their copies one multi-tensor copy. When a group has a parameter neither takes (amsgrad, maximize, a tensor lr, a
    DTensor, mixed dtypes) the whole step is torch's fused one and no copy is written: `copies_written` says which
    happened, and the weight cache recasts after the latter."""

    def __init__(self, params, min_numel: int = STREAMING_MIN_NUMEL, **kwargs):
        super().__init__(params, fused=True, **kwargs)
        self.min_numel = min_numel
        self._copies: dict[int, torch.Tensor] = {}
        self.copies_written = False

    def attach_compute_copies(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """(parameter, its bf16 copy) pairs that every later step writes; an empty iterable detaches them."""
        self._copies = {id(p): c for p, c in pairs}

    def _takes(self, group: dict) -> bool:
        if (group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]
                or not isinstance(group["lr"], float | int)):
            return False
        params = [p for p in group["params"] if p.grad is not None]
        return (all(triton_takes(p, p.grad, self._copies.get(id(p))) for p in params)
                and all(p.grad.dtype == p.dtype for p in params if p.numel() < self.min_numel))

    def _state(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = self.state[p]
        if not state:  # as torch's fused AdamW lays it out
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["step"], state["exp_avg"], state["exp_avg_sq"]

    @torch.no_grad()
    def step(self, closure=None):
        if not all(self._takes(g) for g in self.param_groups):
            self.copies_written = False
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p) for p in params]
            if not all(m.is_contiguous() and v.is_contiguous() and m.dtype == v.dtype == torch.float32
                       for _, m, v in states):
                raise ValueError("StreamingAdamW: exp_avg / exp_avg_sq must be contiguous fp32 (a loaded state "
                                 "dict changed them); build the optimizer with kernels.adamw.backend torch")
            steps = [s for s, _, _ in states]
            torch._foreach_add_(steps, 1)
            lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
            small = [i for i, p in enumerate(params) if p.numel() < self.min_numel]
            if small:
                torch._fused_adamw_([params[i] for i in small], [params[i].grad for i in small],
                                    [states[i][1] for i in small], [states[i][2] for i in small], [],
                                    [steps[i] for i in small], lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd,
                                    eps=eps, amsgrad=False, maximize=False, grad_scale=grad_scale,
                                    found_inf=found_inf)
                copied = [(self._copies[id(params[i])], params[i]) for i in small if id(params[i]) in self._copies]
                if copied:  # a skipped step copies the unchanged values: the copies stay what they were
                    torch._foreach_copy_([c for c, _ in copied], [p for _, p in copied])
            for i, (p, (step, m, v)) in enumerate(zip(params, states, strict=True)):
                if p.numel() >= self.min_numel:
                    adamw_triton(p, p.grad, m, v, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                                 copy=self._copies.get(id(p)), grad_scale=grad_scale, found_inf=found_inf)
            if found_inf is not None:  # a skipped step does not count
                torch._foreach_sub_(steps, [found_inf] * len(steps))
        self.copies_written = True
        return loss


ADAMW_BACKENDS = ("triton", "torch")


def build_optimizer(model: nn.Module, spec: OptimizerSpec, backend: str = "torch") -> torch.optim.AdamW:
    """AdamW over two groups (see `param_groups`). The fused kernel is used only when every param is a CUDA
    floating tensor; otherwise torch's default (foreach where supported, else per-tensor). backend "triton"
    (KernelSpec.adamw.backend, resolved): StreamingAdamW where torch's fused kernel would run."""
    groups = param_groups(model, spec.weight_decay)
    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
    hp = dict(lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    if backend == "triton" and fused:
        return StreamingAdamW(groups, **hp)
    return torch.optim.AdamW(groups, **hp, fused=fused or None)


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
