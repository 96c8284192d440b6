"""Memory-saving optimizers: Muon (momentum only), AdamW with bf16 states, AdamW offloaded to the CPU.

Per parameter, bytes of optimizer state (fp32 master weights are the parameters themselves, except when offloaded):
    adamw        8   (m, v fp32)                                  torch.optim.AdamW (moestack.train.optim)
    adamw_bf16   4   (m, v bf16, stochastic rounding)             AdamWBF16
    muon         4   (momentum fp32) on matrices; AdamW's 8 on embeddings, head, norms, vectors    Muon
    + offload    0 on the device: fp32 master, m, v in pinned host memory; the update runs on the CPU
                                                                  CPUOffloadAdamW
These are the numbers moestack/planner/cost.py `optimizer_bytes_per_param` assumes.

AdamWBF16. m and v are stored in bf16 and written back with stochastic rounding: the fp32 result's bit pattern
gets a uniform random 16-bit integer added below the bf16 mantissa before truncation, so E[round(x)] = x and the
many small EMA increments that round-to-nearest would drop (v += (1 - b2) g^2 is often below half a bf16 ulp of
v) survive on average. The arithmetic is AdamW's, in fp32, on the fp32 master weights. Stochastic rounding was
chosen over Kahan compensation because compensation needs a second bf16 buffer per state (back to 8 bytes).
Measured deviation from fp32 AdamW: tests/memory/test_optimizers.py (a few hundred steps on a small regression).

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

CPUOffloadAdamW (ZeRO-Offload style). Gradients are copied device -> pinned host on a side stream, each
parameter's AdamW update runs on the CPU as soon as its gradient has arrived (while later gradients are still
copying), and the updated fp32 master is copied back to the device parameter on another stream while the CPU
moves on to the next parameter. The math is torch's AdamW (single-tensor path), so on a CPU-only run it matches
torch.optim.AdamW exactly. A pinned host parameter (an offloaded expert) is its own master and is stepped in place.

Resume. With stochastic rounding the noise is part of the trajectory, so the optimizers that draw it (AdamWBF16,
CPUOffloadAdamW with bf16 states, moestack.memory.host_adamw.HostOffloadAdamW) carry the noise source's state in
their state dict (`RoundingStateMixin`): under `param_groups[i]["rounding_rng"]` (i: the first group with
parameters), one entry per rank. It lives in a param group because torch.distributed.checkpoint's get_state_dict /
set_state_dict (moestack.train.checkpoint) keep only "state" and "param_groups" of an optimizer's state dict. A
state dict without it (saved before it was kept) loads with one warning and the noise restarts from the seed.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adamw import adamw as _adamw  # the functional AdamW torch.optim.AdamW runs

from moestack.config.base import ConfigError
from moestack.config.train_spec import OptimizerSpec
from moestack.train.optim import _no_decay, build_optimizer, param_groups

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MUON_RMS = 0.2


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ------------------------------------------------------------------------------------------------------------
# stochastic rounding


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 x -> bf16, rounding each element up or down in magnitude with probability proportional to the
    distance (unbiased). Exact for values representable in bf16."""
    assert x.dtype == torch.float32, x.dtype
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # low 16 bits zero: exact cast


class _Generators:
    """One seeded generator per device (stochastic rounding must not consume the model's RNG stream)."""

    def __init__(self, seed: int):
        self.seed, self.table = seed, {}
        self._pending: dict[str, bytes] = {}  # loaded states of generators not created yet (by str(device))

    def __call__(self, device: torch.device) -> torch.Generator:
        if device not in self.table:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            saved = self._pending.pop(str(device), None)
            if saved is not None:
                gen.set_state(torch.frombuffer(bytearray(saved), dtype=torch.uint8))
            self.table[device] = gen
        return self.table[device]

    def state(self) -> tuple:
        """("generator", seed, {device: generator state bytes}): what decides every later draw."""
        states = dict(self._pending)
        states.update({str(d): g.get_state().numpy().tobytes() for d, g in self.table.items()})
        return ("generator", self.seed, states)

    def set_state(self, state: tuple) -> None:
        _, seed, states = state
        self.seed, self.table = seed, {}
        self._pending = {str(d): bytes(b) for d, b in states.items()}  # applied as each device's generator appears


# ------------------------------------------------------------------------------------------------------------
# resume: the rounding noise's state in the state dict (module docstring)

ROUNDING_RNG_KEY = "rounding_rng"
NO_ROUNDING_STATE = "rounding noise restarts: the state dict has no rounding-noise state"  # the warning's text


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RoundingStateMixin:
    """state_dict / load_state_dict that carry the stochastic-rounding noise source's state of every rank under
    `param_groups[i][ROUNDING_RNG_KEY]` = {"version": 1, "per_rank": [state of rank r, ...]} (i: the first group
    with parameters). Subclasses say what the state is: `_rounding_state()` (a picklable tuple whose first item
    names the kind of noise source, "generator" or "table", or None: no stochastic rounding) and
    `_set_rounding_state(state)`.

    With several ranks state_dict gathers (collective, as checkpoint saves are): DCP keeps one copy of a non-tensor
    entry, so every rank writes the same list and each reads back its own."""

    def _rounding_state(self):
        return None

    def _set_rounding_state(self, state) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        sd = super().state_dict()
        mine = self._rounding_state()
        if mine is None or not sd["param_groups"]:
            return sd
        _, world = _world()
        if world > 1:
            per_rank = [None] * world
            dist.all_gather_object(per_rank, mine)
        else:
            per_rank = [mine]
        groups = sd["param_groups"]
        target = next((g for g in groups if g["params"]), groups[0])
        target[ROUNDING_RNG_KEY] = {"version": 1, "per_rank": per_rank}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        saved = None
        for group in state_dict.get("param_groups", []):
            if ROUNDING_RNG_KEY in group:
                saved = saved or group[ROUNDING_RNG_KEY]
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # torch copied it into the live groups; it is not a hyper-parameter
            group.pop(ROUNDING_RNG_KEY, None)
        mine = self._rounding_state()
        if mine is None:
            return
        name = type(self).__name__
        if saved is None:
            warnings.warn(f"{name}: {NO_ROUNDING_STATE} (saved before it was kept) and restarts from the seed, so "
                          "the resumed run is not bitwise the uninterrupted one", stacklevel=2)
            return
        rank, world = _world()
        per_rank = saved["per_rank"]
        if len(per_rank) != world:
            warnings.warn(f"{name}: rounding-noise state saved by {len(per_rank)} ranks, loading on {world}; "
                          "stochastic-rounding noise restarts from the seed", stacklevel=2)
            return
        state = tuple(per_rank[rank])
        if state[0] != mine[0]:
            warnings.warn(f"{name}: rounding-noise state of another noise source ({state[0]}, this optimizer draws "
                          f"from a {mine[0]}); stochastic-rounding noise restarts from the seed", stacklevel=2)
            return
        self._set_rounding_state(state)


def _adamw_bf16_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                       lr: float, b1: float, b2: float, eps: float, wd: float, gen: torch.Generator) -> None:
    """One AdamW update of fp32 p with bf16 states m, v (in place), in the order of torch's AdamW."""
    g = g.float()
    m32 = m.float().lerp_(g, 1 - b1)
    v32 = v.float().mul_(b2).addcmul_(g, g, value=1 - b2)
    p.mul_(1 - lr * wd)
    denom = (v32.sqrt() / math.sqrt(1 - b2**step)).add_(eps)
    p.addcdiv_(m32.to(p.dtype), denom.to(p.dtype), value=-lr / (1 - b1**step))
    m.copy_(stochastic_round_bf16(m32, gen))
    v.copy_(stochastic_round_bf16(v32, gen))


class AdamWBF16(RoundingStateMixin, torch.optim.Optimizer):
    """AdamW with m and v stored in bf16 (stochastic rounding; see module docstring). fp32 parameters stay.

    Args as torch.optim.AdamW (lr, betas, eps, weight_decay; param groups may override), plus `seed` for the
    rounding noise. State per parameter: step (int), exp_avg and exp_avg_sq (bf16, the parameter's shape); the
    generators' states in the state dict (RoundingStateMixin).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._gen = _Generators(seed)

    def _rounding_state(self):
        return self._gen.state()

    def _set_rounding_state(self, state) -> None:
        self._gen.set_state(state)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                pl = _local(p)
                _adamw_bf16_update(pl, _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                                   state["step"], group["lr"], b1, b2, group["eps"], group["weight_decay"],
                                   self._gen(pl.device))
        return loss


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
# CPU-offloaded AdamW


class CPUOffloadAdamW(RoundingStateMixin, torch.optim.Optimizer):
    """AdamW whose fp32 master weights and states live in (pinned) host memory; the update runs on the CPU.

    Args as torch.optim.AdamW, plus `state_dtype` (torch.float32, or torch.bfloat16 for bf16 m, v with
    stochastic rounding as AdamWBF16) and `seed` (rounding noise). The device parameters keep their dtype (fp32
    in moestack: the device then holds no optimizer state at all; bf16 device parameters would also halve the
    weights). State per parameter: master (host copy, absent for pinned host parameters), step, exp_avg,
    exp_avg_sq (host); with bf16 states the rounding generator's state in the state dict (RoundingStateMixin).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, state_dtype: torch.dtype = torch.float32, seed: int = 0):
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype must be float32 or bfloat16, got {state_dtype}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype
        self._gen = _Generators(seed)
        self._d2h = self._h2d = None
        self._grad_staging: dict[int, torch.Tensor] = {}
        if torch.cuda.is_available():
            self._d2h, self._h2d = torch.cuda.Stream(), torch.cuda.Stream()

    def _rounding_state(self):
        return self._gen.state() if self.state_dtype == torch.bfloat16 else None

    def _set_rounding_state(self, state) -> None:
        self._gen.set_state(state)

    # -- host state ------------------------------------------------------------------------------------------
    @staticmethod
    def _in_place(p: torch.Tensor) -> bool:
        """A pinned fp32+ host parameter is its own master."""
        local = _local(p)
        return local.device.type == "cpu" and local.is_pinned() and local.dtype != torch.bfloat16

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if state:
            return state
        local = _local(p).detach()
        master_dtype = torch.promote_types(local.dtype, torch.float32)
        moment_dtype = torch.bfloat16 if self.state_dtype == torch.bfloat16 else master_dtype
        if not self._in_place(p):
            state["master"] = self._host_like(p, master_dtype)
            _local(state["master"]).copy_(local)
        state["step"] = torch.zeros((), dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = self._host_like(p, moment_dtype, pin=self.pin_moments)
            _local(state[key]).zero_()
        return state

    pin_moments = True  # m, v in pinned memory (subclasses that never copy them may say no)

    def _host_like(self, p: torch.Tensor, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
        """A host tensor of p's local shape (pinned when `pin` and a GPU is present); a DTensor with p's mesh and
        placements when p is one (so sharded checkpoints see sharded states)."""
        local = _local(p)
        host = torch.empty(local.shape, dtype=dtype, device="cpu", pin_memory=pin and torch.cuda.is_available())
        if isinstance(p, DTensor):
            return DTensor.from_local(host, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return host

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        return _local(self.state[p]["master"]) if "master" in self.state[p] else _local(p).detach()

    # -- step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if self._h2d is not None:  # last step's weight copies are done; this step's wait for backward's reads
            self._h2d.synchronize()
            self._h2d.wait_stream(torch.cuda.current_stream())
        work = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        grads = self._grads_to_host([p for _, p in work])
        for (group, p), (host_grad, event) in zip(work, grads):
            if event is not None:
                event.synchronize()  # this gradient has arrived; later ones are still copying
            state = self._init_state(p)
            master = self._master(p)
            self._update(master, host_grad, _local(state["exp_avg"]), _local(state["exp_avg_sq"]), state, group)
            if "master" in state:
                self._to_device(p, master)
        if self._h2d is not None:
            torch.cuda.current_stream().wait_stream(self._h2d)  # the next forward reads the new weights
        return loss

    def _update(self, master: torch.Tensor, host_grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, state: dict,
                group: dict) -> None:
        """One AdamW update of the host master and states (counts the step); subclasses swap the kernels."""
        b1, b2 = group["betas"]
        if self.state_dtype == torch.bfloat16:
            state["step"] += 1
            _adamw_bf16_update(master, host_grad, m, v, int(state["step"]), group["lr"], b1, b2, group["eps"],
                               group["weight_decay"], self._gen(torch.device("cpu")))
        else:
            _adamw([master], [host_grad.to(master.dtype)], [m], [v], [], [state["step"]], foreach=False,
                   amsgrad=False, beta1=b1, beta2=b2, lr=group["lr"], weight_decay=group["weight_decay"],
                   eps=group["eps"], maximize=False)

    def _grads_to_host(self, params: list[torch.Tensor]) -> list[tuple[torch.Tensor, object]]:
        """Start every gradient's D2H copy (in order, on the side stream); (host grad, event) per parameter."""
        out = []
        for p in params:
            g = _local(p.grad)
            if g.device.type == "cpu":
                out.append((g, None))
                continue
            staging = self._grad_staging.get(id(p))
            if staging is None or staging.shape != g.shape or staging.dtype != g.dtype:
                staging = torch.empty(g.shape, dtype=g.dtype, device="cpu", pin_memory=True)
                self._grad_staging[id(p)] = staging
            self._d2h.wait_stream(torch.cuda.current_stream(g.device))
            with torch.cuda.stream(self._d2h):
                staging.copy_(g, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._d2h)
            out.append((staging, event))
        return out

    def _to_device(self, p: torch.Tensor, master: torch.Tensor) -> None:
        dst = _local(p)
        if dst.device.type == "cpu":
            dst.copy_(master)
            return
        with torch.cuda.stream(self._h2d):
            dst.copy_(master, non_blocking=True)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch moves loaded states to each parameter's device; keep them on the host and resync the params."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            for key in ("master", "exp_avg", "exp_avg_sq"):
                if key in state and _local(state[key]).device.type != "cpu":
                    host = self._host_like(p, state[key].dtype)
                    _local(host).copy_(_local(state[key]))
                    state[key] = host
            if "master" in state:
                _local(p).detach().copy_(_local(state["master"]))


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
                local = _local(value)
                if device_type is None or local.device.type == device_type:
                    total += local.numel() * local.element_size()
    return total
