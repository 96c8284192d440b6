"""Memory-saving optimizers: Muon (momentum only), AdamW with bf16 states, AdamW offloaded to the CPU.

Per parameter, bytes of optimizer state (fp32 master weights are the parameters themselves, except when offloaded):
    adamw        8   (m, v fp32)                                  torch.optim.AdamW (moestack.train.optim)
    adamw_bf16   4   (m, v bf16, stochastic rounding)             AdamWBF16
    muon         4   (momentum fp32) on matrices; AdamW's 8 on embeddings, head, norms, vectors    Muon
    + offload    0 on the device: fp32 master, m, v in pinned host memory; the update runs on the CPU
                                                                  CPUOffloadAdamW
These are the numbers moestack/planner/cost/memory.py `optimizer_bytes_per_param` assumes.

AdamWBF16, CPUOffloadAdamW and the rounding noise's resume state are in moestack/memory/adamw.py (below train/:
memory/host_adamw.py steps them faster); this module adds Muon and builds an optimizer by name.

Muon (Jordan et al. 2024; Moonlight, arXiv:2502.16982; Kimi K2). For every weight matrix: momentum
buf = mu * buf + g, Nesterov direction u = g + mu * buf, orthogonalised by 5 Newton-Schulz iterations of the
quintic X <- a X + (b A + c A^2) X, A = X X^T, (a, b, c) = (3.4445, -4.7750, 2.0315) from X = u / ||u||_F
(in bf16 on GPU, fp32 on CPU), then scaled by 0.2 * sqrt(max(rows, cols)): Moonlight's choice, which gives the
update the RMS (~0.2) of an AdamW update, so one learning rate and weight decay serve both parts.
W <- W (1 - lr wd) - lr * scaled update. Matrices: 2-D weights except embeddings and the LM head, and each
expert of the stacked expert weights separately (Experts.w_down [E, L, I]: E matrices; w_gate_up [E, 2I, L]: 2E
matrices, gate and up apart, as separate Linear weights would be). AdamW (fp32 m, v) takes embeddings, the LM
head, norms, biases, vectors and the KDA short-conv kernels. Sharded (DTensor) matrices are gathered for the
orthogonalisation and the local shard of the result is applied (every rank computes each matrix; simple, not
fast).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adamw import adamw as _adamw  # the functional AdamW torch.optim.AdamW runs

from moestack.config.base import ConfigError
from moestack.config.train_spec import OptimizerSpec
from moestack.memory.adamw import AdamWBF16, CPUOffloadAdamW, local_tensor
from moestack.memory.host_adamw import FusedAdamW, HostOffloadAdamW
from moestack.train.optim import _no_decay, build_optimizer, param_groups

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MUON_RMS = 0.2


# ------------------------------------------------------------------------------------------------------------
# Muon


def newton_schulz(G: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonalisation U V^T of each matrix G = U S V^T ([..., m, n], batched over leading dims) by
    the quintic Newton-Schulz iteration (module docstring). bf16 on GPU, fp32 on CPU; returns G's dtype."""
    a, b, c = NS_COEFFS
    X = G.to(torch.bfloat16 if G.is_cuda else torch.float32)
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


def muon_matrices(name: str, t: torch.Tensor) -> torch.Tensor:
    """View of a Muon parameter (or its update) as a batch of matrices [M, rows, cols] (see module docstring)."""
    if t.dim() == 2:
        return t.unsqueeze(0)
    E, R, C = t.shape
    if name.endswith("w_gate_up"):
        return t.reshape(E * 2, R // 2, C)  # [E, 2I, L]: the gate rows, then the up rows, per expert
    return t


def muon_update(name: str, grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool = True,
                ns_steps: int = NS_STEPS) -> torch.Tensor:
    """buf <- momentum * buf + grad (in place); returns the scaled orthogonalised update, in grad's shape."""
    buf.mul_(momentum).add_(grad)
    u = grad.add(buf, alpha=momentum) if nesterov else buf.clone()
    if isinstance(u, DTensor):
        if u.dim() == 3 and all(pl.is_replicate() or (pl.is_shard() and pl.dim == 0) for pl in u.placements):
            # stacked experts split by expert: every local expert is whole, orthogonalise it where it lives
            local = _scaled_orthogonal(name, u.to_local(), ns_steps)
            return DTensor.from_local(local, u.device_mesh, u.placements, run_check=False, shape=u.shape,
                                      stride=u.stride())
        full = u.full_tensor()
        o = _scaled_orthogonal(name, full, ns_steps)
        return distribute_tensor(o, u.device_mesh, u.placements, src_data_rank=None)
    return _scaled_orthogonal(name, u, ns_steps)


def _scaled_orthogonal(name: str, u: torch.Tensor, ns_steps: int) -> torch.Tensor:
    mats = muon_matrices(name, u)
    o = newton_schulz(mats, ns_steps) * (MUON_RMS * math.sqrt(max(mats.shape[-2:])))
    return o.reshape(u.shape)


def muon_param_names(model: nn.Module) -> set[str]:
    """Names of the parameters Muon updates: 2-D weights except embeddings and the LM head, and the stacked expert
    weights (3-D, Experts.w_gate_up / w_down)."""
    skip = set()
    for mname, module in model.named_modules():
        if isinstance(module, nn.Embedding) or mname.split(".")[-1] == "lm_head":
            skip.update(id(p) for p in module.parameters(recurse=False))
    names = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in skip:
            continue
        is_expert = p.dim() == 3 and name.rsplit(".", 1)[-1] in ("w_gate_up", "w_down")
        if p.dim() == 2 or is_expert:
            names.add(name)
    return names


class Muon(torch.optim.Optimizer):
    """Muon for matrices, AdamW for the rest (module docstring). One lr and weight decay for both parts.

    Build with `Muon.for_model(model, ...)`; groups carry "muon": True/False and Muon groups a "names" list.
    State: Muon params: momentum_buffer (fp32, param shape); AdamW params: step, exp_avg, exp_avg_sq (fp32).
    """

    def __init__(self, param_groups: list[dict], lr: float = 1e-3, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = NS_STEPS, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, betas=betas, eps=eps,
                        weight_decay=weight_decay, muon=False)
        super().__init__(param_groups, defaults)
        for group in self.param_groups:
            if group["muon"]:
                assert len(group["names"]) == len(group["params"]), "Muon groups need one name per parameter"

    @classmethod
    def for_model(cls, model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1, **kwargs) -> Muon:
        """Muon group (matrices, decayed), AdamW decay group and AdamW no-decay group (optim.param_groups rule)."""
        muon_names = muon_param_names(model)
        muon, named = [], []
        adam_decay, adam_no_decay = [], []
        seen = set()
        for name, p in model.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if name in muon_names:
                muon.append(p)
                named.append(name)
            else:
                (adam_no_decay if _no_decay(p) else adam_decay).append(p)
        groups = [
            {"params": muon, "names": named, "muon": True, "weight_decay": weight_decay, "name": "muon"},
            {"params": adam_decay, "muon": False, "weight_decay": weight_decay, "name": "adamw_decay"},
            {"params": adam_no_decay, "muon": False, "weight_decay": 0.0, "name": "adamw_no_decay"},
        ]
        return cls([g for g in groups if g["params"]], lr=lr, weight_decay=weight_decay, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            if group["muon"]:
                for name, p in zip(group["names"], group["params"]):
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
                    g = p.grad.float() if p.grad.dtype != torch.float32 else p.grad
                    upd = muon_update(name, g, state["momentum_buffer"], group["momentum"], group["nesterov"],
                                      group["ns_steps"])
                    p.mul_(1 - lr * wd)
                    p.add_(upd.to(p.dtype), alpha=-lr)
                continue
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if params:
                b1, b2 = group["betas"]
                _adamw(
                    params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
                    [self.state[p]["exp_avg_sq"] for p in params], [], [self.state[p]["step"] for p in params],
                    foreach=False, amsgrad=False, beta1=b1, beta2=b2, lr=lr, weight_decay=wd, eps=group["eps"],
                    maximize=False,
                )
        return loss


# ------------------------------------------------------------------------------------------------------------
# by name


OPTIMIZERS = ("adamw", "adamw_bf16", "muon")


def build_optimizer_from_name(model: nn.Module, name: str, spec: OptimizerSpec, offload: bool = False,
                              seed: int = 0) -> torch.optim.Optimizer:
    """The optimizer Plan.optimizer names, with Plan.offload.optimizer: "adamw" (torch AdamW, or CPUOffloadAdamW
    with offload), "adamw_bf16" (AdamWBF16, or CPUOffloadAdamW with bf16 states), "muon" (Muon; no offload).
    Hyper-parameters from `spec` (lr, betas, eps, weight_decay); decay groups as moestack.train.optim."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer: '{name}' is not one of {', '.join(OPTIMIZERS)}")
    hp = dict(lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    if name == "muon":
        if offload:
            raise ConfigError("optimizer: muon with offload.optimizer is not supported (Newton-Schulz on the CPU is "
                              "too slow); use adamw or adamw_bf16 with offload, or muon without it")
        return Muon.for_model(model, **hp)
    if offload:
        state_dtype = torch.bfloat16 if name == "adamw_bf16" else torch.float32
        return CPUOffloadAdamW(param_groups(model, spec.weight_decay), state_dtype=state_dtype, seed=seed, **hp)
    if name == "adamw_bf16":
        return AdamWBF16(param_groups(model, spec.weight_decay), seed=seed, **hp)
    return build_optimizer(model, spec)


def state_bytes(optimizer: torch.optim.Optimizer, device_type: str | None = None) -> int:
    """Bytes of tensor state the optimizer holds (on `device_type` only, if given; masters included)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = local_tensor(value)
                if device_type is None or local.device.type == device_type:
                    total += local.numel() * local.element_size()
    return total


def build_host_aware_optimizer(model: nn.Module, name: str, spec: OptimizerSpec, offload: bool = False,
                               seed: int = 0) -> torch.optim.Optimizer:
    """build_optimizer_from_name, with the host steps fast: offload -> HostOffloadAdamW ("adamw": fp32 states,
    "adamw_bf16": bf16 states); "adamw" without offload but with parameters in host memory (expert offload) ->
    torch AdamW with fused=True (its CPU kernel for the host parameters, the CUDA one for the rest; the default
    would fall back to the single-tensor loop for every parameter). Anything else: build_optimizer_from_name."""
    params = [p for p in model.parameters() if p.requires_grad]
    if offload and name in ("adamw", "adamw_bf16"):
        hp = {"lr": spec.lr, "betas": spec.betas, "eps": spec.eps, "weight_decay": spec.weight_decay}
        state_dtype = torch.bfloat16 if name == "adamw_bf16" else torch.float32
        return HostOffloadAdamW(param_groups(model, spec.weight_decay), state_dtype=state_dtype, seed=seed, **hp)
    on_host = any(local_tensor(p).device.type == "cpu" for p in params)
    mixed = on_host and any(local_tensor(p).device.type != "cpu" for p in params)
    if (name == "adamw" and not offload and mixed
            and all(local_tensor(p).device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)):
        return FusedAdamW(param_groups(model, spec.weight_decay), lr=spec.lr, betas=spec.betas, eps=spec.eps,
                          weight_decay=spec.weight_decay)
    return build_optimizer_from_name(model, name, spec, offload=offload, seed=seed)
